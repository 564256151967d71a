"""Prometheus metrics under vLLM's names, plus tokenfleet's own.

Gateways (Gateway API Inference Extension, llm-d), KEDA scalers and
benchmark tools (inference-perf) query vLLM's names, so this server uses them
with vLLM's types and histogram buckets. Counters are exposed by
prometheus_client with the ``_total`` suffix (``vllm:prompt_tokens_total``),
exactly as vLLM exposes them.

Two sources feed the registry:
- engine state and engine-wide counters, read from the latest step snapshot
  at scrape time (a custom collector, so a scrape never takes the engine lock);
- per-request latencies, observed here as outputs reach the HTTP layer
  (TTFT from the moment the request arrived at the server).
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenfleet_serving.contract.cost import cost_per_million_tokens
from tokenfleet_serving.contract.lora_adapters import ADAPTER_ERROR_METRIC, ADAPTER_ROOT_METRIC
from tokenfleet_serving.engine.engine import EngineStats

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def length_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's request-length buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_len:
                return tuple(out)
            out.append(v)
        exp += 1


class RateWindow:
    """Rate of a cumulative count over a sliding time window (pure: times are passed in)."""

    def __init__(self, window_s: float = 60.0, min_spacing_s: float = 0.5):
        self.window_s, self.min_spacing_s = window_s, min_spacing_s
        self.samples: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, t: float, cumulative: float) -> None:
        if len(self.samples) >= 2 and t - self.samples[-2][0] < self.min_spacing_s:
            self.samples[-1] = (t, cumulative)     # coalesce: samples stay min_spacing_s apart
        else:
            self.samples.append((t, cumulative))
        while len(self.samples) > 2 and self.samples[1][0] <= t - self.window_s:
            self.samples.popleft()

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0


@dataclass
class RequestTimer:
    """Latency bookkeeping for one request, fed with the times its outputs arrive."""
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    gaps: list[float] = field(default_factory=list)

    def on_tokens(self, n: int, at: float) -> None:
        if n <= 0:
            return
        if self.first_token is None:
            self.first_token = at
        else:
            self.gaps.append(at - self.last_token)
        self.last_token = at
        self.num_tokens += n

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (last - first) / (N - 1)."""
        if self.num_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.num_tokens - 1)


class ServerMetrics:
    def __init__(self, model_name: str, *, price_per_hour: float | None = None, prefix_caching: bool = True,
                 window_s: float = 60.0):
        self.model_name, self.price_per_hour = model_name, price_per_hour
        self.prefix_caching = prefix_caching
        self.startup_seconds: float | None = None     # process start of serving to ready
        self.startup_phases: Callable[[], dict[str, float]] = dict   # startup.py: phase -> s since process start
        self.prefix_checkpoint_blocks: int | None = None   # blocks loaded from a warm-restart checkpoint
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.labels = {"model_name": model_name, "engine": "0"}
        reg = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=reg).labels(**self.labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=reg).labels(**self.labels)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              labels, buckets=ITL_BUCKETS, registry=reg).labels(**self.labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=reg).labels(**self.labels)
        self.prompt_len = self.gen_len = None      # bucketed by the context length: see configure()
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=reg).labels(**self.labels)
        self.prompt_tokens_cached = Counter("vllm:prompt_tokens_cached",
                                            "Number of prompt tokens served from the prefix cache.",
                                            labels, registry=reg).labels(**self.labels)
        self.rejected = Counter("tokenfleet:requests_rejected", "Requests refused before reaching the engine, "
                                "by HTTP status.", ["model_name", "code"], registry=reg)
        self.output_rate = RateWindow(window_s)
        self.snapshot: Callable[[], EngineStats | None] = lambda: None
        self.state: Callable[[], dict[str, bool]] = lambda: {}
        # adapters the --lora-modules-file refused: name -> (file, field, reason)
        self.lora_errors: Callable[[], dict[str, tuple[str, str, str]]] = dict
        reg.register(_EngineCollector(self))

    def configure(self, max_model_len: int, prefix_caching: bool) -> None:
        """Once the model is loaded: the per-request length histograms need its context length."""
        self.prefix_caching = prefix_caching
        lengths = length_buckets(max_model_len)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                    list(self.labels), buckets=lengths, registry=self.registry).labels(**self.labels)
        self.gen_len = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                 list(self.labels), buckets=lengths, registry=self.registry).labels(**self.labels)

    def observe_finished(self, timer: RequestTimer, num_prompt_tokens: int, finish_reason: str | None,
                         at: float) -> None:
        if finish_reason in ("abort", "error"):
            return
        self.e2e.observe(at - timer.arrival)
        if timer.tpot is not None:
            self.tpot.observe(timer.tpot)
        if self.prompt_len is not None:
            self.prompt_len.observe(num_prompt_tokens)
            self.gen_len.observe(timer.num_tokens)

    def observe_first_output(self, timer: RequestTimer, num_prompt_tokens: int, num_cached: int) -> None:
        if timer.ttft is not None:
            self.ttft.observe(timer.ttft)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_tokens_cached.inc(num_cached)

    def observe_gaps(self, gaps: Iterable[float]) -> None:
        for g in gaps:
            self.itl.observe(g)

    def on_snapshot(self, stats: EngineStats, at: float) -> None:
        self.output_rate.add(at, stats.generation_tokens)

    def reject(self, code: int) -> None:
        self.rejected.labels(model_name=self.model_name, code=str(code)).inc()


class _EngineCollector:
    """Engine gauges and engine-wide counters, read from the latest snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        m = self.m
        names, values = list(m.labels), list(m.labels.values())
        state = m.state()
        for key, doc in (("ready", "1 when the model is loaded, the engine is stepping and the server admits."),
                         ("draining", "1 after SIGTERM while in-flight requests finish.")):
            g = GaugeMetricFamily(f"tokenfleet:{key}", doc, labels=names)
            g.add_metric(values, 1.0 if state.get(key) else 0.0)
            yield g
        if m.startup_seconds is not None:
            g = GaugeMetricFamily("tokenfleet:startup_seconds", "Seconds from server start to ready "
                                  "(weights loaded, KV cache allocated, one warm-up token).", labels=names)
            g.add_metric(values, m.startup_seconds)
            yield g
        phases = m.startup_phases()
        if phases:
            g = GaugeMetricFamily("tokenfleet:startup_phase_seconds", "Seconds from the process start to each "
                                  "start-up phase (weights_loaded, kernels_ready, prefix_cache_loaded, first_token).",
                                  labels=[*names, "phase"])
            for phase, seconds in phases.items():
                g.add_metric([*values, phase], seconds)
            yield g
        if m.prefix_checkpoint_blocks is not None:
            g = GaugeMetricFamily("tokenfleet:prefix_checkpoint_loaded_blocks", "Prefix-cache blocks loaded at "
                                  "start from a warm-restart checkpoint.", labels=names)
            g.add_metric(values, m.prefix_checkpoint_blocks)
            yield g
        s = m.snapshot()
        if s is None:
            return

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        # vLLM V0's name for the same gauge, which older dashboards and the Gateway API Inference
        # Extension's model-server protocol still read.
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM V0 name). 1 means 100 percent usage.",
                    s.kv_cache_usage)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=names + ["block_size", "num_gpu_blocks", "enable_prefix_caching"])
        info.add_metric(values + [str(s.block_size), str(s.num_kv_blocks), str(m.prefix_caching)], 1.0)
        yield info
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=names + ["finished_reason"])
        for reason in sorted(set(s.finished) | {"stop", "length", "abort", "error"}):
            success.add_metric(values + [reason], s.finished.get(reason, 0))
        yield success
        yield counter("tokenfleet:prompt_tokens_computed", "Prompt tokens run through the model "
                      "(prompt tokens minus prefix-cache hits, plus recomputation after preemption).",
                      s.prompt_tokens)
        yield counter("tokenfleet:engine_steps", "Engine steps (forward passes) run.", s.num_steps)
        yield gauge("tokenfleet:kv_cache_blocks", "KV blocks in the pool.", s.num_kv_blocks)
        if s.spec_decode is not None:
            yield from _spec_decode_metrics(s.spec_decode, names, values)
        if s.lora is not None:
            yield from _lora_metrics(s.lora, names, values, time.time())
        if s.kv_offload is not None:
            yield from _kv_offload_metrics(s.kv_offload, names, values)
        errors = m.lora_errors()
        if errors:
            info = GaugeMetricFamily(ADAPTER_ERROR_METRIC, "LoRA adapters of --lora-modules-file the engine "
                                     "refused, with the adapter file and field (or tensor) at fault.",
                                     labels=names + ["adapter", "file", "field", "reason"])
            for adapter, (file, field_, reason) in sorted(errors.items()):
                info.add_metric(values + [adapter, file, field_, reason[:500]], 1.0)
            yield info
        rate = m.output_rate.rate()
        yield gauge("tokenfleet:output_tokens_per_second",
                    f"Generated tokens per second over the last {m.output_rate.window_s:g} s.", rate)
        if m.price_per_hour is not None:
            cost = cost_per_million_tokens(m.price_per_hour, rate)
            if cost is not None:
                yield gauge("tokenfleet:cost_per_million_tokens_usd",
                            "Accelerator price per hour divided by output tokens per hour, per million tokens.",
                            cost)


def _lora_metrics(lora, names: list[str], values: list[str], at: float) -> Iterable[Metric]:
    """vLLM's ``vllm:lora_requests_info`` (value: the snapshot's wall-clock time, as vLLM sets it), and each
    adapter's tokens, from which cost per token per adapter follows."""
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([str(lora.max_lora), ",".join(lora.running), ",".join(lora.waiting)], at)
    yield info
    prompt = CounterMetricFamily("tokenfleet:lora_prompt_tokens", "Prompt tokens of finished requests, per LoRA "
                                 "adapter.", labels=names + ["adapter"])
    generation = CounterMetricFamily("tokenfleet:lora_generation_tokens", "Tokens generated per LoRA adapter.",
                                     labels=names + ["adapter"])
    for adapter, (p, g) in sorted(lora.tokens.items()):
        prompt.add_metric(values + [adapter], p)
        generation.add_metric(values + [adapter], g)
    yield prompt
    yield generation
    loaded = GaugeMetricFamily("tokenfleet:lora_adapter_loaded", "Each LoRA adapter this replica serves: 1 when "
                               "it is in memory, 0 when it is read again on its next request (the router prefers "
                               "1).", labels=names + ["adapter"])
    for adapter in lora.adapters:
        loaded.add_metric(values + [adapter], 1.0 if adapter in lora.in_memory else 0.0)
    yield loaded
    roots = GaugeMetricFamily(ADAPTER_ROOT_METRIC, "The hash each LoRA adapter's prefix-cache blocks chain from "
                              "(its name and its files' digest), for the router's prefix affinity.",
                              labels=names + ["adapter", "root"])
    for adapter, root in sorted(lora.roots.items()):
        roots.add_metric(values + [adapter, root], 1.0)
    yield roots


def _kv_offload_metrics(tiers, names: list[str], values: list[str]) -> Iterable[Metric]:
    """Per tier (accelerator, host, disk) of the prefix cache: vLLM's prefix_cache_queries/hits split by the tier
    that served them, blocks moved in bytes and seconds per direction (``store`` into a tier, ``load`` out of it
    towards the accelerator), blocks held, and whether the tier is on (a disk tier switches itself off on a
    write error)."""
    queries = CounterMetricFamily("tokenfleet:kv_offload_prefix_cache_queries", "Prompt tokens looked up in each "
                                  "tier of the prefix cache (those the tiers above it missed).",
                                  labels=names + ["tier"])
    hits = CounterMetricFamily("tokenfleet:kv_offload_prefix_cache_hits", "Prompt tokens served by each tier of "
                               "the prefix cache (lower tiers: copied back instead of recomputed).",
                               labels=names + ["tier"])
    moved = CounterMetricFamily("tokenfleet:kv_offload_bytes", "Bytes of KV blocks moved into (store) or out of "
                                "(load) each lower tier.", labels=names + ["tier", "direction"])
    seconds = CounterMetricFamily("tokenfleet:kv_offload_seconds", "Seconds spent moving KV blocks into (store) or "
                                  "out of (load) each lower tier.", labels=names + ["tier", "direction"])
    blocks = GaugeMetricFamily("tokenfleet:kv_offload_blocks", "Blocks each lower tier holds.",
                               labels=names + ["tier"])
    capacity = GaugeMetricFamily("tokenfleet:kv_offload_capacity_blocks", "Blocks each lower tier can hold.",
                                 labels=names + ["tier"])
    enabled = GaugeMetricFamily("tokenfleet:kv_offload_tier_enabled", "1 while a lower tier is in use; 0 when "
                                "it is not configured or switched itself off (unwritable or full disk).",
                                labels=names + ["tier"])
    errors = CounterMetricFamily("tokenfleet:kv_offload_errors", "Lower-tier errors: unwritable, write, symlink (the "
                                 "tier switched off), corrupt (a file whose size or tag is wrong: a plant too), "
                                 "foreign, forged (a block refused).",
                                 labels=names + ["tier", "reason"])
    for tier, c in tiers.items():
        queries.add_metric(values + [tier], c.queries)
        hits.add_metric(values + [tier], c.hits)
        if tier == "accelerator":
            continue
        for direction, b, t in (("store", c.store_bytes, c.store_seconds), ("load", c.load_bytes, c.load_seconds)):
            moved.add_metric(values + [tier, direction], b)
            seconds.add_metric(values + [tier, direction], t)
        blocks.add_metric(values + [tier], c.blocks)
        capacity.add_metric(values + [tier], c.capacity_blocks)
        enabled.add_metric(values + [tier], 1.0 if c.enabled else 0.0)
        for reason, n in sorted(c.errors.items()):
            errors.add_metric(values + [tier, reason], n)
    yield from (queries, hits, moved, seconds, blocks, capacity, enabled, errors)


def _spec_decode_metrics(sd, names: list[str], values: list[str]) -> Iterable[Metric]:
    """vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py), and the engine's rule."""
    for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", sd.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", sd.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", sd.num_accepted_tokens)):
        c = CounterMetricFamily(name, doc, labels=names)
        c.add_metric(values, value)
        yield c
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.", labels=names + ["position"])
    for position, count in enumerate(sd.accepted_per_position):
        per_pos.add_metric(values + [str(position)], count)
    yield per_pos
    steps = CounterMetricFamily("tokenfleet:spec_decode_steps", "Engine steps where requests could speculate, "
                                "by the cost rule's decision (speculated, or declined: no gain expected).",
                                labels=names + ["decision"])
    steps.add_metric(values + ["speculated"], sd.num_steps_speculated)
    steps.add_metric(values + ["declined"], sd.num_steps_declined)
    yield steps
