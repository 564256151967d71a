"""Choosing whole lower-priority gangs to evict so that a Slice can be placed.

Victims are always whole running Slices: every pod of a victim goes, never
some of them. Candidates have a strictly lower priority than the preemptor;
they may come from any queue when capacity is short, but only the preemptor's
own queue can give back quota. For each domain the candidates are taken
lowest priority first, then newest first (the least work lost), then by key,
until the preemptor fits; victims that turn out unnecessary are dropped again.
Among domains the cheapest set wins: lowest highest-victim priority, then
fewest victims, then fewest accelerators evicted, then the newest oldest
victim, then domain name.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .capacity import Pool, PoolSet
from .fitting import choose_nodes
from .model import SliceRequest


@dataclass(frozen=True)
class VictimChoice:
    victims: tuple[SliceRequest, ...]
    pool: Pool
    nodes: list[int]
    freed: dict[int, int]  # node id -> units the victims free on the chosen domain's nodes


def victim_order(request: SliceRequest) -> tuple:
    return (request.priority, -request.created, request.key)


def choose_victims(request: SliceRequest, poolset: PoolSet, free: Sequence[int],
                   candidates: Sequence[SliceRequest],
                   usage_by_gang: Mapping[str, Mapping[int, int]],
                   quota_shortfall: int) -> VictimChoice | None:
    """``candidates`` are running Slices of lower priority, in ``victim_order``;
    ``usage_by_gang[key]`` maps node id -> units of ``request.resource`` that gang holds."""
    p, h = request.per_host, request.hosts

    def gives_quota(victim: SliceRequest) -> int:
        same = victim.queue == request.queue and victim.resource == request.resource
        return victim.accelerators if same else 0

    def freed_on(victims: Sequence[SliceRequest], members: set[int]) -> dict[int, int]:
        extra: dict[int, int] = {}
        for victim in victims:
            for node_id, units in usage_by_gang.get(victim.key, {}).items():
                if node_id in members:
                    extra[node_id] = extra.get(node_id, 0) + units
        return extra

    def satisfied(victims: Sequence[SliceRequest], pool: Pool, members: set[int]) -> list[int] | None:
        if sum(gives_quota(v) for v in victims) < quota_shortfall:
            return None
        return choose_nodes(pool, free, p, h, poolset.topology, freed_on(victims, members))

    best_cost, best = None, None
    for pool in poolset.pools:
        members = set(pool.nodes)
        relevant = [v for v in candidates
                    if (quota_shortfall > 0 and gives_quota(v))
                    or any(n in members for n in usage_by_gang.get(v.key, {}))]
        if not relevant:
            continue
        chosen: list[SliceRequest] = []
        for victim in relevant:
            chosen.append(victim)
            if satisfied(chosen, pool, members) is not None:
                break
        else:
            continue
        for victim in reversed(list(chosen)):
            without = [v for v in chosen if v is not victim]
            if without and satisfied(without, pool, members) is not None:
                chosen = without
        nodes = satisfied(chosen, pool, members)
        assert nodes is not None
        evicted = sum(sum(usage_by_gang.get(v.key, {}).values()) for v in chosen)
        cost = (max(v.priority for v in chosen), len(chosen), evicted, -min(v.created for v in chosen), pool.ordinal)
        if best_cost is None or cost < best_cost:
            best_cost = cost
            best = VictimChoice(tuple(sorted(chosen, key=lambda v: v.key)), pool, nodes, freed_on(chosen, members))
    return best
