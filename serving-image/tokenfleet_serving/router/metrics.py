"""The router's own Prometheus metrics.

Counters are observed as requests pass; per-backend gauges and the cost gauge
are computed from the fleet state at scrape time.

| Metric | Type | Meaning |
|---|---|---|
| ``tokenfleet_router_requests_total{backend,reason,tier}`` | counter | routing decisions (reason: see policy.py) |
| ``tokenfleet_router_responses_total{code}`` | counter | responses sent to clients, by HTTP status |
| ``tokenfleet_router_client_errors_total{code}`` | counter | 4xx for the client's fault (not 429), |
  by the router or a replica, on the completion routes; not in the SLO counters |
| ``tokenfleet_router_held_request_bytes`` | gauge | body bytes of the requests held for a replica (bounded by ``--max-held-bytes``) |
| ``tokenfleet_router_hold_refusals_total{reason}`` | counter | 503s instead of a hold: the held-request |
  limit (``count``) or ``--max-held-bytes`` (``bytes``) |
| ``tokenfleet_router_sessions`` | gauge | session keys remembered (bounded by ``--max-sessions``) |
| ``tokenfleet_router_session_evictions_total`` | counter | session keys forgotten for room, least recently used first |
| ``tokenfleet_router_retries_total{backend}`` | counter | requests re-routed because the backend could not be reached or was draining |
| ``tokenfleet_router_migrations_total{reason}`` | counter | streams continued on another backend (migration.py); |
  reason ``backend-disconnected``, ``backend-error`` or ``backend-stalled`` |
| ``tokenfleet_router_migration_failures_total{reason}`` | counter | broken streams that could not be continued |
| ``tokenfleet_router_prefix_query_blocks_total`` | counter | full prompt blocks of routed requests |
| ``tokenfleet_router_prefix_hit_blocks_total`` | counter | of those, cached on the chosen backend (as far as the router knew) |
| ``tokenfleet_router_backends{state}`` | gauge | endpoints listed, and routable |
| ``tokenfleet_router_backend_load{backend}`` | gauge | running + waiting requests (at least those this router has open) |
| ``tokenfleet_router_backend_requests_waiting{backend}`` | gauge | the backend's queue, ``vllm:num_requests_waiting`` as polled |
| ``tokenfleet_router_backend_requests_running{backend}`` | gauge | the backend's batch, ``vllm:num_requests_running`` as polled |
| ``tokenfleet_router_backend_kv_cache_usage{backend}`` | gauge | KV-cache usage 0..1 |
| ``tokenfleet_router_backend_inflight{backend}`` | gauge | requests this router has open to the backend |
| ``tokenfleet_router_backend_cached_blocks{backend}`` | gauge | blocks in the backend's prefix cache (as the |
  router knows them: polled, recorded as routed, or from KV events) |
| ``tokenfleet_router_kv_event_batches_total{backend}`` | counter | KV-event batches applied (prefixSource kvEvents) |
| ``tokenfleet_router_kv_event_batches_missed_total{backend}`` | counter | batches skipped in the sequence (lost) |
| ``tokenfleet_router_kv_event_batches_replayed_total{backend}`` | counter | of those, batches the replica replayed on |
  request (missed or from before the router followed it) |
| ``tokenfleet_router_kv_event_blocks_unnamed_total{backend}`` | counter | stored blocks the router could not key by |
  its own hash (kv_events.py says which) |
| ``tokenfleet_router_kv_event_rejected_total{backend,reason}`` | counter | what the router skipped from a replica's |
  KV events: ``message`` (not a batch), ``event`` (a malformed event; the rest of its batch is applied), ``oversize``
  (a batch over the event or block bounds) |
| ``tokenfleet_router_generation_tokens_per_second`` | gauge | summed rate of the backends' ``vllm:generation_tokens_total`` over 60 s |
| ``tokenfleet_router_dollars_per_hour{currency}`` | gauge | price per replica-hour x listed replicas |
| ``tokenfleet:cost_per_million_tokens_usd{currency}`` | gauge | dollars per hour / (generated tokens per hour) x 1e6;
  absent while nothing is generated |
| ``tokenfleet_router_tokenizer_loaded`` | gauge | 1 when prompts are tokenized (prefix hashing works) |

What the operator reads for goodput, cost and autoscaling (names in ``contract.router_metrics``; the
definitions in ``observe.py``):

| Metric | Type | Meaning |
|---|---|---|
| ``tokenfleet_router_time_to_first_token_seconds`` | histogram | arrival to first output token (streamed requests) |
| ``tokenfleet_router_time_per_output_token_seconds`` | histogram | (e2e - TTFT) / (tokens - 1) (streamed, 2+ tokens) |
| ``tokenfleet_router_e2e_request_latency_seconds`` | histogram | arrival to the last byte |
| ``tokenfleet_router_slo_requests_total{result}`` | counter | requests that met (``met``) or missed (``missed``) the SLO; |
  client errors (``observe.is_client_error``) are in neither |
| ``tokenfleet_router_slo_output_tokens_total{result}`` | counter | their output tokens |
| ``tokenfleet_router_output_tokens_total`` | counter | output tokens delivered to clients |
| ``tokenfleet_router_pending_requests`` | gauge | requests held because no replica is ready (scale from zero) |
| ``tokenfleet_router_cold_start_seconds`` | histogram | arrival to first token of requests that waited for a replica |
| ``tokenfleet_router_seconds_since_last_request`` | gauge | idle time (scale to zero) |
| ``tokenfleet_router_backend_draining{backend}`` | gauge | 1 while a backend gets no new requests (scale-down) |
"""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenfleet_serving.contract import router_metrics as rm
from tokenfleet_serving.contract.cost import cost_per_million_tokens
from tokenfleet_serving.router.observe import Timing
from tokenfleet_serving.router.state import BackendState, Fleet


class RouterMetrics:
    def __init__(self, fleet: Fleet, tokenizer_loaded: bool):
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.requests = Counter("tokenfleet_router_requests", "Routing decisions by backend, reason and tier.",
                                ["backend", "reason", "tier"], registry=reg)
        self.responses = Counter("tokenfleet_router_responses", "Responses sent to clients by HTTP status.",
                                 ["code"], registry=reg)
        self.retries = Counter("tokenfleet_router_retries", "Requests re-routed away from a backend.",
                               ["backend"], registry=reg)
        self.migrations = Counter("tokenfleet_router_migrations", "Streams continued on another backend after "
                                  "theirs failed mid-stream, by why it failed.", ["reason"], registry=reg)
        self.migration_failures = Counter("tokenfleet_router_migration_failures", "Broken streams that could not "
                                          "be continued and ended with an error event, by why not.", ["reason"],
                                          registry=reg)
        self.client_errors = Counter("tokenfleet_router_client_errors", "Completion requests answered with a 4xx "
                                     "for the client's fault (429 excluded), by the router or a replica; not counted "
                                     "as SLO misses.", ["code"], registry=reg)
        self.hold_refusals = Counter("tokenfleet_router_hold_refusals", "Requests answered 503 instead of held for "
                                     "a replica: the held-request limit (count) or the held-bytes limit (bytes).",
                                     ["reason"], registry=reg)
        for reason in ("count", "bytes"):
            self.hold_refusals.labels(reason=reason)
        for reason in ("backend-disconnected", "backend-error", "backend-stalled"):
            self.migrations.labels(reason=reason)
        for reason in ("limit", "no-backend", "not-migratable", "target-error"):
            self.migration_failures.labels(reason=reason)
        self.prefix_query_blocks = Counter("tokenfleet_router_prefix_query_blocks",
                                           "Full prompt blocks of routed requests.", registry=reg)
        self.prefix_hit_blocks = Counter("tokenfleet_router_prefix_hit_blocks",
                                         "Prompt blocks cached on the chosen backend.", registry=reg)
        self.ttft = Histogram(rm.TTFT, "Arrival to first output token of streamed requests.",
                              buckets=rm.TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram(rm.TPOT, "Time per output token after the first, of streamed requests.",
                              buckets=rm.TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram(rm.E2E, "Arrival to the last byte of the response.", buckets=rm.E2E_BUCKETS, registry=reg)
        self.cold_start = Histogram(rm.COLD_START, "Arrival to first token of requests that waited for a replica to be ready.",
                                    buckets=rm.COLD_START_BUCKETS, registry=reg)
        self.slo_requests = Counter(rm.SLO_REQUESTS.removesuffix("_total"), "Requests that met or missed the SLO.",
                                    ["result"], registry=reg)
        self.slo_tokens = Counter(rm.SLO_OUTPUT_TOKENS.removesuffix("_total"), "Output tokens of requests that "
                                  "met or missed the SLO.", ["result"], registry=reg)
        self.output_tokens = Counter(rm.OUTPUT_TOKENS.removesuffix("_total"), "Output tokens delivered to clients.",
                                     registry=reg)
        for result in ("met", "missed"):     # both series exist from the start, so rates over them are defined
            self.slo_requests.labels(result=result)
            self.slo_tokens.labels(result=result)
        self.fleet = fleet
        self.tokenizer_loaded = tokenizer_loaded
        self.pending = lambda: 0
        self.held_bytes = lambda: 0
        self.idle_s = lambda: 0.0
        reg.register(_FleetCollector(self))

    def observe(self, t: Timing, met: bool, cold: bool) -> None:
        """One finished request: its latencies, tokens and SLO outcome."""
        result = "met" if met else "missed"
        self.slo_requests.labels(result=result).inc()
        self.slo_tokens.labels(result=result).inc(t.output_tokens)
        self.output_tokens.inc(t.output_tokens)
        if t.e2e is not None:
            self.e2e.observe(t.e2e)
        if t.stream and t.ttft is not None:
            self.ttft.observe(t.ttft)
        if t.tpot is not None:
            self.tpot.observe(t.tpot)
        first = t.ttft if t.ttft is not None else t.e2e
        if cold and t.ok and first is not None:
            self.cold_start.observe(first)


def _kv_event_families(followed: list[BackendState]) -> Iterable[Metric]:
    """The KV-event counters of the backends whose events the router follows (none: no families)."""
    if not followed:
        return
    events = {
        "batches": CounterMetricFamily("tokenfleet_router_kv_event_batches", "KV-event batches applied.",
                                       labels=["backend"]),
        "missed": CounterMetricFamily("tokenfleet_router_kv_event_batches_missed",
                                      "KV-event batches skipped in the sequence.", labels=["backend"]),
        "replayed": CounterMetricFamily("tokenfleet_router_kv_event_batches_replayed",
                                        "KV-event batches applied from the replica's replay socket.",
                                        labels=["backend"]),
        "unnamed": CounterMetricFamily("tokenfleet_router_kv_event_blocks_unnamed",
                                       "Stored blocks the router could not key by its own hash.",
                                       labels=["backend"]),
        "rejected": CounterMetricFamily("tokenfleet_router_kv_event_rejected", "KV-event messages, events "
                                        "and batches skipped as unreadable or over the bounds, by why.",
                                        labels=["backend", "reason"]),
    }
    for b in followed:
        assert b.events is not None
        events["batches"].add_metric([b.name], b.events.batches)
        events["missed"].add_metric([b.name], b.events.gaps)
        events["replayed"].add_metric([b.name], b.events.replayed)
        events["unnamed"].add_metric([b.name], b.events.unnamed)
        for reason, count in b.events.rejected.items():
            events["rejected"].add_metric([b.name, reason], count)
    yield from events.values()


class _FleetCollector:
    def __init__(self, m: RouterMetrics):
        self.m = m

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        fleet = self.m.fleet
        cfg = fleet.config
        backends = list(fleet.backends.values())
        routable = {b.name for b in fleet.routable()}
        states = GaugeMetricFamily("tokenfleet_router_backends", "Backends listed and routable.", labels=["state"])
        states.add_metric(["listed"], len(backends))
        states.add_metric(["routable"], len(routable))
        yield states
        per = {
            "load": GaugeMetricFamily(rm.BACKEND_LOAD, "Running + waiting requests.", labels=["backend"]),
            "waiting": GaugeMetricFamily(rm.BACKEND_WAITING, "Requests in the backend's queue (vllm:num_requests_waiting).",
                                         labels=["backend"]),
            "running": GaugeMetricFamily(rm.BACKEND_RUNNING, "Requests in the backend's batch (vllm:num_requests_running).",
                                         labels=["backend"]),
            "kv": GaugeMetricFamily("tokenfleet_router_backend_kv_cache_usage", "KV-cache usage 0..1.", labels=["backend"]),
            "inflight": GaugeMetricFamily("tokenfleet_router_backend_inflight", "Requests open from this router.",
                                          labels=["backend"]),
            "blocks": GaugeMetricFamily("tokenfleet_router_backend_cached_blocks", "Blocks in the prefix cache.",
                                        labels=["backend"]),
            "draining": GaugeMetricFamily(rm.BACKEND_DRAINING, "1 while the backend gets no new requests.",
                                          labels=["backend"]),
        }
        for b in backends:
            per["load"].add_metric([b.name], b.load())
            per["waiting"].add_metric([b.name], b.sample.waiting if b.sample else 0.0)
            per["running"].add_metric([b.name], b.sample.running if b.sample else 0.0)
            per["kv"].add_metric([b.name], b.sample.kv_usage if b.sample else 0.0)
            per["inflight"].add_metric([b.name], b.inflight)
            per["blocks"].add_metric([b.name], b.cached_blocks())
            per["draining"].add_metric([b.name], 1.0 if b.endpoint.draining else 0.0)
        yield from per.values()
        yield from _kv_event_families([b for b in backends if b.events is not None])
        yield GaugeMetricFamily(rm.PENDING, "Requests held because no replica is ready.", value=self.m.pending())
        yield GaugeMetricFamily("tokenfleet_router_held_request_bytes", "Body bytes of the requests held for a "
                                "replica.", value=self.m.held_bytes())
        yield GaugeMetricFamily("tokenfleet_router_sessions", "Session keys remembered.",
                                value=len(fleet.sessions.entries))
        yield CounterMetricFamily("tokenfleet_router_session_evictions", "Session keys forgotten for room, least "
                                  "recently used first.", value=fleet.sessions.evicted)
        yield GaugeMetricFamily(rm.IDLE_SECONDS, "Seconds since the last request arrived.", value=self.m.idle_s())
        rate = fleet.generation_tokens_per_second()
        yield GaugeMetricFamily("tokenfleet_router_generation_tokens_per_second",
                                "Generated tokens per second, summed over the backends (60 s window).", value=rate)
        dollars = cfg.price_per_replica_hour * len(backends)
        g = GaugeMetricFamily("tokenfleet_router_dollars_per_hour", "Price of the listed replicas per hour.",
                              labels=["currency"])
        g.add_metric([cfg.currency], dollars)
        yield g
        cost = cost_per_million_tokens(dollars, rate) if dollars > 0 else None
        c = GaugeMetricFamily("tokenfleet:cost_per_million_tokens_usd",
                              "Cost per million generated tokens: dollars per hour / generated tokens per hour * 1e6.",
                              labels=["currency"])
        if cost is not None:
            c.add_metric([cfg.currency], cost)
        yield c
        yield GaugeMetricFamily("tokenfleet_router_tokenizer_loaded", "1 when prompts are tokenized for prefix hashing.",
                                value=1.0 if self.m.tokenizer_loaded else 0.0)
