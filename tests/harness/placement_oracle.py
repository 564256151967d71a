"""An independent, brute-force model of what the placer must respect, written
from the rules in docs/placement.md rather than from the placer's code: node
eligibility, free capacity after a plan, and whether a Slice fits a state."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from tokenfleet_operator.gang.placement import BoundPod, Node, Placement, PlacementPlan, SliceRequest


def taint_blocks(taint, tolerations) -> bool:
    if taint.effect == "PreferNoSchedule":
        return False
    for tol in tolerations:
        effect_ok = tol.effect in ("", taint.effect)
        if tol.key == "" and tol.operator == "Exists" and effect_ok:
            return False
        if tol.key == taint.key and effect_ok and (tol.operator == "Exists" or tol.value == taint.value):
            return False
    return True


def index_of(node: Node, request: SliceRequest) -> int | None:
    value = node.labels.get(request.host_index_label, "")
    return int(value) if value.isdigit() else None


def eligible(node: Node, request: SliceRequest) -> bool:
    return (node.ready and not node.unschedulable
            and node.allocatable.get(request.resource, 0) > 0
            and all(node.labels.get(k) == v for k, v in request.node_selector.items())
            and not any(taint_blocks(t, request.tolerations) for t in node.taints)
            and (request.domain_label is None or request.domain_label in node.labels)
            and (request.topology is None or index_of(node, request) is not None))


def used_by_pods(pods: Iterable[BoundPod], resource: str) -> dict[str, int]:
    used: dict[str, int] = defaultdict(int)
    for pod in pods:
        used[pod.node] += pod.requests.get(resource, 0)
    return used


def used_by_placements(placements: Iterable[Placement], slices: dict[str, SliceRequest], resource: str) -> dict[str, int]:
    used: dict[str, int] = defaultdict(int)
    for placement in placements:
        request = slices[placement.slice_key]
        if request.resource == resource:
            for _, node in placement.members:
                used[node] += request.per_host
    return used


def fits(request: SliceRequest, nodes: list[Node], free: dict[str, int]) -> bool:
    """Whether some domain holds ``hosts`` eligible nodes with ``per_host`` free each
    (consecutive host indices when the Slice has a topology)."""
    domains: dict[str | None, list[Node]] = defaultdict(list)
    for node in nodes:
        if eligible(node, request):
            domains[node.labels.get(request.domain_label) if request.domain_label else None].append(node)
    for members in domains.values():
        if request.topology is None:
            if sum(1 for n in members if free[n.name] >= request.per_host) >= request.hosts:
                return True
            continue
        by_index: dict[int, Node] = {}
        for node in sorted(members, key=lambda n: n.name):
            by_index.setdefault(index_of(node, request), node)
        for start in by_index:
            if all(i in by_index and free[by_index[i].name] >= request.per_host
                   for i in range(start, start + request.hosts)):
                return True
    return False


def free_after(nodes: list[Node], pods: Iterable[BoundPod], placements: Iterable[Placement],
               slices: dict[str, SliceRequest], resource: str) -> dict[str, int]:
    pods, placements = list(pods), list(placements)
    by_pods = used_by_pods(pods, resource)
    by_placements = used_by_placements(placements, slices, resource)
    return {n.name: n.allocatable.get(resource, 0) - by_pods[n.name] - by_placements[n.name] for n in nodes}


def queue_order(request: SliceRequest) -> tuple:
    """The documented order: higher priority first, then older, then key."""
    return (-request.priority, request.created, request.key)


def plan_placements(plan: PlacementPlan) -> list[Placement]:
    return [d for d in plan.decisions if isinstance(d, Placement)]
