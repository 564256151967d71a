"""`tokenfleet bench engine` end to end on a tiny checkpoint: it runs every workload and its JSON is coherent."""
from __future__ import annotations

import json

from tokenfleet_serving.bench import engine as bench


def test_bench_engine_reports_every_field_consistently(llama_dir, tmp_path, capsys):
    out = tmp_path / "engine.json"
    rc = bench.main(["--model", str(llama_dir), "--json", str(out), "--requests", "4", "--prompt-len", "20",
                     "--output-len", "5", "--prefix-len", "40", "--new-len", "6", "--hits", "3", "--repeats", "2"])
    assert rc == 0
    r = json.loads(out.read_text())
    for field in ("hf_output_tok_s", "engine_output_tok_s", "ratio_vs_hf", "roofline_output_tok_s",
                  "roofline_fraction", "matmul_gflops", "hardware", "ttft_cold_s", "ttft_hit_s", "ttft_reduction",
                  "prefill_roofline_fraction", "engine_pytorch_path_output_tok_s", "kernels_speedup"):
        assert field in r, field
    assert r["engine_w1_cached_prompt_tokens"] == 0          # W1 computes every prompt token, as transformers does
    assert r["greedy_match_hf"] == 1.0                       # same weights, same greedy tokens as transformers
    assert abs(r["ratio_vs_hf"] - r["engine_output_tok_s"] / r["hf_output_tok_s"]) < 1e-9
    assert abs(r["roofline_fraction"] - r["engine_output_tok_s"] / r["roofline_output_tok_s"]) < 1e-9
    assert abs(r["ttft_reduction"] - (1 - r["ttft_hit_s"] / r["ttft_cold_s"])) < 1e-9
    assert r["w3_cached_tokens"] == 40 - 40 % 16              # whole blocks of the shared prefix came from cache
    assert r["matmul_gflops"] > 0 and r["hardware"]["cores"] >= 1
    # the roofline is the fastest matmul measured, the engine's own GEMM included where it has one
    assert r["matmul_gflops"] == max(r["matmul_gflops_by_impl"].values())
    assert "torch_matmul" in r["matmul_gflops_by_impl"]
    assert r["roofline_matmul_gflops"] == max(r["matmul_gflops"], r["matmul_gflops_mid"], r["matmul_gflops_end"])
    printed = capsys.readouterr().out
    assert "W1 ratio vs transformers" in printed and "W3 TTFT reduction" in printed
