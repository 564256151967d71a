"""How long a replica of a service takes to start: from its Slice's creation to its leader pod's Ready condition.

The autoscaler looks that far ahead along a rising load (``policy``): a replica asked for now serves from then on.
Measured on the replicas that run, not configured: it covers the gang's placement, the pull, the model's load and
the engine's warm-up, whatever they cost on this cluster.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.conditions import parse_rfc3339


def _ready(pod: dict[str, Any] | None) -> dict[str, Any] | None:
    """The pod's Ready condition when it is True."""
    c = cond.find(((pod or {}).get("status") or {}).get("conditions"), "Ready")
    return c if c is not None and c.get("status") == "True" else None


def _ready_since(pod: dict[str, Any]) -> str | None:
    c = _ready(pod)
    return c.get("lastTransitionTime") if c else None


def _seconds(start: str, end: str | dt.datetime) -> float | None:
    """Seconds from the timestamp ``start`` to ``end`` (a timestamp or a time); None where one does not parse."""
    try:
        return ((parse_rfc3339(end) if isinstance(end, str) else end) - parse_rfc3339(start)).total_seconds()
    except ValueError:
        return None


def _started(slice_obj: dict[str, Any], pod: dict[str, Any] | None) -> str | None:
    """When the replica's current start began: its Slice's creation, or its leader pod's if that came later (a pod
    recreated by a rollout or an eviction starts anew in an old Slice)."""
    times = [t for t in ((slice_obj.get("metadata") or {}).get("creationTimestamp"),
                         ((pod or {}).get("metadata") or {}).get("creationTimestamp")) if t]
    return max(times) if times else None


def replica_startup_seconds(replicas: list[tuple[dict[str, Any], dict[str, Any] | None]]) -> float | None:
    """The startup of the newest ready replica among ``(slice, leader pod)`` pairs; None if none is ready yet."""
    newest: tuple[str, float] | None = None
    for slice_obj, pod in replicas:
        started = _started(slice_obj, pod)
        ready = _ready_since(pod) if pod else None
        if not started or not ready:
            continue
        seconds = _seconds(started, ready)
        if seconds is not None and seconds >= 0 and (newest is None or started > newest[0]):
            newest = (started, seconds)
    return newest[1] if newest else None


def serving_seconds(pods: list[dict[str, Any] | None], now: dt.datetime) -> float | None:
    """How long the longest-ready of ``pods`` has been Ready (from its Ready condition's transition); None if none
    is. The autoscaler's idle time counts no further back: a service is not idle before it could serve."""
    longest: float | None = None
    for pod in pods:
        since = _ready_since(pod) if pod else None
        seconds = _seconds(since, now) if since else None
        if seconds is None:
            continue
        longest = seconds if longest is None else max(longest, seconds)
    return longest


@dataclass
class ServingSince:
    """Since when a service has been able to serve, on the monotonic clock: the Ready transition of the first of
    its replicas to become Ready, remembered while it keeps replicas (one that was Ready and then fails has had
    its chance: the service that served is idle once no request comes). A service scaled to zero starts again
    with none: its next replica has to become Ready first. Kept in memory: a new leader waits for a Ready replica.
    """

    at: float | None = None

    def seconds(self, now: float, current: int, ready_s: float | None) -> float | None:
        """How long the service has been able to serve, given ``ready_s`` (``serving_seconds`` of its replicas
        now); None while it never was since it last had no replica. ``current``: the replicas it runs."""
        if current == 0:
            self.at = None
            return None
        if ready_s is not None:
            since = now - max(ready_s, 0.0)
            self.at = since if self.at is None else min(self.at, since)
        return None if self.at is None else now - self.at


# A replica not Ready after this many startups (and at least STARTING_MIN_S) is stuck, not starting: it no longer
# holds back a scale-up.
STARTING_STARTUPS = 3
STARTING_MIN_S = 60.0


def starting_replicas(current: int, replicas: list[tuple[int, dict[str, Any], dict[str, Any] | None]],
                      now: dt.datetime, startup_s: float | None) -> int:
    """How many of the first ``current`` replicas are starting: those whose Slice does not exist yet (just asked
    for), and those whose Slice is younger than STARTING_STARTUPS measured startups (at least STARTING_MIN_S) and
    whose leader pod is not Ready. ``replicas``: (index, slice, leader pod). An older Slice whose pod is not Ready
    (stuck, failed, or replaced by a rollout) is not counted."""
    limit = max(STARTING_STARTUPS * (startup_s or 0.0), STARTING_MIN_S)
    by_index = {i: (sl, pod) for i, sl, pod in replicas}
    count = 0
    for i in range(current):
        if i not in by_index:
            count += 1
            continue
        sl, pod = by_index[i]
        if _ready(pod):
            continue
        created = (sl.get("metadata") or {}).get("creationTimestamp")
        age = _seconds(created, now) if created else None
        count += age is not None and age <= limit
    return count
