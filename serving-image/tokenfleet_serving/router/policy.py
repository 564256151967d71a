"""Choosing a backend for one request: pure functions over a snapshot.

Inputs are plain data: the request's prefix-block hashes (``prefix.py``), an
optional session key, and for every routable backend its load (running +
waiting requests), KV-cache usage (0..1) and the set of block hashes it holds.

**Load bound** (consistent hashing with bounded loads, Mirrokni et al. 2018).
With ``n`` backends carrying ``L`` requests in total, a backend may take the
request only while ``load + 1 <= ceil(c * (L + 1) / n) + s``, with
``c = loadFactor`` (default 1.25) and ``s = loadSlack`` (default 4 requests:
a cache hit is not given up for an imbalance of a few requests, which costs a
few batch slots where a miss costs a whole prefill). The least-loaded backend always qualifies, so no backend
ever holds more than ``c`` times the average load plus ``s + 1`` requests: a
hot prefix or a hot session spills over to the next-best backend instead of
piling onto one replica. The bound applies to session affinity, prefix-aware and kv-aware.

**Policies** (``routing.policy`` of the InferenceService):

- ``round-robin``: backends sorted by name, the request counter modulo n.
- ``least-load``: the smallest ``(load, kvUsage)``.
- ``prefix-aware``: among backends within the load bound, the longest run of
  leading prompt blocks already cached (``matched``); ties go to the smaller
  load. With no match anywhere it is ``least-load``.
- ``kv-aware``: among backends within the load bound and below
  ``kvUsageThreshold`` (default 0.9; all of them if none is), the largest
  ``2 * matched / blocks - kvUsage - load / maxLoad`` (after NVIDIA Dynamo's
  KV router cost; ``blocks`` is the request's full-block count,
  ``maxLoad = max(1, largest load)``).

**Tiers of the prefix cache** (replicas with KV offload list their host- and disk-tier blocks too): a
block counts ``1`` when it is in the backend's accelerator tier, ``HOST_WEIGHT`` (0.8) in its host tier and
``DISK_WEIGHT`` (0.5) in its disk tier, along the leading run of the request's blocks that the backend holds
in any tier (the engine copies a lower-tier run back and reuses it). ``matched`` in both policies is that
weighted count, so an accelerator hit beats a host hit of the same length, a host hit beats a disk hit, and
any hit beats a miss; a long host-tier run can beat a short accelerator-tier one (copying a block back costs
a fraction of computing it).

**LoRA adapters** (the request's ``model`` names an adapter some backend has in memory): among the
backends within the load bound that hold the adapter in memory, the policy below chooses (reason
``adapter``, or ``prefix-hit`` with a cache hit); when none of them is within the bound, the policy chooses
among all backends as for the base model and the chosen one loads the adapter, so a hot adapter spreads over
more replicas as its load grows. Prefix affinity stays within an adapter: the request's block hashes chain
from the adapter's root (``block_pool.adapter_root_hash``), as the engine's do, so they can only match blocks
computed with the same adapter.

**Session affinity** (when on and the request carries the header): the
session's pinned backend if it still exists, else rendezvous (highest random
weight) hashing of the session key over the backends, so adding or removing
a backend moves only the sessions that must move. Subject to the load bound:
an overloaded session target spills to the next backend in rendezvous order.

**Ties** are broken by rendezvous hashing of a tie key (the request's first
block hash, else the request counter) with the backend name: deterministic for
equal input, and different prefixes spread over equally good backends.

**Difficulty tiers** (``choose_tier``): tiers are listed cheapest first; a
request fits a tier when its prompt tokens are within ``maxPromptTokens`` and
its requested ``max_tokens`` within ``maxOutputTokens`` (unset limit: no
limit; a request without ``max_tokens`` fits only tiers without an output
limit). It goes to the first fitting tier that has a routable backend, else
to the next larger one with a backend, and only as a last resort to a smaller
one (reason ``tier-fallback``).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from tokenfleet_serving.contract.router_files import DEFAULT_LOAD_FACTOR, DEFAULT_LOAD_SLACK, Tier

# Decision reasons (the `reason` label of tokenfleet_router_requests_total).
ROUND_ROBIN = "round-robin"
LEAST_LOAD = "least-load"
PREFIX_HIT = "prefix-hit"
LOAD_BOUND = "load-bound"        # the backend with the best cache hit was over the load bound
KV_SCORE = "kv-score"
SESSION = "session"
SESSION_OVERFLOW = "session-overflow"
ONLY_BACKEND = "only-backend"
ADAPTER = "adapter"              # among the backends holding the request's LoRA adapter

# What a cached block is worth in each lower tier, against 1 in the accelerator tier (see the module doc).
HOST_WEIGHT = 0.8
DISK_WEIGHT = 0.5


@dataclass(frozen=True)
class BackendView:
    """One routable backend as the policy sees it."""

    name: str
    load: int = 0                      # running + waiting requests
    kv_usage: float = 0.0              # 0..1
    cached: Collection[str] = frozenset()  # hex block hashes it holds
    adapters: Collection[str] = frozenset()  # LoRA adapters it has in memory
    host_cached: Collection[str] = frozenset()   # hex block hashes in its host tier (KV offload)
    disk_cached: Collection[str] = frozenset()   # hex block hashes in its disk tier


@dataclass(frozen=True)
class RouteRequest:
    block_hashes: tuple[str, ...] = ()
    session: str | None = None         # session key (header value), when session affinity is on
    pinned: str | None = None          # backend the session was last sent to
    sequence: int = 0                  # the router's request counter
    adapter: str | None = None         # the LoRA adapter the request names (None: a base model)


@dataclass(frozen=True)
class PolicyParams:
    policy: str = "prefix-aware"
    load_factor: float = DEFAULT_LOAD_FACTOR
    kv_usage_threshold: float = 0.9
    load_slack: int = DEFAULT_LOAD_SLACK


@dataclass(frozen=True)
class Decision:
    backend: str
    reason: str
    matched_blocks: int = 0
    tier_blocks: tuple[int, int, int] = (0, 0, 0)   # of the matched run: accelerator, host, disk


def tier_match(block_hashes: Sequence[str], b: BackendView) -> tuple[int, int, int]:
    """(accelerator, host, disk) blocks of the leading run of the request's blocks that ``b`` holds in any tier."""
    acc = host = disk = 0
    for h in block_hashes:
        if h in b.cached:
            acc += 1
        elif h in b.host_cached:
            host += 1
        elif h in b.disk_cached:
            disk += 1
        else:
            break
    return acc, host, disk


def weighted_match(tiers: tuple[int, int, int]) -> float:
    acc, host, disk = tiers
    return acc + HOST_WEIGHT * host + DISK_WEIGHT * disk


def matched_blocks(block_hashes: Sequence[str], cached: Collection[str]) -> int:
    """Leading blocks of the request a backend holds (the engine reuses only a leading run)."""
    n = 0
    for h in block_hashes:
        if h not in cached:
            break
        n += 1
    return n


def load_capacity(loads: Sequence[int], load_factor: float, slack: int = 0) -> int:
    """Most requests a backend may carry after taking this one: ceil(c * (L + 1) / n) + s."""
    return math.ceil(load_factor * (sum(loads) + 1) / len(loads) - 1e-9) + slack


def within_bound(load: int, capacity: int) -> bool:
    return load + 1 <= capacity


def rendezvous_weight(key: str, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}\x00{name}".encode()).digest()[:8], "big")


def rendezvous_order(key: str, names: Sequence[str]) -> list[str]:
    """Backends by decreasing rendezvous weight for ``key`` (stable under adding/removing others)."""
    return sorted(names, key=lambda n: (-rendezvous_weight(key, n), n))


def _tie_key(req: RouteRequest) -> str:
    return req.block_hashes[0] if req.block_hashes else f"#{req.sequence}"


def choose(req: RouteRequest, backends: Sequence[BackendView], params: PolicyParams) -> Decision | None:
    """The backend for ``req``, or None when there is none."""
    if not backends:
        return None
    if len(backends) == 1:
        only = backends[0]
        return Decision(only.name, ONLY_BACKEND, matched_blocks(req.block_hashes, only.cached))
    capacity = load_capacity([b.load for b in backends], params.load_factor, params.load_slack)
    if req.adapter is not None:
        holders = [b for b in backends if req.adapter in b.adapters and within_bound(b.load, capacity)]
        if holders and len(holders) < len(backends):
            d = choose(replace(req, adapter=None), holders, params)
            assert d is not None
            return Decision(d.backend, PREFIX_HIT if d.reason == PREFIX_HIT else ADAPTER, d.matched_blocks)
    tie = _tie_key(req)

    def tiebreak(b: BackendView) -> int:
        return -rendezvous_weight(tie, b.name)

    if req.session is not None:
        by_name = {b.name: b for b in backends}
        order = rendezvous_order(req.session, list(by_name))
        if req.pinned in by_name:
            order.remove(req.pinned)
            order.insert(0, req.pinned)
        for i, name in enumerate(order):
            if within_bound(by_name[name].load, capacity):
                return Decision(name, SESSION if i == 0 else SESSION_OVERFLOW,
                                matched_blocks(req.block_hashes, by_name[name].cached))
        # unreachable: the least-loaded backend is always within the bound

    if params.policy == "round-robin":
        ordered = sorted(backends, key=lambda b: b.name)
        chosen = ordered[req.sequence % len(ordered)]
        return Decision(chosen.name, ROUND_ROBIN, matched_blocks(req.block_hashes, chosen.cached))

    least = min(backends, key=lambda b: (b.load, b.kv_usage, tiebreak(b)))
    if params.policy == "least-load":
        return Decision(least.name, LEAST_LOAD, matched_blocks(req.block_hashes, least.cached))

    if any(b.host_cached or b.disk_cached for b in backends):
        tiers = {b.name: tier_match(req.block_hashes, b) for b in backends}
    else:
        tiers = {b.name: (matched_blocks(req.block_hashes, b.cached), 0, 0) for b in backends}
    matches = {name: weighted_match(t) for name, t in tiers.items()}
    best_anywhere = max(matches.values())
    eligible = [b for b in backends if within_bound(b.load, capacity)]

    if params.policy == "prefix-aware":
        chosen = max(eligible, key=lambda b: (matches[b.name], -b.load, -b.kv_usage, -tiebreak(b)))
        m = matches[chosen.name]
        if m == 0:
            reason = LOAD_BOUND if best_anywhere > 0 else LEAST_LOAD
            chosen = least if best_anywhere == 0 else chosen
        else:
            reason = PREFIX_HIT if m == best_anywhere else LOAD_BOUND
        return Decision(chosen.name, reason, sum(tiers[chosen.name]), tiers[chosen.name])

    if params.policy == "kv-aware":
        cool = [b for b in eligible if b.kv_usage < params.kv_usage_threshold] or eligible
        blocks = max(1, len(req.block_hashes))
        max_load = max(1, max(b.load for b in backends))

        def score(b: BackendView) -> float:
            return 2.0 * matches[b.name] / blocks - b.kv_usage - b.load / max_load

        chosen = max(cool, key=lambda b: (score(b), -tiebreak(b)))
        m = matches[chosen.name]
        reason = KV_SCORE if m == 0 and best_anywhere == 0 else (PREFIX_HIT if m == best_anywhere else LOAD_BOUND)
        return Decision(chosen.name, reason, sum(tiers[chosen.name]), tiers[chosen.name])

    raise ValueError(f"unknown routing policy {params.policy!r}")


def fits(tier: Tier, prompt_tokens: int, max_tokens: int | None) -> bool:
    if tier.max_prompt_tokens is not None and prompt_tokens > tier.max_prompt_tokens:
        return False
    if tier.max_output_tokens is not None and (max_tokens is None or max_tokens > tier.max_output_tokens):
        return False
    return True


def choose_tier(tiers: Sequence[Tier], prompt_tokens: int, max_tokens: int | None,
                available: Collection[str]) -> tuple[Tier, bool] | None:
    """(tier, is_fallback) for a request, or None when no tier has a routable backend."""
    first_fit = next((i for i, t in enumerate(tiers) if fits(t, prompt_tokens, max_tokens)), len(tiers) - 1)
    for t in tiers[first_fit:]:
        if t.name in available:
            return t, False
    for t in reversed(tiers[:first_fit]):
        if t.name in available:
            return t, True
    return None
