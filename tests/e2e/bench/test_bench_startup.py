"""``tokenfleet bench startup`` end to end on the tiny checkpoint, one repeat, without the plane: it starts real
servers and reports every phase, the before/after ratios and the prefix checkpoint's effect."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_startup_reports_the_phases_cold_and_warm(tiny_model, tmp_path):
    out, png = tmp_path / "startup.json", tmp_path / "startup.png"
    proc = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "bench", "startup", "--model", str(tiny_model),
                           "--repeats", "1", "--no-plane", "--scenarios", "cold-read,warm-mmap,warm-mmap-prefix",
                           "--prefix-tokens", "128", "--kv-cache-mb", "8", "--num-threads", "1",
                           "--json", str(out), "--plot", str(png)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["scenarios"]) == {"cold-read", "warm-mmap", "warm-mmap-prefix"}
    for name, s in result["scenarios"].items():
        assert 0 < s["weights_loaded_s"] <= s["kernels_ready_s"] <= s["first_token_s"]
        # the server's marks count from its process start (kernel jiffies, 10 ms), the client's from its Popen
        assert s["first_token_s"] <= s["first_client_token_s"] + 0.02
        assert s["first_request_ttft_s"] > 0 and s["peak_rss_bytes"] > 0
        assert (s["prefix_cache_loaded_s"] is not None) == (name == "warm-mmap-prefix")
    loaded = {r["scenario"]: r["prefix_blocks_loaded"] for r in result["runs"]}
    assert loaded["warm-mmap-prefix"] >= 128 // 16 - 1 and loaded["warm-mmap"] is None
    assert set(result["prefix_checkpoint"]) >= {"first_request_ttft_without_s", "first_request_ttft_with_s",
                                                "ttft_ratio"}
    assert len(result["hardware"]["loadavg_start"]) == 3 and png.stat().st_size > 0
