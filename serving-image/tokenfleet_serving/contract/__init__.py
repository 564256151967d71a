"""What the operator and the serving image agree on, defined once and imported by both.

- ``router_files``: the router's ``router.json`` and ``endpoints.json`` (written by the operator into the
  router's ConfigMap, read by ``tokenfleet route``);
- ``pod_env``: the ``TOKENFLEET_*`` environment the operator gives Slice member pods;
- ``cost``: the cost of a token, as every part that reports it computes it;
- ``termination``: the termination message a workload leaves for the operator when it exits.

These modules import no torch and no Kubernetes client: the operator image carries them too.
"""
