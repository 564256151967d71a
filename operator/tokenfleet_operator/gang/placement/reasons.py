"""Human-readable reasons for an unplaced Slice. Every reason carries the
numbers a user needs to act: what the Slice asks for and the best the cluster
can offer right now."""
from __future__ import annotations

from collections.abc import Sequence

from .capacity import Pool, PoolSet
from .model import SliceRequest


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def wants(request: SliceRequest) -> str:
    """``needs 16 × nvidia.com/gpu (2 hosts × 8) in one tokenfleet.dev/block``."""
    text = (f"needs {request.accelerators} × {request.resource} "
            f"({_plural(request.hosts, 'host')} × {request.per_host})")
    if request.topology is not None:
        text += f" as topology {request.topology} on consecutive {request.host_index_label} values"
    if request.domain_label is None:
        return text + " in the cluster"
    return text + f" in one {request.domain_label}"


def _where(request: SliceRequest, pool: Pool) -> str:
    if request.domain_label is None:
        return "the cluster"
    return f"the best {request.domain_label}, {pool.name},"


def _longest_run(pool: Pool, units: Sequence[int] | dict, per_host: int) -> int:
    """Longest run of consecutive host indices whose nodes all have ``per_host`` available."""
    best = run = 0
    for index in range(pool.max_index + 1):
        node_id = pool.by_index.get(index)
        run = run + 1 if node_id is not None and units[node_id] >= per_host else 0
        best = max(best, run)
    return best


def insufficient_capacity(request: SliceRequest, poolset: PoolSet, free: Sequence[int]) -> str:
    p, h = request.per_host, request.hosts
    best_key: tuple[int, ...] | None = None
    best_pool: Pool | None = None
    for pool in poolset.pools:
        if poolset.topology:
            enough = min(_longest_run(pool, free, p), h)
        else:
            enough = sum(pool.hist[p:])
        key = (enough, pool.total, -pool.ordinal)
        if best_key is None or key > best_key:
            best_key, best_pool = key, pool
    assert best_key is not None and best_pool is not None, "a request with no pool never reaches here"
    enough, total, _ = best_key
    if poolset.topology:
        offer = (f"has at most {enough} consecutive {request.host_index_label} values with ≥{p} free "
                 f"({total} free in all)")
    else:
        offer = f"has {_plural(enough, 'host')} with ≥{p} free ({total} free in all)"
    return f"{wants(request)}; {_where(request, best_pool)} {offer}"


def domain_too_small(request: SliceRequest, poolset: PoolSet) -> str:
    p, h = request.per_host, request.hosts
    best_key: tuple[int, ...] | None = None
    best_pool: Pool | None = None
    for pool in poolset.pools:
        if poolset.topology:
            enough = min(_longest_run(pool, dict(zip(pool.nodes, pool.allocatable)), p), h)
        else:
            enough = sum(1 for a in pool.allocatable if a >= p)
        key = (enough, -pool.ordinal)
        if best_key is None or key > best_key:
            best_key, best_pool = key, pool
    assert best_key is not None and best_pool is not None, "a request with no pool never reaches here"
    enough = best_key[0]
    scope = "the cluster" if request.domain_label is None else f"the largest {request.domain_label}, {best_pool.name},"
    if poolset.topology:
        return (f"{wants(request)}; it can never fit: {scope} has at most {enough} consecutive "
                f"{request.host_index_label} values with ≥{p} allocatable")
    return (f"{wants(request)}; it can never fit: {scope} has only "
            f"{_plural(enough, 'matching host')} with ≥{p} allocatable")


def no_matching_nodes(request: SliceRequest, poolset: PoolSet, node_count: int) -> str:
    names = {"resource": request.resource, "domain_label": request.domain_label,
             "host_index_label": request.host_index_label}
    parts = [f"{count} {why.format(**names)}" for why, count in poolset.exclusions.items()]
    detail = ", ".join(parts) if parts else "there are no nodes"
    return f"{wants(request)}; no node can hold a member: of {_plural(node_count, 'node')}, {detail}"


def quota_too_small(request: SliceRequest, quota: int) -> str:
    return (f"needs {request.accelerators} × {request.resource} but queue {request.queue} "
            f"has a quota of {quota} {request.resource}")


def quota_exceeded(request: SliceRequest, quota: int, used: int) -> str:
    return (f"needs {request.accelerators} × {request.resource}; queue {request.queue} "
            f"has {used} of its quota of {quota} in use, {max(quota - used, 0)} left")


def queue_not_found(request: SliceRequest) -> str:
    return f"queue {request.queue!r} does not exist"


def blocked_by_head(request: SliceRequest, head: str) -> str:
    return f"queue {request.queue} is StrictFIFO and {head}, ahead of this Slice, is not admitted yet"


def preempting(request: SliceRequest, victims: Sequence[str], freed: int, domain: str | None) -> str:
    where = "the cluster" if request.domain_label is None else f"{request.domain_label} {domain}"
    return (f"{wants(request)}; evicting {_plural(len(victims), 'lower-priority Slice')} "
            f"({', '.join(victims)}) to free {freed} × {request.resource} in {where}")
