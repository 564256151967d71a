"""Gang scheduling of Slices: all-or-nothing, topology-aware placement and the Slice's own state machine.

- ``placement/``: the pure placer: (nodes, bound pods, pending Slices, queues) -> placements;
- ``snapshot.py``: cluster objects -> the placer's inputs;
- ``plan.py``: one scheduler pass as a pure function of a snapshot;
- ``scheduler.py``: the shell that lists, plans and binds;
- ``slice_state.py``: a Slice's phase, conditions and member pods as a pure function of what is observed.
"""
