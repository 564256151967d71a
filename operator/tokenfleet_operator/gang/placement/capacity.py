"""Free accelerators per node during one placement pass, and the topology
domains ("pools") that each kind of Slice can use, indexed by free capacity.

This is the only mutable state of a pass. It lives inside one call to
``place`` and never escapes it. Capacity only ever shrinks during a pass
(placements and preemption reservations take it; nothing releases it), which
lets the placer remember that a Slice shape did not fit.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import defaultdict
from collections.abc import Sequence

from .matching import EXCLUSION_ORDER, eligibility_signature, exclusion, host_index
from .model import BoundPod, Node, SliceRequest


class Pool:
    """The eligible nodes of one domain (one value of the domain label) for one
    eligibility signature. ``hist[f]`` counts nodes with ``f`` free units."""

    __slots__ = ("name", "ordinal", "nodes", "hist", "total", "by_index", "max_index", "allocatable")

    def __init__(self, name: str | None, ordinal: int, nodes: list[int]):
        self.name = name
        self.ordinal = ordinal
        self.nodes = nodes
        self.hist: list[int] = []
        self.total = 0
        self.by_index: dict[int, int] = {}
        self.max_index = -1
        self.allocatable: list[int] = []


class PoolSet:
    """All pools for one eligibility signature, plus ``order``: (total free,
    ordinal) sorted ascending, so best fit is a bisect away."""

    __slots__ = ("resource", "domain_label", "topology", "pools", "order", "exclusions", "eligible")

    def __init__(self, resource: str, domain_label: str | None, topology: bool):
        self.resource = resource
        self.domain_label = domain_label
        self.topology = topology
        self.pools: list[Pool] = []
        self.order: list[tuple[int, int]] = []
        self.exclusions: dict[str, int] = {}
        self.eligible = 0


class Ledger:
    def __init__(self, nodes: Sequence[Node], bound_pods: Sequence[BoundPod]):
        ordered = sorted(nodes, key=lambda n: n.name)
        for a, b in zip(ordered, ordered[1:]):
            if a.name == b.name:
                raise ValueError(f"nodes: node name {a.name!r} appears twice")
        self.nodes: list[Node] = ordered
        self.ids: dict[str, int] = {n.name: i for i, n in enumerate(ordered)}
        self.bound_pods = tuple(bound_pods)
        self._free: dict[str, list[int]] = {}
        self._watchers: dict[str, list[list[tuple[PoolSet, Pool]]]] = {}
        self._poolsets: dict[tuple, PoolSet] = {}
        # gang key -> resource -> node id -> units its bound pods hold there
        self.gang_usage: dict[str, dict[str, dict[int, int]]] = defaultdict(lambda: defaultdict(dict))
        for pod in self.bound_pods:
            node_id = self.ids.get(pod.node)
            if node_id is None or pod.gang is None:
                continue
            for resource, amount in pod.requests.items():
                per_node = self.gang_usage[pod.gang][resource]
                per_node[node_id] = per_node.get(node_id, 0) + amount

    # --- free capacity -------------------------------------------------------------

    def free(self, resource: str) -> list[int]:
        """Free units of ``resource`` per node id (allocatable minus bound requests;
        may be negative on an over-committed node)."""
        free = self._free.get(resource)
        if free is None:
            free = [n.allocatable.get(resource, 0) for n in self.nodes]
            for pod in self.bound_pods:
                amount = pod.requests.get(resource, 0)
                node_id = self.ids.get(pod.node)
                if amount and node_id is not None:
                    free[node_id] -= amount
            self._free[resource] = free
            self._watchers[resource] = [[] for _ in self.nodes]
        return free

    def take(self, resource: str, amounts: dict[int, int]) -> None:
        """Consume ``amounts[node_id]`` units on each node and re-index the pools."""
        free = self.free(resource)
        watchers = self._watchers[resource]
        old_totals: dict[int, tuple[PoolSet, Pool, int]] = {}
        for node_id, amount in amounts.items():
            if amount <= 0:
                continue
            old = free[node_id]
            new = old - amount
            free[node_id] = new
            old_c, new_c = max(old, 0), max(new, 0)
            for poolset, pool in watchers[node_id]:
                key = id(pool)
                if key not in old_totals:
                    old_totals[key] = (poolset, pool, pool.total)
                pool.hist[old_c] -= 1
                pool.hist[new_c] += 1
                pool.total -= old_c - new_c
        for poolset, pool, old_total in old_totals.values():
            if pool.total != old_total:
                order = poolset.order
                del order[bisect_left(order, (old_total, pool.ordinal))]
                insort(order, (pool.total, pool.ordinal))

    # --- pools ---------------------------------------------------------------------

    def poolset(self, request: SliceRequest) -> PoolSet:
        signature = eligibility_signature(request)
        poolset = self._poolsets.get(signature)
        if poolset is None:
            poolset = self._build(request)
            self._poolsets[signature] = poolset
        return poolset

    def _build(self, request: SliceRequest) -> PoolSet:
        resource = request.resource
        free = self.free(resource)
        topology = request.topology is not None
        poolset = PoolSet(resource, request.domain_label, topology)
        excluded: dict[str, int] = dict.fromkeys(EXCLUSION_ORDER, 0)
        by_domain: dict[str | None, list[int]] = defaultdict(list)
        for node_id, node in enumerate(self.nodes):
            why = exclusion(node, request)
            if why is not None:
                excluded[why] += 1
                continue
            domain = None if request.domain_label is None else node.labels[request.domain_label]
            by_domain[domain].append(node_id)
        poolset.exclusions = {k: v for k, v in excluded.items() if v}
        width = 1 + max((n.allocatable.get(resource, 0) for n in self.nodes), default=0)
        watchers = self._watchers[resource]
        for ordinal, name in enumerate(sorted(by_domain, key=lambda d: (d is not None, d or ""))):
            node_ids = by_domain[name]
            if topology:
                # One node per host index; a duplicate index keeps the node first by name.
                by_index: dict[int, int] = {}
                for node_id in node_ids:
                    index = host_index(self.nodes[node_id], request.host_index_label)
                    assert index is not None, "matching excludes nodes without a host index"
                    by_index.setdefault(index, node_id)
                node_ids = sorted(by_index.values())
            pool = Pool(name, ordinal, node_ids)
            if topology:
                pool.by_index = by_index
                pool.max_index = max(pool.by_index)
            pool.hist = [0] * width
            pool.allocatable = [self.nodes[i].allocatable.get(resource, 0) for i in node_ids]
            for node_id in node_ids:
                units = max(free[node_id], 0)
                pool.hist[units] += 1
                pool.total += units
                watchers[node_id].append((poolset, pool))
            poolset.pools.append(pool)
            poolset.eligible += len(node_ids)
        poolset.order = sorted((p.total, p.ordinal) for p in poolset.pools)
        return poolset
