"""``tokenfleet bench recovery`` on the real local plane, shortened: two replicas under streamed load, one of
them SIGKILLed; no client request may fail, and every field of the report is there."""
from __future__ import annotations

import json

import pytest

from harness.operator_cluster import install

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_a_short_recovery_run_loses_no_request(cluster, namespace, tiny_model, tmp_path):
    from tokenfleet_dev.bench.recovery import Options, plot, run_on

    install(cluster)
    opts = Options(replicas=2, clients=3, prefixes=4, prefix_words=40, max_tokens=8, quiet_seconds=8, duration=12,
                   fault_interval=10, faults="kill", cold=False, hit_window_seconds=10)
    result = run_on(cluster, namespace, tmp_path, opts, tiny_model)
    assert result["client_requests_total"] > 0
    assert result["client_requests_failed"] == 0, result["phases"]
    [fault] = result["faults"]["warm"]
    assert fault["kind"] == "kill" and fault["replace_seconds"] > 0
    assert result["mean_replace_seconds"] == fault["replace_seconds"]
    for key in ("migrated_streams", "ttft_p99_chaos_s", "ttft_p99_quiet_s", "hit_rate_first_minute_warm",
                "hit_rate_first_minute_cold"):
        assert key in result
    assert result["ttft_p99_quiet_s"] > 0 and result["ttft_p99_chaos_s"] > 0
    json.dumps(result)
    result["hardware"] = {"loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0]}
    plot(result, str(tmp_path / "recovery.png"))
    assert (tmp_path / "recovery.png").stat().st_size > 0
