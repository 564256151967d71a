"""What ``tokenfleet bench fleet`` computes from its records: pure functions, no cluster.

- the load trace (phases with a start and an end rate) and its seeded Poisson arrivals;
- per request, as the client saw it: TTFT (sent to first token), TPOT ((finished - first token) / (output
  tokens - 1)), whether it met the SLO, whether it was lost;
- SLO attainment over a set of requests, percentiles, and replica-seconds (a step function of the replica
  count over time, integrated).
"""
from __future__ import annotations

import datetime as dt
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    rate_start: float          # requests per second at the phase's start
    rate_end: float            # ... and at its end (linear in between)


def trace_duration(trace: Sequence[Phase]) -> float:
    return sum(p.seconds for p in trace)


def rate_at(trace: Sequence[Phase], t: float) -> float:
    """The offered load (requests per second) at ``t`` seconds into the trace; 0 outside it."""
    start = 0.0
    for p in trace:
        if start <= t < start + p.seconds:
            return p.rate_start + (p.rate_end - p.rate_start) * (t - start) / p.seconds
        start += p.seconds
    return 0.0


def phase_at(trace: Sequence[Phase], t: float) -> str | None:
    start = 0.0
    for p in trace:
        if start <= t < start + p.seconds:
            return p.name
        start += p.seconds
    return None


def phase_bounds(trace: Sequence[Phase]) -> dict[str, tuple[float, float]]:
    out, start = {}, 0.0
    for p in trace:
        out[p.name] = (start, start + p.seconds)
        start += p.seconds
    return out


def arrivals(trace: Sequence[Phase], seed: int) -> list[float]:
    """Arrival times of a Poisson process whose rate follows the trace (Lewis-Shedler thinning), seeded:
    the same seed gives the same arrivals, so two services see the same load."""
    rng = random.Random(seed)
    peak = max((max(p.rate_start, p.rate_end) for p in trace), default=0.0)
    if peak <= 0:
        return []
    end, t, out = trace_duration(trace), 0.0, []
    while True:
        t += rng.expovariate(peak)
        if t >= end:
            return out
        if rng.random() * peak < rate_at(trace, t):
            out.append(t)


# ---- one request, as the client saw it ---------------------------------------------------------------
def ttft(rec: dict[str, Any]) -> float | None:
    if rec.get("first_token") is None or rec.get("sent") is None:
        return None
    return rec["first_token"] - rec["sent"]


def tpot(rec: dict[str, Any]) -> float | None:
    n = rec.get("output_tokens") or 0
    if rec.get("first_token") is None or rec.get("finished") is None or n < 2:
        return None
    return (rec["finished"] - rec["first_token"]) / (n - 1)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


def meets(rec: dict[str, Any], slo: Slo) -> bool:
    """Complete, with its TTFT and TPOT within the SLO (a one-token answer has no TPOT to miss)."""
    if not rec.get("complete"):
        return False
    first, per_token = ttft(rec), tpot(rec)
    return first is not None and first <= slo.ttft_s and (per_token is None or per_token <= slo.tpot_s)


def attainment(records: Iterable[dict[str, Any]], slo: Slo) -> float | None:
    recs = list(records)
    return sum(meets(r, slo) for r in recs) / len(recs) if recs else None


def lost(records: Iterable[dict[str, Any]]) -> int:
    return sum(1 for r in records if not r.get("complete"))


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None values are left out."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def integrate(samples: Sequence[tuple[float, float]], t0: float, t1: float) -> float:
    """The integral over [t0, t1] of a step function given as (time, value) samples in time order: each
    value holds until the next sample (before the first sample the first value holds)."""
    if not samples or t1 <= t0:
        return 0.0
    total = 0.0
    for i, (t, value) in enumerate(samples):
        start = t0 if i == 0 else max(t, t0)
        end = samples[i + 1][0] if i + 1 < len(samples) else t1
        end = min(end, t1)
        if end > start:
            total += value * (end - start)
    return total


def cost_per_million_tokens(replica_seconds: float, price_per_replica_hour: float, tokens: float) -> float | None:
    """What the replicas that existed cost, per million tokens delivered."""
    if tokens <= 0:
        return None
    return replica_seconds / 3600 * price_per_replica_hour / tokens * 1e6


def rfc3339_seconds(stamp: str) -> float:
    """Unix seconds of an API server timestamp ("2026-12-03T15:25:01Z", or with microseconds)."""
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
