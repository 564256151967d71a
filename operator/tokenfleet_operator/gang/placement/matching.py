"""Which nodes a Slice's members may run on, ignoring how full the nodes are.

A node is eligible when it is Ready and not cordoned, offers the Slice's
accelerator resource, carries every label of the member template's node
selector, has no untolerated NoSchedule/NoExecute taint, carries the domain
label (if the Slice names one) and, for a Slice with a topology, a host index.
"""
from __future__ import annotations

from collections.abc import Iterable

from .model import Node, SliceRequest, Taint, Toleration

# Why a node is not eligible, in the order the checks run (used in reasons).
NOT_READY = "not Ready or cordoned"
NO_RESOURCE = "no {resource}"
SELECTOR = "not matching nodeSelector"
TAINTED = "untolerated taint"
NO_DOMAIN = "no {domain_label} label"
NO_INDEX = "no integer {host_index_label} label"
EXCLUSION_ORDER = (NOT_READY, NO_RESOURCE, SELECTOR, TAINTED, NO_DOMAIN, NO_INDEX)


def tolerates(toleration: Toleration, taint: Taint) -> bool:
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if not toleration.key:  # validated: operator is Exists
        return True
    if toleration.key != taint.key:
        return False
    return toleration.operator == "Exists" or toleration.value == taint.value


def untolerated_taints(taints: Iterable[Taint], tolerations: Iterable[Toleration]) -> list[Taint]:
    """Taints that forbid scheduling (PreferNoSchedule never does) and no toleration covers."""
    tolerations = tuple(tolerations)
    return [t for t in taints
            if t.effect != "PreferNoSchedule" and not any(tolerates(tol, t) for tol in tolerations)]


def host_index(node: Node, label: str) -> int | None:
    value = node.labels.get(label)
    if value is None or not value.isdigit():
        return None
    return int(value)


def exclusion(node: Node, request: SliceRequest) -> str | None:
    """None when ``node`` may hold a member of ``request``; otherwise the first failed check."""
    if not node.ready or node.unschedulable:
        return NOT_READY
    if node.allocatable.get(request.resource, 0) <= 0:
        return NO_RESOURCE
    for key, value in request.node_selector.items():
        if node.labels.get(key) != value:
            return SELECTOR
    if node.taints and untolerated_taints(node.taints, request.tolerations):
        return TAINTED
    if request.domain_label is not None and request.domain_label not in node.labels:
        return NO_DOMAIN
    if request.topology is not None and host_index(node, request.host_index_label) is None:
        return NO_INDEX
    return None


def eligibility_signature(request: SliceRequest) -> tuple:
    """Two requests with the same signature have the same eligible nodes and domains."""
    return (
        request.resource,
        request.domain_label,
        request.host_index_label if request.topology is not None else None,
        tuple(sorted(request.node_selector.items())),
        tuple(sorted(set(request.tolerations), key=lambda t: (t.key, t.operator, t.value, t.effect))),
    )
