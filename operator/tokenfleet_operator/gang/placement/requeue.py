"""Admission-wait timeout and exponential requeue backoff, as pure functions.

A pending Slice waits at most ``timeout`` seconds for a placement. When the
wait runs out it is requeued: its attempt count goes up, it is held back for
``requeue_delay(attempt)`` seconds, and it re-enters its queue at the back of
its priority (the shell passes ``requeue_at`` as the Slice's ``created``).
The delay is ``base * 2**(attempt-1)``, capped at ``cap`` (Kueue's defaults:
base 60 s, cap 3600 s). No jitter here: the shell may add its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_BASE_SECONDS = 60.0
DEFAULT_CAP_SECONDS = 3600.0


def requeue_delay(attempt: int, base: float = DEFAULT_BASE_SECONDS, cap: float = DEFAULT_CAP_SECONDS) -> float:
    """Seconds to hold a Slice back after its ``attempt``-th admission timeout (attempt >= 1)."""
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise ValueError(f"attempt must be an integer >= 1, got {attempt!r}")
    if not (base > 0 and math.isfinite(base)):
        raise ValueError(f"base must be a positive number of seconds, got {base!r}")
    if not cap >= base:
        raise ValueError(f"cap must be >= base ({base}), got {cap!r}")
    if attempt > 64:  # 2**63 * base is already beyond any cap
        return float(cap)
    return float(min(cap, base * 2 ** (attempt - 1)))


@dataclass(frozen=True)
class RequeueState:
    """Mirrors ``status.requeueState`` of a Slice: how often it timed out and when it may return."""

    count: int = 0
    requeue_at: float | None = None


def admission_timed_out(waiting_since: float, now: float, timeout: float | None) -> bool:
    """Whether a Slice pending since ``waiting_since`` has waited longer than ``timeout`` (None: never)."""
    if timeout is None:
        return False
    if timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return now - waiting_since >= timeout


def after_timeout(state: RequeueState, now: float, base: float = DEFAULT_BASE_SECONDS,
                  cap: float = DEFAULT_CAP_SECONDS) -> RequeueState:
    """The state after one more admission timeout at ``now``."""
    attempt = state.count + 1
    return RequeueState(attempt, now + requeue_delay(attempt, base, cap))


def may_queue(state: RequeueState, now: float) -> bool:
    """Whether the Slice is past its backoff and may be handed to ``place``."""
    return state.requeue_at is None or now >= state.requeue_at
