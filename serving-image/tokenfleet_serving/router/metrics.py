"""The router's own Prometheus metrics.

Counters are observed as requests pass; per-backend gauges and the cost gauge
are computed from the fleet state at scrape time.

| Metric | Type | Meaning |
|---|---|---|
| ``tokenfleet_router_requests_total{backend,reason,tier}`` | counter | routing decisions (reason: see policy.py) |
| ``tokenfleet_router_responses_total{code}`` | counter | responses sent to clients, by HTTP status |
| ``tokenfleet_router_retries_total{backend}`` | counter | requests re-routed because the backend could not be reached or was draining |
| ``tokenfleet_router_prefix_query_blocks_total`` | counter | full prompt blocks of routed requests |
| ``tokenfleet_router_prefix_hit_blocks_total`` | counter | of those, cached on the chosen backend (as far as the router knew) |
| ``tokenfleet_router_backends{state}`` | gauge | endpoints listed, and routable |
| ``tokenfleet_router_backend_load{backend}`` | gauge | running + waiting requests |
| ``tokenfleet_router_backend_kv_cache_usage{backend}`` | gauge | KV-cache usage 0..1 |
| ``tokenfleet_router_backend_inflight{backend}`` | gauge | requests this router has open to the backend |
| ``tokenfleet_router_backend_cached_blocks{backend}`` | gauge | blocks in the backend's prefix cache |
| ``tokenfleet_router_generation_tokens_per_second`` | gauge | summed rate of the backends' ``vllm:generation_tokens_total`` over 60 s |
| ``tokenfleet_router_dollars_per_hour{currency}`` | gauge | price per replica-hour x listed replicas |
| ``tokenfleet:cost_per_million_tokens_usd{currency}`` | gauge | dollars per hour / (generated tokens per hour) x 1e6; absent while nothing is generated |
| ``tokenfleet_router_tokenizer_loaded`` | gauge | 1 when prompts are tokenized (prefix hashing works) |
"""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from tokenfleet_serving.router.state import Fleet, cost_per_million_tokens


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
        self.prefix_query_blocks = Counter("tokenfleet_router_prefix_query_blocks",
                                           "Full prompt blocks of routed requests.", registry=reg)
        self.prefix_hit_blocks = Counter("tokenfleet_router_prefix_hit_blocks",
                                         "Prompt blocks cached on the chosen backend.", registry=reg)
        self.fleet = fleet
        self.tokenizer_loaded = tokenizer_loaded
        reg.register(_FleetCollector(self))


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
            "load": GaugeMetricFamily("tokenfleet_router_backend_load", "Running + waiting requests.", labels=["backend"]),
            "kv": GaugeMetricFamily("tokenfleet_router_backend_kv_cache_usage", "KV-cache usage 0..1.", labels=["backend"]),
            "inflight": GaugeMetricFamily("tokenfleet_router_backend_inflight", "Requests open from this router.",
                                          labels=["backend"]),
            "blocks": GaugeMetricFamily("tokenfleet_router_backend_cached_blocks", "Blocks in the prefix cache.",
                                        labels=["backend"]),
        }
        for b in backends:
            per["load"].add_metric([b.name], b.load())
            per["kv"].add_metric([b.name], b.sample.kv_usage if b.sample else 0.0)
            per["inflight"].add_metric([b.name], b.inflight)
            per["blocks"].add_metric([b.name], len(b.cached))
        yield from per.values()
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
