"""The pure parts of the metrics: rate window, cost per token, request timer, buckets."""
from __future__ import annotations

import math

import pytest

from tokenfleet_serving.contract.cost import cost_per_million_tokens
from tokenfleet_serving.server.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, RateWindow, RequestTimer, length_buckets


def test_rate_window_measures_over_the_window_and_decays_when_idle():
    w = RateWindow(window_s=10, min_spacing_s=0.5)
    assert w.rate() == 0.0
    for t in range(0, 11):
        w.add(float(t), 100.0 * t)           # 100 tokens/s
    assert w.rate() == pytest.approx(100.0)
    for t in range(11, 40):
        w.add(float(t), 1000.0)              # idle from t=10
    assert w.rate() == 0.0


def test_rate_window_coalesces_close_samples():
    w = RateWindow(window_s=60, min_spacing_s=1.0)
    for i in range(100):
        w.add(i * 0.01, i)                   # 100 samples within one second
    assert len(w.samples) == 2
    assert w.rate() == pytest.approx(99 / 0.99)


def test_cost_per_million_tokens():
    # $3.60/h at 1000 tok/s = 3.6M tokens/h -> $1 per million
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)
    assert cost_per_million_tokens(3.6, 0.0) is None
    assert cost_per_million_tokens(3.6, math.inf) is None


def test_request_timer_ttft_tpot_and_gaps():
    t = RequestTimer(arrival=10.0)
    t.on_tokens(0, 10.1)                     # an output with no tokens is not a first token
    t.on_tokens(1, 10.5)
    t.on_tokens(1, 10.7)
    t.on_tokens(2, 11.1)
    assert t.ttft == pytest.approx(0.5)
    assert t.gaps == pytest.approx([0.2, 0.4])
    assert t.tpot == pytest.approx(0.6 / 3)
    single = RequestTimer(arrival=0.0)
    single.on_tokens(1, 1.0)
    assert single.tpot is None and single.ttft == 1.0


def test_buckets_match_vllm_shapes():
    assert (len(TTFT_BUCKETS), len(ITL_BUCKETS), len(E2E_BUCKETS)) == (22, 19, 21)
    assert all(a < b for a, b in zip(TTFT_BUCKETS, TTFT_BUCKETS[1:]))
    assert length_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert length_buckets(4096)[-1] == 2000


def _stats(generation_tokens: int, **kw):
    from tokenfleet_serving.engine.engine import EngineStats

    base = dict(num_running=2, num_waiting=3, kv_cache_usage=0.25, num_kv_blocks=64, block_size=16,
                prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=1, num_chunked_prefills=0,
                num_steps=10, prompt_tokens=60, generation_tokens=generation_tokens,
                finished={"stop": 2, "length": 5})
    return EngineStats(**dict(base, **kw))


def _scrape(metrics) -> dict:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(metrics.registry).decode()
    return {(s.name, s.labels.get("finished_reason")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_collector_exposes_the_snapshot_and_the_cost_per_token():
    from tokenfleet_serving.server.metrics import ServerMetrics

    m = ServerMetrics("m", price_per_hour=7.2, window_s=60)
    stats = _stats(0)
    m.snapshot = lambda: stats
    for t in range(0, 11):                   # 200 output tokens/s for 10 s
        stats = _stats(200 * t)
        m.on_snapshot(stats, float(t))
    v = _scrape(m)
    assert v[("vllm:num_requests_waiting", None)] == 3
    assert v[("vllm:kv_cache_usage_perc", None)] == 0.25
    assert v[("vllm:gpu_cache_usage_perc", None)] == 0.25        # the V0 name older dashboards read
    assert v[("vllm:prefix_cache_hits_total", None)] == 40
    assert v[("vllm:request_success_total", "length")] == 5
    assert v[("vllm:request_success_total", "abort")] == 0
    assert v[("tokenfleet:output_tokens_per_second", None)] == pytest.approx(200.0)
    # $7.20/h at 200 tok/s = 720k tokens/h -> $10 per million
    assert v[("tokenfleet:cost_per_million_tokens_usd", None)] == pytest.approx(10.0)


def test_no_cost_sample_while_idle_or_without_a_price():
    from tokenfleet_serving.server.metrics import ServerMetrics

    idle = ServerMetrics("m", price_per_hour=7.2)
    idle.snapshot = lambda: _stats(0)
    assert ("tokenfleet:cost_per_million_tokens_usd", None) not in _scrape(idle)
    unpriced = ServerMetrics("m")
    unpriced.snapshot = lambda: _stats(0)
    for t in range(5):
        unpriced.on_snapshot(_stats(100 * t), float(t))
    assert ("tokenfleet:cost_per_million_tokens_usd", None) not in _scrape(unpriced)


def test_kv_offload_metrics_per_tier_and_the_disk_tier_switched_off():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tokenfleet_serving.engine.kv_offload import TierCounters
    from tokenfleet_serving.server.metrics import ServerMetrics

    m = ServerMetrics("m")
    tiers = {"accelerator": TierCounters(queries=1000, hits=200),
             "host": TierCounters(queries=800, hits=600, store_bytes=4096, store_seconds=0.5, load_bytes=2048,
                                  load_seconds=0.25, blocks=7, capacity_blocks=10),
             "disk": TierCounters(queries=200, hits=0, enabled=False, errors={"write": 1})}
    stats = _stats(0, kv_offload=tiers)
    m.snapshot = lambda: stats
    text = generate_latest(m.registry).decode()
    v = {(s.name, s.labels.get("tier"), s.labels.get("direction") or s.labels.get("reason")): s.value
         for f in text_string_to_metric_families(text) for s in f.samples}
    assert v[("tokenfleet:kv_offload_prefix_cache_queries_total", "host", None)] == 800
    assert v[("tokenfleet:kv_offload_prefix_cache_hits_total", "accelerator", None)] == 200
    assert v[("tokenfleet:kv_offload_bytes_total", "host", "store")] == 4096
    assert v[("tokenfleet:kv_offload_seconds_total", "host", "load")] == 0.25
    assert v[("tokenfleet:kv_offload_blocks", "host", None)] == 7
    assert v[("tokenfleet:kv_offload_tier_enabled", "host", None)] == 1
    assert v[("tokenfleet:kv_offload_tier_enabled", "disk", None)] == 0
    assert v[("tokenfleet:kv_offload_errors_total", "disk", "write")] == 1
    # a replica without tiers exports none of them
    stats = _stats(0)
    assert "kv_offload" not in generate_latest(m.registry).decode()
