"""The environment the operator gives every member pod of a Slice (``builders/slice_pods.py`` writes it).

Each variable says who reads it: the bundled batch worker (``tokenfleet batch``) or any workload a user
runs in a Slice (documented in docs/api.md). A test holds the builder, this list and the readers together.
"""
from __future__ import annotations

from enum import StrEnum


class PodEnv(StrEnum):
    SLICE = "TOKENFLEET_SLICE"                          # the Slice's name
    MEMBER_INDEX = "TOKENFLEET_MEMBER_INDEX"            # 0..hosts-1; member 0 leads
    SLICE_HOSTS = "TOKENFLEET_SLICE_HOSTS"              # members in the gang
    LEADER_POD = "TOKENFLEET_LEADER_POD"                # the leader's pod name (its hostname)
    LEADER_ADDRESS = "TOKENFLEET_LEADER_ADDRESS"        # hosts > 1: the leader's DNS name in the Slice's Service
    ATTEMPT = "TOKENFLEET_ATTEMPT"                      # gang restarts so far: every member of one attempt agrees
    REVISION = "TOKENFLEET_REVISION"                    # hash of the Slice spec the pod was made from
    TOPOLOGY = "TOKENFLEET_TOPOLOGY"                    # spec.topology, when set
    CHECKPOINT_STORE = "TOKENFLEET_CHECKPOINT_STORE"    # spec.checkpoint.store
    CHECKPOINT_INTERVAL_SECONDS = "TOKENFLEET_CHECKPOINT_INTERVAL_SECONDS"   # spec.checkpoint.intervalSeconds
    CHECKPOINT_DIR = "TOKENFLEET_CHECKPOINT_DIR"        # where a pvc:// or hostpath:// store is mounted
    RESTORE_FROM = "TOKENFLEET_RESTORE_FROM"            # on a gang restart with restoreOnRestart: resume from here


# Who reads what. ``BATCH_WORKER``: ``tokenfleet batch`` reads these. The rest are for user workloads only
# (the bundled worker needs no leader address, as its members meet in the shared checkpoint store, and it
# commits by rounds of items, not by time).
BATCH_WORKER = frozenset({PodEnv.SLICE, PodEnv.MEMBER_INDEX, PodEnv.SLICE_HOSTS, PodEnv.ATTEMPT, PodEnv.REVISION,
                          PodEnv.CHECKPOINT_STORE, PodEnv.CHECKPOINT_DIR, PodEnv.RESTORE_FROM})
WORKLOAD_ONLY = frozenset(PodEnv) - BATCH_WORKER
