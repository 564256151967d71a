"""Gang placement: a pure function from a cluster snapshot and a queue of
Slices to an all-or-nothing, topology-aware placement per Slice.

See docs/placement.md for the algorithm and the queue policy.
"""
from .model import (
    BLOCKED_BY_QUEUE_HEAD,
    DOMAIN_TOO_SMALL,
    INSUFFICIENT_CAPACITY,
    NO_MATCHING_NODES,
    PREEMPTING,
    QUEUE_NOT_FOUND,
    QUOTA_EXCEEDED,
    QUOTA_TOO_SMALL,
    BoundPod,
    Node,
    Placement,
    PlacementPlan,
    Preemption,
    Queue,
    SliceRequest,
    Taint,
    Toleration,
    Unplaced,
    parse_topology,
)
from .placer import place, queue_order
from .requeue import RequeueState, admission_timed_out, after_timeout, may_queue, requeue_delay

__all__ = [
    "BLOCKED_BY_QUEUE_HEAD", "DOMAIN_TOO_SMALL", "INSUFFICIENT_CAPACITY", "NO_MATCHING_NODES", "PREEMPTING",
    "QUEUE_NOT_FOUND", "QUOTA_EXCEEDED", "QUOTA_TOO_SMALL", "BoundPod", "Node", "Placement", "PlacementPlan",
    "Preemption", "Queue", "RequeueState", "SliceRequest", "Taint", "Toleration", "Unplaced",
    "admission_timed_out", "after_timeout", "may_queue", "parse_topology", "place", "queue_order",
    "requeue_delay",
]
