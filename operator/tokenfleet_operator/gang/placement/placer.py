"""``place``: one pass of gang placement over a snapshot of the cluster.

Pending Slices are taken in queue order: higher priority first, then older
``created`` first, then key. Each Slice is placed whole (every member on its
own node, all in one domain) or not at all. A Slice that cannot be placed
does not stop Slices behind it (BestEffortFIFO) unless its queue is
StrictFIFO. Because Slices are taken in priority order and capacity only
shrinks during a pass, a lower-priority Slice never takes capacity that a
higher-priority Slice of the same pass could have used.

The function is pure: the same inputs, in any order, give the same plan.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from . import reasons
from .capacity import Ledger, PoolSet
from .fitting import find_best, fits_when_empty
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
    Decision,
    Node,
    Placement,
    PlacementPlan,
    Preemption,
    Queue,
    SliceRequest,
    Unplaced,
)
from .preemption import choose_victims, victim_order

# Codes of Slices that wait for something to change (they hold a StrictFIFO queue);
# the others can never be placed as specified and do not block the queue.
WAITING_CODES = frozenset({QUOTA_EXCEEDED, INSUFFICIENT_CAPACITY, PREEMPTING})


def queue_order(request: SliceRequest) -> tuple:
    return (-request.priority, request.created, request.key)


def _unique(kind: str, keys: Iterable[str]) -> None:
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"{kind}: {key!r} appears twice")
        seen.add(key)


def place(nodes: Sequence[Node], bound_pods: Sequence[BoundPod], pending: Sequence[SliceRequest],
          queues: Sequence[Queue], running: Sequence[SliceRequest] = ()) -> PlacementPlan:
    """Place ``pending`` Slices onto ``nodes`` given the pods already bound.

    ``running`` are the Slices whose members are already bound (their pods are in
    ``bound_pods`` with ``gang`` set to the Slice key); they count against their
    queue's quota and are the candidates for preemption.
    """
    _unique("queues", (q.name for q in queues))
    _unique("pending/running Slices", [s.key for s in pending] + [s.key for s in running])
    ledger = Ledger(nodes, bound_pods)
    queue_by_name = {q.name: q for q in queues}
    usage: dict[tuple[str, str], int] = {}
    for gang in running:
        usage[(gang.queue, gang.resource)] = usage.get((gang.queue, gang.resource), 0) + gang.accelerators
    victims_in_order = sorted(running, key=victim_order)
    evicting: set[str] = set()

    decisions: list[Decision | None] = []
    preemptions: list[Preemption] = []
    deferred: list[tuple[int, SliceRequest, PoolSet]] = []  # capacity reasons, written at the end
    failed_shapes: set[tuple[int, int, int]] = set()
    fits_empty: dict[tuple[int, int, int], bool] = {}
    strict_heads: dict[str, str] = {}

    for request in sorted(pending, key=queue_order):
        queue = queue_by_name.get(request.queue)
        if queue is None:
            decisions.append(Unplaced(request.key, QUEUE_NOT_FOUND, reasons.queue_not_found(request)))
            continue
        head = strict_heads.get(queue.name)
        if head is not None:
            decisions.append(Unplaced(request.key, BLOCKED_BY_QUEUE_HEAD, reasons.blocked_by_head(request, head)))
            continue

        resource, need = request.resource, request.accelerators
        quota = queue.quota.get(resource, 0)
        decision: Decision | None = None
        if need > quota:
            decision = Unplaced(request.key, QUOTA_TOO_SMALL, reasons.quota_too_small(request, quota))
        else:
            poolset = ledger.poolset(request)
            shape = (id(poolset), request.per_host, request.hosts)
            if poolset.eligible == 0:
                decision = Unplaced(request.key, NO_MATCHING_NODES,
                                    reasons.no_matching_nodes(request, poolset, len(ledger.nodes)))
            else:
                if shape not in fits_empty:
                    fits_empty[shape] = fits_when_empty(poolset, request.per_host, request.hosts)
                if not fits_empty[shape]:
                    decision = Unplaced(request.key, DOMAIN_TOO_SMALL, reasons.domain_too_small(request, poolset))
            if decision is None:
                decision = _place_one(request, queue, poolset, shape, ledger, usage, failed_shapes,
                                      victims_in_order, evicting, preemptions)
                if decision is None:  # waits for capacity; the reason is written from the final state
                    deferred.append((len(decisions), request, poolset))
        decisions.append(decision)
        if queue.strategy == "StrictFIFO" and (decision is None or
                                               (isinstance(decision, Unplaced) and decision.code in WAITING_CODES)):
            strict_heads[queue.name] = request.key

    capacity_reasons: dict[tuple[int, int, int], str] = {}
    for position, request, poolset in deferred:
        key = (id(poolset), request.per_host, request.hosts)
        if key not in capacity_reasons:
            capacity_reasons[key] = reasons.insufficient_capacity(request, poolset, ledger.free(request.resource))
        decisions[position] = Unplaced(request.key, INSUFFICIENT_CAPACITY, capacity_reasons[key])
    return PlacementPlan(tuple(decisions), tuple(preemptions))  # type: ignore[arg-type]


def _place_one(request: SliceRequest, queue: Queue, poolset: PoolSet, shape: tuple[int, int, int],
               ledger: Ledger, usage: dict[tuple[str, str], int], failed_shapes: set,
               victims_in_order: Sequence[SliceRequest], evicting: set[str],
               preemptions: list[Preemption]) -> Decision | None:
    """A Placement, an Unplaced, or None for "no room now" (reason filled in later)."""
    resource, need = request.resource, request.accelerators
    quota = queue.quota.get(resource, 0)
    used = usage.get((queue.name, resource), 0)
    shortfall = used + need - quota
    free = ledger.free(resource)
    if shortfall <= 0 and shape not in failed_shapes:
        found = find_best(poolset, free, request.per_host, request.hosts)
        if found is not None:
            pool, node_ids = found
            ledger.take(resource, {n: request.per_host for n in node_ids})
            usage[(queue.name, resource)] = used + need
            members = tuple((i, ledger.nodes[n].name) for i, n in enumerate(node_ids))
            return Placement(request.key, request.domain_label, pool.name, members)
        failed_shapes.add(shape)  # capacity only shrinks in a pass: this shape stays unplaceable

    if queue.preemption == "LowerPriority":
        candidates = [v for v in victims_in_order if v.priority < request.priority and v.key not in evicting]
        if candidates:
            usage_by_gang = {v.key: ledger.gang_usage.get(v.key, {}).get(resource, {}) for v in candidates}
            choice = choose_victims(request, poolset, free, candidates, usage_by_gang, max(shortfall, 0))
            if choice is not None:
                # Hold the capacity for the preemptor: it keeps what it needs beyond what the
                # victims free, and nobody else in this pass gets the victims' units.
                ledger.take(resource, {n: max(0, request.per_host - choice.freed.get(n, 0))
                                       for n in choice.nodes})
                usage[(queue.name, resource)] = used + need
                victim_keys = tuple(v.key for v in choice.victims)
                evicting.update(victim_keys)
                members = tuple((i, ledger.nodes[n].name) for i, n in enumerate(choice.nodes))
                preemptions.append(Preemption(request.key, victim_keys, choice.pool.name, members))
                freed = sum(choice.freed.values())
                return Unplaced(request.key, PREEMPTING,
                                reasons.preempting(request, victim_keys, freed, choice.pool.name))
    if shortfall > 0:
        return Unplaced(request.key, QUOTA_EXCEEDED, reasons.quota_exceeded(request, quota, used))
    return None
