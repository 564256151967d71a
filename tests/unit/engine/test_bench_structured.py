"""`tokenfleet bench structured` end to end on a tiny checkpoint: every field the issue names, coherent."""
from __future__ import annotations

import json
import math

from tokenfleet_serving.bench import structured as bench


def test_bench_structured_reports_every_field(llama_dir, tmp_path):
    out, png = tmp_path / "structured.json", tmp_path / "structured.png"
    rc = bench.main(["--model", str(llama_dir), "--json", str(out), "--plot", str(png), "--rounds", "1",
                     "--compile-repeats", "5"])
    assert rc == 0 and png.stat().st_size > 0
    r = json.loads(out.read_text())
    for field in ("json_schema_tpot_ratio_batch1", "json_schema_tpot_ratio_batch16", "grammar_compile_seconds_cold",
                  "grammar_compile_seconds_cached", "schema_valid_fraction", "hardware"):
        assert field in r, field
    assert r["schema_valid_fraction"] == 1.0 and r["constrained_outputs"] == 1 + 16
    for b in (1, 16):
        batch = r[f"batch{b}"]
        assert abs(batch["tpot_ratio"] - batch["json_schema_tpot_s"] / batch["free_tpot_s"]) < 1e-12
        assert r[f"json_schema_tpot_ratio_batch{b}"] == batch["tpot_ratio"]
        assert math.isfinite(batch["mask_overhead_fraction"])
    # timings are the benchmark's to compare (docs/results/structured.md), not this test's
    assert r["grammar_compile_seconds_cached"] > 0 and r["grammar_compile_seconds_cold"] > 0
