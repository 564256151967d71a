"""``tokenfleet bench fleet`` end to end on the real control plane, with a trace of seconds: every JSON field
the issue names is there with a value, the load generator's requests all got complete answers, the
autoscaled service went to zero and a request brought it back, and the table and the plot come out."""
from __future__ import annotations

import json

import pytest

from tokenfleet_dev.bench.fleet import Settings, plot, run_bench, tables
from tokenfleet_dev.bench.fleet_metrics import Phase

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

FIELDS = ("autoscale_slo_attainment", "autoscale_replica_seconds_ratio", "requests_lost",
          "scale_from_zero_first_token_seconds", "w4_ttft_p95_seconds", "w4_p95_ratio_round_robin_over_prefix_aware",
          "nosharing_p95_ratio_prefix_aware_over_least_load", "hardware")


def short() -> Settings:
    return Settings(
        layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512,
        trace=[Phase("ramp-up", 4, 0.5, 2.0), Phase("plateau", 6, 2.0, 2.0), Phase("burst", 3, 4.0, 4.0),
               Phase("ramp-down", 4, 2.0, 0.5), Phase("idle", 6, 0.0, 0.0)],
        prompt_tokens=32, max_tokens=8, max_replicas=2, slo_ttft_ms=60000, slo_tpot_ms=10000,
        scale_down_stabilization_s=5, scale_to_zero_after_s=5, collect_seconds=1, target_requests_per_replica=8.0,
        w4_replicas=2, w4_clients=4, w4_seconds=6, w4_warmup_s=1, w4_prefixes=4, w4_prefix_tokens=128, w4_suffix_tokens=8,
        w4_max_tokens=4, w4_kv_mb=2, policies=("prefix-aware", "round-robin"),
        nosharing_policies=("prefix-aware", "least-load"),
    )


def test_a_short_fleet_benchmark_reports_every_field_and_loses_nothing(cluster, namespace, tmp_path):
    result = run_bench(cluster, namespace, short(), tmp_path, log=print)
    result = json.loads(json.dumps(result))                     # what --json writes
    for name in FIELDS:
        assert result.get(name) is not None, name
    assert set(result["w4_ttft_p95_seconds"]) == {"prefix-aware", "round-robin"}
    assert all(v > 0 for v in result["w4_ttft_p95_seconds"].values())

    # nothing lost anywhere: the static and the autoscaled trace, every W4 run, the cold start
    a = result["autoscale"]
    assert result["requests_lost"] == 0, a["autoscaled"]["lost_reasons"]
    assert result["static_requests_lost"] == 0, a["static"]["lost_reasons"]
    assert result["w4_requests_lost"] == 0
    assert a["static"]["requests"] == a["autoscaled"]["requests"] == a["static"]["offered"] > 10
    assert a["cold_start"]["reached_zero"] and a["cold_start"]["complete"]
    assert result["scale_from_zero_first_token_seconds"] > 0
    # the JSON says when and why the replicas moved, from the operator's Events: down to zero and back from it
    said = [(e["reason"], e["message"].split(": ")[1]) for e in a["scaling_events"] if e["t"] is not None]
    assert ("ScaledDown", "ScaleToZero") in said and ("ScaledUp", "ScaleFromZero") in said, a["scaling_events"]

    # the static service ran its 2 replicas through the trace; the autoscaled one fewer replica-seconds
    assert a["static"]["max_replicas_seen"] == 2
    assert 0 < result["autoscale_replica_seconds_ratio"] < 1
    assert 0 <= result["autoscale_slo_attainment"] <= 1
    assert a["autoscaled"]["output_tokens"] == 8 * a["autoscaled"]["requests"]

    # W4: every run served requests, and a prefix-aware replica reuses the shared prefixes
    for run in [*result["w4"]["policies"].values(), *result["w4"]["nosharing"].values()]:
        assert run["requests"] > 0 and run["requests_per_second"] > 0
    assert result["w4_prefix_cache_hit_rate"]["prefix-aware"] > 0.3
    assert result["w4"]["nosharing"]["least-load"]["prefix_cache_hit_rate"] < 0.2

    text = tables(result)
    assert "autoscaled" in text and "round-robin" in text
    plot(result, tmp_path / "fleet.png")
    assert (tmp_path / "fleet.png").stat().st_size > 10_000
