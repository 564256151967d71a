"""What the router measures and the operator reads: metric names, and the reading the operator takes.

The router (``tokenfleet route``) exports these on /metrics; the operator's collector reads them from each
service's router pods and turns them into the autoscaler's signals, ``status.goodput`` and ``status.cost``.

Latencies follow vLLM's and inference-perf's definitions, measured at the router, where the client's
request passes: TTFT is from the request's arrival to its first output token; TPOT is
(end-to-end - TTFT) / (output tokens - 1); end-to-end is arrival to the last byte. A request *meets the
SLO* when its TTFT and its TPOT are within ``spec.slo``'s targets (a target that is not set always holds);
a request that fails through the fleet's fault (5xx, 429, a broken stream, no replica in time) misses it; one
refused for the client's fault (any other 4xx) counts neither way (``router/observe.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# per backend (label "backend": the pod)
BACKEND_LOAD = "tokenfleet_router_backend_load"                    # running + waiting requests (the engine's)
BACKEND_WAITING = "tokenfleet_router_backend_requests_waiting"     # the engine's queue (vllm:num_requests_waiting)
BACKEND_RUNNING = "tokenfleet_router_backend_requests_running"     # in its batch (vllm:num_requests_running)
BACKEND_KV = "tokenfleet_router_backend_kv_cache_usage"            # 0..1
BACKEND_INFLIGHT = "tokenfleet_router_backend_inflight"            # requests this router has open to it
BACKEND_DRAINING = "tokenfleet_router_backend_draining"            # 1 while it gets no new requests
# the service as the router sees it
PENDING = "tokenfleet_router_pending_requests"                     # held because no replica is ready
IDLE_SECONDS = "tokenfleet_router_seconds_since_last_request"
OUTPUT_TOKENS = "tokenfleet_router_output_tokens_total"            # output tokens delivered to clients
SLO_REQUESTS = "tokenfleet_router_slo_requests_total"              # label result: met | missed
SLO_OUTPUT_TOKENS = "tokenfleet_router_slo_output_tokens_total"    # label result: met | missed
TTFT = "tokenfleet_router_time_to_first_token_seconds"             # histogram
TPOT = "tokenfleet_router_time_per_output_token_seconds"           # histogram
E2E = "tokenfleet_router_e2e_request_latency_seconds"              # histogram
COLD_START = "tokenfleet_router_cold_start_seconds"                # histogram: arrival to first token of requests that waited for a replica

# Histogram buckets shared by the router (observing) and the operator (reading percentiles).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
COLD_START_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class Histogram:
    """Cumulative bucket counts (upper bound -> count), as Prometheus exposes them."""

    buckets: dict[float, float] = field(default_factory=dict)
    count: float = 0.0
    total: float = 0.0

    def minus(self, older: Histogram) -> Histogram:
        """The observations made since ``older`` (a counter reset gives the newer one whole)."""
        if self.count < older.count:
            return self
        return Histogram({le: n - older.buckets.get(le, 0.0) for le, n in self.buckets.items()},
                         self.count - older.count, self.total - older.total)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1), interpolated inside its bucket as Prometheus' histogram_quantile does."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le in sorted(self.buckets):
            n = self.buckets[le]
            if n >= rank:
                if math.isinf(le):
                    return lower_bound
                width = n - lower_count
                return lower_bound + (le - lower_bound) * ((rank - lower_count) / width if width > 0 else 1.0)
            lower_bound, lower_count = le, n
        return lower_bound


@dataclass
class RouterReading:
    """One scrape of one router."""

    backend_load: dict[str, float] = field(default_factory=dict)
    backend_waiting: dict[str, float] = field(default_factory=dict)
    backend_running: dict[str, float] = field(default_factory=dict)
    backend_kv: dict[str, float] = field(default_factory=dict)
    backend_inflight: dict[str, float] = field(default_factory=dict)
    backend_draining: dict[str, float] = field(default_factory=dict)
    pending: float = 0.0
    idle_s: float | None = None
    output_tokens: float = 0.0
    slo_requests: dict[str, float] = field(default_factory=dict)        # result -> count
    slo_tokens: dict[str, float] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    cold_start: Histogram = field(default_factory=Histogram)

    @classmethod
    def from_text(cls, text: str) -> RouterReading | None:
        from prometheus_client.parser import text_string_to_metric_families
        r = cls()
        hists = {TTFT: r.ttft, TPOT: r.tpot, COLD_START: r.cold_start}
        try:
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    r._take(s.name, s.labels, s.value, hists)
        except ValueError:
            return None
        return r

    def _take(self, name: str, labels: dict[str, str], value: float, hists: dict[str, Histogram]) -> None:
        per_backend = {BACKEND_LOAD: self.backend_load, BACKEND_WAITING: self.backend_waiting,
                       BACKEND_RUNNING: self.backend_running, BACKEND_KV: self.backend_kv,
                       BACKEND_INFLIGHT: self.backend_inflight, BACKEND_DRAINING: self.backend_draining}
        if name in per_backend and "backend" in labels:
            per_backend[name][labels["backend"]] = value
        elif name == PENDING:
            self.pending = value
        elif name == IDLE_SECONDS:
            self.idle_s = value
        elif name == OUTPUT_TOKENS:
            self.output_tokens = value
        elif name == SLO_REQUESTS and "result" in labels:
            self.slo_requests[labels["result"]] = value
        elif name == SLO_OUTPUT_TOKENS and "result" in labels:
            self.slo_tokens[labels["result"]] = value
        else:
            for base, hist in hists.items():
                if name == base + "_bucket":
                    hist.buckets[float(labels["le"])] = value
                elif name == base + "_count":
                    hist.count = value
                elif name == base + "_sum":
                    hist.total = value
