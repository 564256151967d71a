"""``tokenfleet bench kvcache`` end to end on a small model: every configuration runs and the JSON carries the
issue's fields (the figures are the results page's business, not this test's)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_kvcache_reports_every_tier_and_the_warm_restart(tmp_path):
    out, png = tmp_path / "kvcache.json", tmp_path / "kvcache.png"
    proc = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "bench", "kvcache", "--small-model", "--requests", "8",
                           "--host-mb", "24", "--skip-quality", "--json", str(out), "--plot", str(png)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert {"ttft_p95_seconds", "hit_rate", "ttft_p95_ratio_hbm_only_over_host_tier", "concurrent_seqs_ratio_int8",
            "int8_kv_greedy_agreement_w5", "int8_kv_mean_kl", "warm_restart_ttft_p95_ratio_cold_over_warm",
            "hardware"} <= set(r)
    assert set(r["ttft_p95_seconds"]) == {"hbm_only", "host_tier", "host_and_disk", "int8_kv"}
    hits = r["hit_rate"]
    assert hits["hbm_only"].get("host", 0) == 0 and hits["host_tier"]["host"] > 0.5     # the host tier serves
    assert hits["host_and_disk"]["disk"] > 0                                             # and the disk tier too
    assert r["warm_restart"]["warm"]["disk_blocks_at_start"] > 0
    assert r["warm_restart"]["warm"]["hit_rate"]["total"] > r["warm_restart"]["cold"]["hit_rate"]["total"]
    assert png.stat().st_size > 0
