"""The arithmetic of ``tokenfleet bench fleet``: the trace and its arrivals, per-request latencies as the
client saw them, SLO attainment, lost requests, replica-seconds."""
from __future__ import annotations

import pytest

from tokenfleet_dev.bench import fleet_metrics as fm
from tokenfleet_dev.bench.fleet_metrics import Phase, Slo

TRACE = [Phase("ramp-up", 10, 0.0, 10.0), Phase("plateau", 20, 10.0, 10.0), Phase("idle", 10, 0.0, 0.0)]


def test_rate_and_phase_follow_the_trace():
    assert fm.trace_duration(TRACE) == 40
    assert fm.rate_at(TRACE, 5) == pytest.approx(5.0)
    assert fm.rate_at(TRACE, 15) == 10.0
    assert fm.rate_at(TRACE, 35) == 0.0 and fm.rate_at(TRACE, 41) == 0.0
    assert [fm.phase_at(TRACE, t) for t in (0, 9.99, 10, 29.9, 30, 40)] == ["ramp-up", "ramp-up", "plateau",
                                                                             "plateau", "idle", None]
    assert fm.phase_bounds(TRACE)["plateau"] == (10, 30)


def test_arrivals_are_seeded_and_follow_the_rate():
    a, b = fm.arrivals(TRACE, 7), fm.arrivals(TRACE, 7)
    assert a == b and a != fm.arrivals(TRACE, 8)
    assert all(0 <= t < 30 for t in a)                       # none in the idle phase
    plateau = [t for t in a if 10 <= t < 30]
    ramp = [t for t in a if t < 10]
    assert 140 < len(plateau) < 260                          # 200 expected (Poisson, sd ~14)
    assert 20 < len(ramp) < 80                               # 50 expected
    assert fm.arrivals([Phase("idle", 10, 0, 0)], 1) == []


def rec(sent=0.0, first=0.2, finished=1.2, tokens=11, complete=True):
    return {"sent": sent, "first_token": first, "finished": finished, "output_tokens": tokens, "complete": complete}


def test_ttft_and_tpot_as_the_client_saw_them():
    r = rec()
    assert fm.ttft(r) == pytest.approx(0.2)
    assert fm.tpot(r) == pytest.approx(0.1)                  # (1.2 - 0.2) / (11 - 1)
    assert fm.tpot(rec(tokens=1)) is None
    assert fm.ttft(rec(first=None)) is None


def test_slo_attainment_counts_lost_requests_as_misses():
    slo = Slo(ttft_s=0.5, tpot_s=0.15)
    records = [rec(), rec(first=0.6, finished=1.6), rec(finished=3.0), rec(complete=False), rec(tokens=1)]
    assert [fm.meets(r, slo) for r in records] == [True, False, False, False, True]
    assert fm.attainment(records, slo) == pytest.approx(2 / 5)
    assert fm.attainment([], slo) is None
    assert fm.lost(records) == 1


def test_percentile_interpolates_and_skips_missing_values():
    assert fm.percentile([1, 2, 3, 4, None], 50) == pytest.approx(2.5)
    assert fm.percentile([5.0], 95) == 5.0
    assert fm.percentile([None], 95) is None
    assert fm.percentile(range(101), 95) == pytest.approx(95)


def test_replica_seconds_integrate_a_step_function_over_the_window():
    samples = [(100.0, 4), (110.0, 2), (120.0, 0)]
    assert fm.integrate(samples, 100, 130) == pytest.approx(4 * 10 + 2 * 10)
    assert fm.integrate(samples, 105, 115) == pytest.approx(4 * 5 + 2 * 5)
    assert fm.integrate(samples, 90, 100) == pytest.approx(40)      # before the first sample, the first value holds
    assert fm.integrate(samples, 130, 130) == 0.0 and fm.integrate([], 0, 10) == 0.0


def test_cost_per_million_tokens_from_replica_seconds():
    # 2 replica-hours at $3 per replica-hour for 1.5 M tokens: $4 per Mtok
    assert fm.cost_per_million_tokens(7200, 3.0, 1.5e6) == pytest.approx(4.0)
    assert fm.cost_per_million_tokens(7200, 3.0, 0) is None


def test_w4_pools_a_policys_alternated_runs():
    from tokenfleet_dev.bench.fleet import w4_summary

    def rec(sent: float, ttft: float, backend: str, complete: bool = True) -> dict:
        return {"sent": sent, "first_token": sent + ttft, "finished": sent + ttft + 1.0, "output_tokens": 11,
                "prompt_tokens": 100, "cached_tokens": 50, "complete": complete, "backend": backend}

    fast = [rec(i, 0.1, "a") for i in range(10)]
    slow = [rec(i, 1.0, "b") for i in range(10)]
    runs = [{"records": fast, "done": fast, "elapsed": 10.0, "cpu": 5.0, "reasons": {"least-load": 10}},
            {"records": slow + [rec(11, 1.0, "b", complete=False)], "done": slow, "elapsed": 30.0, "cpu": 15.0,
             "reasons": {"least-load": 11}}]
    s = w4_summary("least-load", False, runs)
    assert s["runs"] == 2 and s["requests"] == 21 and s["lost"] == 1
    assert s["ttft_p95_s_per_run"] == [pytest.approx(0.1), pytest.approx(1.0)]
    assert s["ttft_p50_s"] == pytest.approx(0.55)                    # of the 20 pooled requests, not of a run
    assert s["requests_per_second"] == pytest.approx(20 / 40.0)      # over the summed measured time
    assert s["output_tokens_per_second"] == pytest.approx(220 / 40.0)
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert s["requests_per_backend"] == {"a": 10, "b": 10} and s["router_decisions"] == {"least-load": 21}
    assert s["requests_per_replica_cpu_second"] == pytest.approx(20 / 20.0)


def test_api_server_timestamps_read_as_unix_seconds_with_or_without_microseconds():
    assert fm.rfc3339_seconds("1970-01-01T00:01:40Z") == 100.0
    assert fm.rfc3339_seconds("1970-01-01T00:01:40.250000Z") == 100.25


def test_longer_w4_prefixes_keep_three_of_eight_in_the_cache_and_fit_the_model():
    from tokenfleet_dev.bench.fleet import Settings, with_w4_prefix
    default = with_w4_prefix(Settings(), Settings.w4_prefix_tokens, None)
    assert (default.w4_kv_mb, default.context) == (12, 2048)      # the W4 of docs/routing.md, unchanged
    longer = with_w4_prefix(Settings(runtime="vllm"), 4096, None)
    assert longer.w4_kv_mb == 48
    assert longer.kv_blocks(longer.w4_kv_mb) // (4096 // longer.block_size) == 3
    assert longer.context >= 4096 + longer.w4_suffix_tokens + longer.w4_max_tokens
    assert with_w4_prefix(Settings(), 2048, 7).w4_kv_mb == 7


def test_a_larger_bench_model_keeps_the_default_shape_and_three_of_eight_prefixes():
    from tokenfleet_dev.bench.fleet import Settings, with_model, with_w4_prefix
    default = with_model(Settings(), Settings.layers, Settings.hidden)
    assert (default.heads, default.kv_heads, default.intermediate) == (8, 4, 768)    # the model the docs describe
    wide = with_w4_prefix(with_model(Settings(runtime="vllm"), 8, 512), 1024, None)
    assert (wide.heads, wide.kv_heads, wide.intermediate) == (16, 8, 1536)
    assert wide.kv_bytes_per_token == 4 * default.kv_bytes_per_token     # twice the layers, twice the KV heads
    assert wide.kv_blocks(wide.w4_kv_mb) // (1024 // wide.block_size) == 3
    with pytest.raises(SystemExit, match="--model-hidden 300"):
        with_model(Settings(), 4, 300)
