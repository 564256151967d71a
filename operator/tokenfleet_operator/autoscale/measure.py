"""From the router's readings over time to what the operator reports and acts on: the autoscaler's signals,
``status.goodput``, the windowed cost per token and the capacity figure. Pure functions over a history.

The collector reads every router pod of a service and adds one combined reading per read (``combine``) to the
service's ``ReadingHistory``; counters and histograms are differenced over windows (a router restart, which
resets its counters, counts from zero again).
"""
from __future__ import annotations

import datetime as dt
import math
from collections import deque
from dataclasses import dataclass, field

from tokenfleet_operator.autoscale.policy import PANIC_WINDOW_SHARE, Signals
from tokenfleet_serving.contract.cost import cost_per_million_tokens, tokens_per_hour
from tokenfleet_serving.contract.router_metrics import Histogram, RouterReading

GOODPUT_WINDOW_S = 300.0           # status.goodput and status.cost: the last 5 minutes
MIN_ATTAINMENT_WINDOW_S = 10.0     # the autoscaler's SLO signal: the metric window, at least this
CAPACITY_WINDOW_S = 60.0           # capacity: the best minute that met the SLO
MIN_TOKENS = 1000                  # fewer tokens in the window: no cost per token is shown
KEEP_S = 600.0
TREND_WINDOWS = 2                  # the requests' trend: over twice the metric window,
TREND_COVERAGE = 0.75              # ... once the history covers this much of it,
TREND_SIGNIFICANCE = 2.0           # ... where the slope is at least this many standard errors,
TREND_MIN_READINGS = 6             # ... over at least this many readings since the ready replicas last changed


def _hist_sum(hists: list[Histogram]) -> Histogram:
    out = Histogram()
    for h in hists:
        for le, n in h.buckets.items():
            out.buckets[le] = out.buckets.get(le, 0.0) + n
        out.count += h.count
        out.total += h.total
    return out


def _add(dicts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _max(dicts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = max(out.get(k, 0.0), v)
    return out


def combine(readings: list[RouterReading]) -> RouterReading:
    """The service's reading from all its router pods: counters, histograms, held and in-flight requests add
    up; every router polls every replica, so a replica's load and KV usage are the same in each (the highest is
    taken); the service was idle for as long as its least idle router."""
    r = RouterReading()
    r.backend_load = _max([one.backend_load for one in readings])
    r.backend_kv = _max([one.backend_kv for one in readings])
    r.backend_waiting = _max([one.backend_waiting for one in readings])
    r.backend_running = _max([one.backend_running for one in readings])
    r.backend_inflight = _add([one.backend_inflight for one in readings])
    r.backend_draining = _max([one.backend_draining for one in readings])
    r.pending = sum(one.pending for one in readings)
    idles = [one.idle_s for one in readings if one.idle_s is not None]
    r.idle_s = min(idles) if idles else None
    r.output_tokens = sum(one.output_tokens for one in readings)
    r.slo_requests = _add([one.slo_requests for one in readings])
    r.slo_tokens = _add([one.slo_tokens for one in readings])
    r.ttft = _hist_sum([one.ttft for one in readings])
    r.tpot = _hist_sum([one.tpot for one in readings])
    r.cold_start = _hist_sum([one.cold_start for one in readings])
    return r


@dataclass
class Entry:
    at: float                      # monotonic seconds
    wall: float                    # unix time
    reading: RouterReading
    ready_replicas: int
    baseline: bool = False         # the zeros assumed at a router's start (its counters), not a reading of gauges


@dataclass
class ReadingHistory:
    entries: deque[Entry] = field(default_factory=deque)

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)
        while self.entries and entry.at - self.entries[0].at > KEEP_S:
            self.entries.popleft()

    @property
    def latest(self) -> Entry | None:
        return self.entries[-1] if self.entries else None

    def at_least(self, seconds: float) -> Entry | None:
        """The newest entry at least ``seconds`` older than the latest (else the oldest)."""
        latest = self.latest
        if latest is None:
            return None
        older = [e for e in self.entries if latest.at - e.at >= seconds]
        return older[-1] if older else self.entries[0]


def _delta(new: float, old: float) -> float:
    return new - old if new >= old else new       # a counter reset: the newer value is all since


@dataclass(frozen=True)
class Window:
    seconds: float
    requests_met: float
    requests_missed: float
    tokens_met: float
    tokens_missed: float
    output_tokens: float
    ttft: Histogram
    tpot: Histogram
    cold_start: Histogram

    @property
    def requests(self) -> float:
        return self.requests_met + self.requests_missed

    @property
    def request_ratio(self) -> float | None:
        return self.requests_met / self.requests if self.requests > 0 else None

    @property
    def token_ratio(self) -> float | None:
        tokens = self.tokens_met + self.tokens_missed
        return self.tokens_met / tokens if tokens > 0 else None


def window(history: ReadingHistory, seconds: float, end: Entry | None = None) -> Window | None:
    """What happened over the last ``seconds`` (ending at ``end``, default the latest reading)."""
    end = end or history.latest
    if end is None:
        return None
    starts = [e for e in history.entries if end.at - e.at >= seconds - 1e-9 and e.at <= end.at]
    start = starts[-1] if starts else history.entries[0]
    if start is end:
        return None
    a, b = start.reading, end.reading
    return Window(
        seconds=end.at - start.at,
        requests_met=_delta(b.slo_requests.get("met", 0.0), a.slo_requests.get("met", 0.0)),
        requests_missed=_delta(b.slo_requests.get("missed", 0.0), a.slo_requests.get("missed", 0.0)),
        tokens_met=_delta(b.slo_tokens.get("met", 0.0), a.slo_tokens.get("met", 0.0)),
        tokens_missed=_delta(b.slo_tokens.get("missed", 0.0), a.slo_tokens.get("missed", 0.0)),
        output_tokens=_delta(b.output_tokens, a.output_tokens),
        ttft=b.ttft.minus(a.ttft), tpot=b.tpot.minus(a.tpot), cold_start=b.cold_start.minus(a.cold_start),
    )


def _load(reading: RouterReading, ready: set[str]) -> tuple[float, float, float, float | None]:
    """(requests, waiting, running, mean KV usage) of one reading, over the ready replicas it polled; the
    requests the router holds count as requests and as waiting ones."""
    pods = [p for p in ready if p in reading.backend_load]
    kv = [reading.backend_kv[p] for p in pods if p in reading.backend_kv]
    return (sum(reading.backend_load[p] for p in pods) + reading.pending,
            sum(reading.backend_waiting.get(p, 0.0) for p in pods) + reading.pending,
            sum(reading.backend_running.get(p, 0.0) for p in pods),
            sum(kv) / len(kv) if kv else None)


def trend(points: list[tuple[float, float]], significance: float = 0.0) -> float:
    """The least-squares slope of (seconds, value) points; 0 for fewer than three or no spread in time, and, with
    ``significance`` > 0, where the slope is less than that many of its standard errors (noise, not a trend)."""
    n = len(points)
    if n < 3:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    spread = sum((t - mt) ** 2 for t, _ in points)
    if spread <= 0:
        return 0.0
    slope = sum((t - mt) * (v - mv) for t, v in points) / spread
    if significance > 0:
        residual = sum((v - mv - slope * (t - mt)) ** 2 for t, v in points) / (n - 2)
        if abs(slope) < significance * math.sqrt(residual / spread):
            return 0.0
    return slope


def _idle(r: RouterReading, serving_s: float | None) -> float:
    """Seconds without a request while the service could serve: the router's idle time, but no longer than
    ``serving_s``, how long the service has been able to serve (``startup.ServingSince``: since its first replica
    became Ready). None: it never could (its replicas are starting, however long a model takes to load, or
    failing before they were ever Ready): it is not idle, whatever the router's idle time."""
    if serving_s is None:
        return 0.0
    return min(r.idle_s or 0.0, max(serving_s, 0.0))


def signals(history: ReadingHistory | None, ready_serving_pods: set[str], window_s: float = 0.0,
            startup_s: float | None = None, percentile: float | None = None,
            serving_s: float | None = None) -> Signals | None:
    """The autoscaler's inputs: load and KV usage of the ready replicas, as their mean over the readings of the
    last ``window_s`` seconds (0: the latest reading alone) and over the last tenth of them (the panic window: at
    least the last two readings); SLO attainment over the same window (at least MIN_ATTAINMENT_WINDOW_S), and only
    since the number of ready replicas last changed, once that is MIN_ATTAINMENT_WINDOW_S ago: the misses of a
    smaller fleet are not the present one's, and counting them would add replica after replica to a fleet that
    already meets the SLO. The ready replicas are ``ready_serving_pods`` now, which may already differ from those
    of the latest reading.

    The requests' rise: their slope over the readings of the last TREND_WINDOWS x ``window_s`` (twice as many as
    the mean) since the ready replicas last changed (at least TREND_MIN_READINGS), once the history covers most
    of that, and only where the slope is at least TREND_SIGNIFICANCE standard errors (a Poisson wobble is no
    rise). A scale-up looks ``startup_s`` (the replicas' measured startup; never further than the trend window
    reaches back) ahead along the rise, plus half the metric window, by which its mean lags a rising load. The
    zeros assumed at a router's start (``Entry.baseline``) count for the counters' windows only, not as a
    reading of the load."""
    latest = history.latest if history else None
    if history is None or latest is None:
        return None
    r = latest.reading
    readings = [e for e in history.entries if not e.baseline]        # the gauges' readings
    loads = [_load(e.reading, ready_serving_pods) for e in readings if latest.at - e.at <= window_s]
    recent_entries = [e for e in readings if latest.at - e.at <= window_s * PANIC_WINDOW_SHARE]
    if window_s > 0 and len(recent_entries) < 2:              # one reading alone is a blip, not a surge
        recent_entries = readings[-2:]
    panic = [_load(e.reading, ready_serving_pods) for e in recent_entries]   # the latest reading is always in it
    requests, waiting = sum(x[0] for x in panic) / len(panic), sum(x[1] for x in panic) / len(panic)
    kvs = [k for *_, k in loads if k is not None]
    since = latest
    if latest.ready_replicas == len(ready_serving_pods):
        for e in reversed(history.entries):
            if e.ready_replicas != latest.ready_replicas:
                break
            since = e
    # else the ready replicas changed after the latest reading (a pod's Ready event comes before the next read):
    # the readings so far are all of another fleet
    stable_s = latest.at - since.at
    recent = window(history, min(max(window_s, MIN_ATTAINMENT_WINDOW_S), stable_s)) \
        if stable_s >= MIN_ATTAINMENT_WINDOW_S - 1e-9 else None
    attainment = recent.request_ratio if recent else None
    ttft_at_slo = recent.ttft.quantile(percentile) if recent and percentile and recent.requests > 0 else None
    mean_requests = sum(x[0] for x in loads) / len(loads)
    trend_s = TREND_WINDOWS * window_s
    rising, ahead = 0.0, 0.0
    if trend_s > 0 and startup_s and latest.at - readings[0].at >= TREND_COVERAGE * trend_s:
        # since the ready replicas last changed: the queue a fleet built while a replica started, and its
        # draining once it serves, are no trend of the load
        points = [(e.at, _load(e.reading, ready_serving_pods)[0]) for e in readings
                  if latest.at - e.at <= trend_s and e.at >= since.at]
        if len(points) >= TREND_MIN_READINGS:
            rising = max(trend(points, TREND_SIGNIFICANCE), 0.0)
        ahead = min(startup_s, trend_s) + window_s / 2 if rising > 0 else 0.0
    return Signals(ready_replicas=len([p for p in ready_serving_pods if p in r.backend_load]),
                   requests=mean_requests,
                   kv_cache_usage=sum(kvs) / len(kvs) if kvs else None,
                   slo_attainment=attainment, pending=int(r.pending), idle_s=_idle(r, serving_s),
                   waiting=sum(x[1] for x in loads) / len(loads), running=sum(x[2] for x in loads) / len(loads),
                   requests_now=requests, waiting_now=waiting, requests_trend=rising, lookahead_s=ahead,
                   ttft_at_slo=ttft_at_slo)


def goodput(history: ReadingHistory | None, percentile: float, seconds: float = GOODPUT_WINDOW_S) -> dict | None:
    """status.goodput over the last ``seconds``."""
    w = window(history, seconds) if history else None
    if w is None:
        return None
    if w.requests <= 0:
        return {"window": f"{round(seconds / 60)}m", "requests": 0, "percentile": percentile}
    q = percentile / 100
    ratio = w.request_ratio
    return {
        "window": f"{round(seconds / 60)}m",
        "requests": int(round(w.requests)),
        "requestRatio": round(ratio, 4) if ratio is not None else None,
        "tokenRatio": round(w.token_ratio, 4) if w.token_ratio is not None else None,
        "percentile": percentile,
        "timeToFirstTokenSeconds": _rounded(w.ttft.quantile(q)),
        "timePerOutputTokenSeconds": _rounded(w.tpot.quantile(q)),
        "met": ratio is not None and ratio >= q,
    }


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def windowed_cost(history: ReadingHistory | None, dollars_per_hour: float,
                  seconds: float = GOODPUT_WINDOW_S) -> dict:
    """The cost fields of status.cost over the last ``seconds``: tokens per hour and, once at least
    MIN_TOKENS flowed, dollars per million tokens (``contract.cost``'s formula) at ``dollars_per_hour``, the
    service's mean price over the same window."""
    out: dict = {"window": f"{round(seconds / 60)}m", "minTokens": MIN_TOKENS}
    w = window(history, seconds) if history else None
    if w is None or w.seconds <= 0:
        return out
    rate = w.output_tokens / w.seconds
    out["tokensPerHour"] = round(tokens_per_hour(rate), 1)
    if w.output_tokens >= MIN_TOKENS:
        per_mtok = cost_per_million_tokens(dollars_per_hour, rate)
        out["costPerMillionTokens"] = None if per_mtok is None else round(per_mtok, 4)
    return out


def capacity_candidate(history: ReadingHistory | None, percentile: float, price_per_replica_hour: float,
                       seconds: float = CAPACITY_WINDOW_S) -> dict | None:
    """The latest minute, if it met the SLO and carried load: its tokens per hour per ready replica, and the
    cost per token at that load (the operator keeps the best such minute as status.cost.capacity)."""
    latest = history.latest if history else None
    w = window(history, seconds) if history else None
    if latest is None or w is None or w.seconds <= 0 or latest.ready_replicas <= 0 or w.requests <= 0:
        return None
    ratio = w.request_ratio
    if ratio is None or ratio < percentile / 100 or w.output_tokens < MIN_TOKENS / 10:
        return None
    per_replica = tokens_per_hour(w.output_tokens / w.seconds) / latest.ready_replicas
    per_mtok = cost_per_million_tokens(price_per_replica_hour, per_replica / 3600)
    if per_mtok is None or not math.isfinite(per_mtok):
        return None
    return {"tokensPerHourPerReplica": round(per_replica, 1), "costPerMillionTokens": round(per_mtok, 4),
            "measuredAt": dt.datetime.fromtimestamp(latest.wall, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


def cold_start_seconds(history: ReadingHistory | None, seconds: float = KEEP_S) -> float | None:
    """Mean arrival-to-first-token of the requests that found no replica ready, over the kept history."""
    w = window(history, seconds) if history else None
    if w is None or w.cold_start.count <= 0:
        return None
    return round(w.cold_start.total / w.cold_start.count, 3)


@dataclass
class PriceHistory:
    """The service's dollars per hour over time (it changes as replicas come and go), to price a window."""

    samples: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, at: float, dollars_per_hour: float) -> None:
        if not self.samples or self.samples[-1][1] != dollars_per_hour:
            self.samples.append((at, dollars_per_hour))
        while len(self.samples) > 1 and at - self.samples[1][0] > KEEP_S:
            self.samples.popleft()

    def mean(self, now: float, seconds: float) -> float | None:
        """The time-weighted mean over the last ``seconds`` (None before the first sample)."""
        if not self.samples:
            return None
        start = now - seconds
        total, covered = 0.0, 0.0
        for i, (t, value) in enumerate(self.samples):
            end = self.samples[i + 1][0] if i + 1 < len(self.samples) else now
            lo, hi = max(t, start), min(end, now)
            if hi > lo:
                total += value * (hi - lo)
                covered += hi - lo
        return total / covered if covered > 0 else self.samples[-1][1]
