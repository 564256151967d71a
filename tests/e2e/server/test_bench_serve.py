"""The online benchmark's arithmetic, and one tiny end-to-end run."""
from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys

import pytest

from tokenfleet_serving.bench.serve import RequestRecord, Slo, keeps_up, percentile, poisson_arrivals, saturation, summarize


def test_poisson_arrivals_have_the_requested_rate_and_exponential_gaps():
    offsets = poisson_arrivals(4.0, 20000, random.Random(1))
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)     # exponential: stdev == mean
    assert poisson_arrivals(4.0, 5, random.Random(7)) == poisson_arrivals(4.0, 5, random.Random(7))
    # a short run offers exactly its rate: its 12 gaps span 12 / 2.0 = 6 s, so the last send comes before
    # 6 s for every seed (free exponential gaps pass 6 s in about a third of runs), and stay random
    lasts = [poisson_arrivals(2.0, 12, random.Random(seed))[-1] for seed in range(40)]
    assert all(last < 6.0 for last in lasts) and statistics.stdev(lasts) > 0.2


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 90) == 90
    assert percentile([10.0, 0.0], 100) == 10.0


def _rec(ttft, e2e, tokens, error=None):
    return RequestRecord(sent=0.0, ttft=ttft, e2e=e2e, output_tokens=tokens, itls=[0.1] * max(tokens - 1, 0),
                         error=error)


def test_summarize_counts_goodput_against_both_slos():
    slo = Slo(ttft_s=0.5, tpot_s=0.1)
    records = [_rec(0.2, 1.0, 10),           # tpot 0.089: meets both
               _rec(0.6, 1.5, 10),           # ttft too slow
               _rec(0.2, 2.0, 10),           # tpot 0.2: too slow
               _rec(None, None, 0, error="HTTP 429")]
    row = summarize(2.0, records, duration_s=2.0, slo=slo)
    assert (row["completed"], row["failed"]) == (3, 1)
    assert row["goodput"] == pytest.approx(0.5)
    assert row["achieved_rate"] == pytest.approx(1.5)
    assert row["output_tokens_per_s"] == pytest.approx(15.0)
    assert row["ttft_p50_ms"] == pytest.approx(200.0)
    assert row["tpot_p50_ms"] == pytest.approx(100.0)
    assert row["itl_p99_ms"] == pytest.approx(100.0)
    assert row["slo_attainment"] == pytest.approx(0.25)
    # finishing early is keeping up exactly: the rate is counted over the offered window (4 / 2.0 = 2 s)
    assert summarize(2.0, records, duration_s=1.2, slo=slo)["achieved_rate"] == pytest.approx(1.5)
    assert summarize(2.0, records, duration_s=3.0, slo=slo)["achieved_rate"] == pytest.approx(1.0)


def test_saturation_is_the_first_rate_that_cannot_keep_up():
    def row(offered, achieved, goodput, failed=0):
        return {"offered_rate": offered, "achieved_rate": achieved, "goodput": goodput, "failed": failed,
                "output_tokens_per_s": achieved * 32}
    rows = [row(1, 0.98, 0.98), row(2, 1.9, 1.9), row(4, 3.1, 1.0), row(8, 3.2, 0.2)]
    assert [keeps_up(r) for r in rows] == [True, True, False, False]
    s = saturation(rows)
    assert (s["saturation_rate"], s["max_sustained_rate"], s["peak_goodput_at_rate"]) == (4, 2, 2)
    assert saturation([row(1, 1.0, 1.0)])["saturation_rate"] is None
    assert not keeps_up(row(1, 1.0, 1.0, failed=1))


@pytest.mark.slow
def test_bench_serve_end_to_end(tiny_model, tmp_path):
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "bench", "serve", "--model", str(tiny_model),
                           "--json", str(out), "--rates", "2,200", "--num-requests", "6", "--min-seconds", "0", "--input-len", "16",
                           "--output-len", "8", "--server-arg=--num-threads=1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert [r["completed"] for r in result["rows"]] == [6] * len(result["rows"])
    first = result["rows"][0]
    assert first["output_tokens_per_s"] > 0 and first["ttft_p99_ms"] >= first["ttft_p50_ms"] > 0
    assert result["summary"]["saturation_rate"] in (None, 2.0, 200.0)
    assert result["server_exit_code"] == 0 and "cpu" in result["hardware"]
    assert "TTFT p50/p90/p99 ms" in proc.stdout
