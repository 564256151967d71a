"""The reconciles: read the cache, compute the desired state (builders, pure), write what differs, write status.

- ``inference_service.py``: InferenceService -> Slices, router Deployment, ConfigMap, Services; status;
- ``slice.py``: Slice -> member pods (the Slice state machine in ``gang/slice_state.py``); status;
- ``drift.py``: whether a live object already holds everything a desired manifest says.
"""
