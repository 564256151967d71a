"""The built-in autoscaler's decision, as a pure function of what the router measured.

Signals (``Signals``), read from the service's router by the collector:

- requests: waiting + running requests summed over the ready replicas (vLLM's ``num_requests_waiting`` and
  ``num_requests_running`` of each, as the router polls them), plus the requests the router holds because no
  replica is up; like the two below, the mean over ``metricWindowSeconds`` of readings, so that one busy moment
  of a bursty arrival process neither adds a replica nor, through the scale-down window, keeps one. The mean
  over the last tenth of that window (the "panic window", at least the last two readings) that is at least
  ``PANIC_FACTOR`` times what the replicas already asked for (ready or starting) are sized for is acted on at
  once (Knative's "panic mode"): a real surge does not wait for the mean, and the queue that the ready replicas
  build while the new ones start, which those are on their way to take, is not one. While replicas asked for are
  still starting, the mean asks for no more than those: they have not had their chance. While the requests rise
  and no replica is starting, a scale-up looks ahead: the need is that of the mean plus the rise (its
  least-squares slope, where clear of noise, ``measure.signals``) times the replicas' startup time (measured: a
  replica's Slice created to its leader Ready; at most the trend window), so that a replica asked for now is
  ready when the load arrives rather than a cold start after it;
- waiting requests alone (the engines' queues, plus those the router holds), with a target of their own when
  ``targetWaitingPerReplica`` is set: a queue means requests wait for a batch slot, which TTFT feels first;
- KV-cache usage: the mean over the ready replicas (0..1);
- SLO attainment: the share of recent requests that met ``spec.slo`` (TTFT and TPOT), when there were any: over
  the metric window, and only since the number of ready replicas last changed.

Each signal with a target says how many replicas it needs, as the HPA does: requests / target per replica;
replicas x usage / target usage; and one more than the ready replicas while attainment is below its target. A
load within ``TOLERANCE`` (10 %) of what the ready replicas are sized for needs just them, as the HPA's
tolerance does: the ceiling of a ratio near a whole number would otherwise add and remove a replica in turn as
the load wanders across it. The largest need wins, within [minReplicas, maxReplicas]. Then:

- **stabilization**: a scale-up takes the lowest recommendation of the last ``scaleUpStabilizationSeconds``
  (0: at once); a scale-down the highest of the last ``scaleDownStabilizationSeconds``, and only once that
  much history exists, so a dip does not remove a replica that the next minute needs again;
- **a bound per step**: at most ``maxScaleUpReplicas`` added and ``maxScaleDownReplicas`` removed at a time;
- **headroom**: with a TTFT in the SLO, a scale-down from n to m replicas goes ahead only while the TTFT
  observed at the SLO's percentile, times (n / m) ** HEADROOM_EXPONENT, stays within it (a heuristic: the
  queueing part of TTFT grows faster than the load per replica); requests in flight stay low until a replica
  saturates, so they alone would take a fleet down to a size that then misses;
- **zero**: with ``minReplicas: 0`` a service with no request for ``scaleToZeroAfterSeconds`` goes to zero,
  counted back no further than it could first serve (``Signals.idle_s``: since its first replica became Ready,
  ``startup.ServingSince``; a service that never could is not idle, however long its model loads), and a
  request held by the router brings it back to one (or minReplicas) at once;
- **limits**: when the needs exceed maxReplicas the recommendation says so (``limited``), and the operator
  shows it as a condition: an SLO that cannot be met at maxReplicas is reported, never chased in a loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

# A panic-window load of at least this many times what the replicas asked for are sized for is acted on at once.
PANIC_FACTOR = 2.0
# The panic window's share of the metric window (Knative's default: 10 %).
PANIC_WINDOW_SHARE = 0.1
# A load within this share of the ready replicas' target load keeps them (the HPA's default tolerance).
TOLERANCE = 0.1
# A scale-down from n to m replicas goes ahead while the observed TTFT at the SLO's percentile, times
# (n / m) ** HEADROOM_EXPONENT, stays within the SLO's TTFT.
HEADROOM_EXPONENT = 2.0


class Why(StrEnum):
    SCALE_FROM_ZERO = "ScaleFromZero"
    SCALE_TO_ZERO = "ScaleToZero"
    REQUESTS = "RequestsPerReplica"
    WAITING = "WaitingPerReplica"
    KV_CACHE = "KvCacheUsage"
    SLO = "SloAttainment"
    SLO_HEADROOM = "SloHeadroom"
    MIN_REPLICAS = "MinReplicas"
    WITHIN_TARGETS = "WithinTargets"
    STABILIZING = "Stabilizing"
    NO_SIGNALS = "NoSignals"


@dataclass(frozen=True)
class Targets:
    min_replicas: int
    max_replicas: int
    requests_per_replica: float = 8.0
    kv_cache_usage: float = 0.8
    slo_attainment: float = 0.95
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 120.0
    max_scale_up: int = 4
    max_scale_down: int = 1
    scale_to_zero_after_s: float = 300.0
    waiting_per_replica: float = 0.0          # 0: the queue is no signal of its own
    slo_ttft_s: float = 0.0                   # spec.slo's TTFT (0: none)


@dataclass(frozen=True)
class Signals:
    ready_replicas: int
    requests: float                       # waiting + running over the ready replicas, plus held by the router
    kv_cache_usage: float | None          # mean over the ready replicas
    slo_attainment: float | None          # share of recent requests within the SLO; None: no requests or no SLO
    pending: int = 0                      # requests the router holds because no replica is ready
    idle_s: float = 0.0                   # seconds since the router last received a request
    waiting: float = 0.0                  # in the ready replicas' queues, plus held by the router
    running: float = 0.0                  # in the ready replicas' batches
    # requests, waiting and running above (and KV usage) are means over the metric window; these are the means
    # over the panic window, the latest readings (None: the same as the mean)
    requests_now: float | None = None
    waiting_now: float | None = None
    # the rise of ``requests`` per second (least squares, where clear of noise; 0: flat, falling, unknown), and
    # how far ahead a scale-up looks: the replicas' startup time (at most the trend window) plus half the metric
    # window (0: not at all)
    requests_trend: float = 0.0
    lookahead_s: float = 0.0
    # the TTFT at the SLO's percentile over the window of ``slo_attainment``; None: not measured
    ttft_at_slo: float | None = None

    @property
    def latest_requests(self) -> float:
        return self.requests if self.requests_now is None else self.requests_now

    @property
    def latest_waiting(self) -> float:
        return self.waiting if self.waiting_now is None else self.waiting_now


@dataclass
class History:
    """Recommendations of the last minutes (time, replicas): the stabilization windows look back over it."""

    recommendations: list[tuple[float, int]] = field(default_factory=list)
    since: float | None = None            # when this history started (a new leader starts a new one)

    def add(self, now: float, replicas: int, keep_s: float) -> None:
        if self.since is None:
            self.since = now
        self.recommendations.append((now, replicas))
        self.recommendations = [(t, r) for t, r in self.recommendations if now - t <= keep_s]

    def within(self, now: float, seconds: float) -> list[int]:
        return [r for t, r in self.recommendations if now - t <= seconds]


@dataclass(frozen=True)
class Recommendation:
    replicas: int
    reason: Why
    message: str
    limited: bool = False                 # the signals ask for more than maxReplicas


def _replicas(ratio: float, cap: int) -> int:
    """ceil(ratio) as a replica count, clamped to [0, cap] before it becomes an int: a load over a tiny target, an
    infinite reading or a NaN can neither overflow the conversion nor ask for more than ``cap``."""
    if not ratio > 0:                     # NaN too: no reading asks for nothing
        return 0
    return math.ceil(min(ratio - 1e-9, cap))


def _load_need(mean: float, latest: float, target: float, ready: int, asked: int, cap: int,
               ahead: float = 0.0, starting: bool = False) -> tuple[int, float, str]:
    """(replicas, load they were sized for, how it was read) for a load signal: its mean, or the mean plus the
    rise expected before a new replica is ready (``ahead``) where that needs more; or the latest readings where
    they are at least PANIC_FACTOR times the load the replicas already asked for (``asked``, ready or starting)
    are sized for. A mean within TOLERANCE of the ready replicas' target load needs just them. While replicas
    asked for are still starting, the mean's need is at most those: they have not had their chance, and the
    queue that the ready ones build meanwhile is what they are on their way to take. ``cap``: the most replicas
    worth counting (more than maxReplicas is all the same)."""
    n_mean = _replicas(mean / target, cap)
    if ready > 0 and abs(mean / (ready * target) - 1) <= TOLERANCE + 1e-9:
        n_mean = ready
    how = ""
    n_ahead = _replicas((mean + ahead) / target, cap)
    if ahead > 0 and n_ahead > n_mean and (ready <= 0 or (mean + ahead) / (ready * target) - 1 > TOLERANCE + 1e-9):
        n_mean, mean, how = n_ahead, mean + ahead, "ahead"
    if starting and n_mean > asked:
        n_mean, how = asked, "starting"
    n_latest = _replicas(latest / target, cap)
    if n_latest > n_mean and latest >= PANIC_FACTOR * target * max(asked, 1) - 1e-9:
        return n_latest, latest, "now"
    return n_mean, mean, how


def _now(how: str) -> str:
    """What a need read from the panic window's latest readings says of them."""
    return " now" if how == "now" else ""


def _needs(t: Targets, current: int, s: Signals, starting: int) -> list[tuple[int, Why, str]]:
    cap = t.max_replicas + 1              # one more than maxReplicas: the signals ask for more than it allows
    needs = []
    if t.requests_per_replica > 0:
        # look ahead only from a fleet that is all up: while replicas start, the ready ones' climbing queue is
        # no forecast of the load
        ahead = 0.0 if starting else max(s.requests_trend, 0.0) * s.lookahead_s
        n, load, how = _load_need(s.requests, s.latest_requests, t.requests_per_replica, s.ready_replicas, current,
                                  cap, ahead, starting > 0)
        said = (f"{load:.3g} requests in flight in {s.lookahead_s:.0f} s at the rise of {s.requests_trend:.2g}/s "
                f"(a replica's startup, plus half the window)" if how == "ahead"
                else f"{load:.3g} requests in flight{_now(how)}")
        needs.append((n, Why.REQUESTS, f"{said}, target {t.requests_per_replica:g} per replica"
                                       + (f"; waiting for {starting} starting" if how == "starting" else "")))
    if t.waiting_per_replica > 0:
        n, load, how = _load_need(s.waiting, s.latest_waiting, t.waiting_per_replica, s.ready_replicas, current,
                                  cap, starting=starting > 0)
        needs.append((n, Why.WAITING, f"{load:.3g} requests waiting for a batch slot{_now(how)}, "
                                      f"target {t.waiting_per_replica:g} per replica"
                                      + (f"; waiting for {starting} starting" if how == "starting" else "")))
    if s.kv_cache_usage is not None and t.kv_cache_usage > 0 and s.ready_replicas > 0:
        n = _replicas(s.ready_replicas * s.kv_cache_usage / t.kv_cache_usage, cap)
        needs.append((n, Why.KV_CACHE, f"KV cache {s.kv_cache_usage:.0%} used, target {t.kv_cache_usage:.0%}"))
    if s.slo_attainment is not None and s.slo_attainment < t.slo_attainment:
        # one more than the replicas serving now: a replica that is still starting has not had its chance (the
        # attainment is of the requests since the ready replicas last changed, measure.signals)
        needs.append((s.ready_replicas + 1, Why.SLO,
                      f"{s.slo_attainment:.1%} of requests met the SLO, target {t.slo_attainment:.1%}"))
    return needs


def _headroom(t: Targets, current: int, target: int, s: Signals) -> str | None:
    """Why a scale-down from ``current`` to ``target`` would leave too little room under the SLO's TTFT, or None.
    A fleet under load whose latency is not measured yet (its ready replicas changed too recently) waits."""
    if s.ttft_at_slo is None:
        return "the TTFT of the present replicas is not measured yet" if s.latest_requests > 0 else None
    projected = s.ttft_at_slo * (current / target) ** HEADROOM_EXPONENT
    if projected <= t.slo_ttft_s:
        return None
    return (f"TTFT {s.ttft_at_slo:.3f} s at the SLO's percentile would be about {projected:.3f} s on {target}, "
            f"SLO {t.slo_ttft_s:.3f} s")


def _within(t: Targets, replicas: int) -> int:
    return max(t.min_replicas, min(t.max_replicas, replicas))


def recommend(t: Targets, current: int, s: Signals | None, history: History, now: float,
              starting: int | None = None) -> Recommendation:
    """The replica count to run now, and why; ``history`` is updated with this step's raw recommendation.
    ``starting``: how many of the ``current`` replicas are still starting (``startup.starting_replicas``: a
    replica whose pod is Ready, or that is stuck for long, is not counted); None: those beyond the ready ones."""
    keep = max(t.scale_up_stabilization_s, t.scale_down_stabilization_s)
    if s is None:
        return Recommendation(_within(t, current), Why.NO_SIGNALS, "no reading of the router yet")
    if current == 0:
        if s.pending == 0 and t.min_replicas == 0:
            return Recommendation(0, Why.SCALE_TO_ZERO, "no request waits")
        n = max(1, t.min_replicas)
        history.add(now, n, keep)
        return Recommendation(n, Why.SCALE_FROM_ZERO, f"{s.pending} requests wait for a replica")
    if starting is None:
        starting = max(current - s.ready_replicas, 0)
    needs = _needs(t, current, s, starting)
    raw, why, text = max(needs, key=lambda n: n[0]) if needs else (0, Why.WITHIN_TARGETS, "no load")
    # a service whose replicas are all still starting has not been able to serve: it is not idle
    idle = s.latest_requests == 0 and s.pending == 0 and s.idle_s >= t.scale_to_zero_after_s \
        and (s.ready_replicas > 0 or starting == 0)
    if t.min_replicas == 0 and idle:
        raw, why, text = 0, Why.SCALE_TO_ZERO, f"no request for {s.idle_s:.0f} s"
    elif raw < max(t.min_replicas, 1):
        raw, why, text = max(t.min_replicas, 1), (Why.MIN_REPLICAS if t.min_replicas > 1 else why), text
    limited = raw > t.max_replicas
    wanted = min(raw, t.max_replicas)
    history.add(now, wanted, keep)
    if wanted > current:
        window = history.within(now, t.scale_up_stabilization_s) or [wanted]
        target = min(min(window), current + t.max_scale_up)
    elif wanted < current:
        covered = history.since is not None and now - history.since >= t.scale_down_stabilization_s
        window = history.within(now, t.scale_down_stabilization_s)
        if why == Why.SCALE_TO_ZERO:
            target = 0 if covered or t.scale_down_stabilization_s == 0 else current
        else:
            target = max(max(window), current - t.max_scale_down) if covered else current
    else:
        target = current
    target, hold = _within(t, target), _within(t, current)
    if 0 < target < hold and why != Why.SCALE_TO_ZERO and t.slo_ttft_s > 0:
        held = _headroom(t, current, target, s)
        if held is not None:
            return Recommendation(hold, Why.SLO_HEADROOM, f"{text}: {target} wanted, holding {hold}: {held}", limited)
    if target == current and wanted != current:
        return Recommendation(current, Why.STABILIZING,
                              f"{text}: {wanted} wanted, holding {current} until the stabilization window agrees", limited)
    if limited:
        text += f"; more replicas would be needed, maxReplicas is {t.max_replicas}"
    return Recommendation(target, why, text, limited)
