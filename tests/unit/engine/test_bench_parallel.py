"""`tokenfleet bench parallel` end to end on a tiny checkpoint: every JSON field the issue names, coherent with
the per-configuration rows it is derived from."""
from __future__ import annotations

import json

from tokenfleet_serving.bench import parallel as bench


def test_bench_parallel_reports_every_field(llama_dir, tmp_path):
    out, png = tmp_path / "parallel.json", tmp_path / "parallel.png"
    rc = bench.main(["--model", str(llama_dir), "--json", str(out), "--plot", str(png), "--cores", "2",
                     "--requests", "8", "--prompt-len", "24", "--output-len", "8", "--repeats", "1",
                     "--latency-requests", "4", "--kv-cache-mb", "4", "--rate", "50"])
    assert rc == 0 and png.stat().st_size > 0
    r = json.loads(out.read_text())
    for field in ("w1_tokens_per_second", "tp2_w1_ratio", "weight_bytes_per_rank_ratio_tp2",
                  "kv_blocks_per_replica_ratio_tp2", "allreduce_seconds_per_step_tp2", "greedy_agreement_tp2",
                  "max_abs_logit_diff_tp2", "hardware"):
        assert field in r, field
    one, two = r["by_tp"]["tp1"], r["by_tp"]["tp2"]
    assert set(r["w1_tokens_per_second"]) == {"tp1", "tp2"}
    assert one["threads_per_rank"] == 2 and two["threads_per_rank"] == 1        # the same 2 cores for both
    assert r["tp2_w1_ratio"] == two["w1_tokens_per_second"] / one["w1_tokens_per_second"]
    assert r["weight_bytes_per_rank_ratio_tp2"] <= 0.55 and r["kv_blocks_per_replica_ratio_tp2"] >= 1.9
    assert r["greedy_agreement_tp2"] == 1.0 and r["max_abs_logit_diff_tp2"] < 1e-4
    # every decode step of tp=2 meets the other rank (the batch, the sums, the logits); tp=1 never does
    assert r["allreduce_seconds_per_step_tp2"] == two["collective_seconds_per_decode_step"] > 0
    assert one["collective_seconds_per_decode_step"] == 0
    assert r["fits_per_rank_budget"]["largest_by_tp"]["tp1"]["model"] == "Llama-3.1-8B"
