"""`tokenfleet bench engine` end to end on a tiny checkpoint: it runs every workload and its JSON is coherent."""
from __future__ import annotations

import json

from tokenfleet_serving.bench import engine as bench


def test_bench_engine_reports_every_field_consistently(llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path / "kernels"))     # auto measures afresh
    out = tmp_path / "engine.json"
    rc = bench.main(["--model", str(llama_dir), "--json", str(out), "--requests", "4", "--prompt-len", "20",
                     "--output-len", "5", "--prefix-len", "40", "--new-len", "6", "--hits", "3", "--colds", "3", "--repeats", "2"])
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
    assert len(r["ttft_cold_s_runs"]) == len(r["ttft_hit_s_runs"]) == 3
    assert r["ttft_cold_s"] == sorted(r["ttft_cold_s_runs"])[1] and r["ttft_hit_s"] == sorted(r["ttft_hit_s_runs"])[1]
    assert r["w3_cached_tokens"] == 40 - 40 % 16              # whole blocks of the shared prefix came from cache
    assert r["matmul_gflops"] > 0 and r["hardware"]["cores"] >= 1
    # the roofline is the fastest matmul measured, the engine's own GEMM included where it has one
    assert r["matmul_gflops"] == max(r["matmul_gflops_by_impl"].values())
    assert "torch_matmul" in r["matmul_gflops_by_impl"]
    assert r["roofline_matmul_gflops"] == max(r["matmul_gflops"], r["matmul_gflops_mid"], r["matmul_gflops_end"])
    # W1 in each dtype, and the dtype auto chose by its probe on this host
    assert set(r["w1_by_dtype"]) == {"float32", "bfloat16", "float16"} and all(v > 0 for v in r["w1_by_dtype"].values())
    assert r["w1_by_dtype"]["float32"] == r["engine_output_tok_s"]
    assert r["auto_dtype_how"] == "measured" and set(r["auto_probe_tokens_per_second"]) == {"float32", "bfloat16"}
    probe = r["auto_probe_tokens_per_second"]
    assert r["auto_dtype"] == max(probe, key=probe.get)
    assert isinstance(r["auto_is_fastest_candidate"], bool)
    printed = capsys.readouterr().out
    assert "W1 ratio vs transformers" in printed and "W3 TTFT reduction" in printed and "dtype auto chose" in printed


def test_model_flops_count_what_the_output_needs_token_by_token():
    from tokenfleet_serving.engine.config import parse_model_config

    c = parse_model_config(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=100,
                                   hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    hd, q, kv = c.head_dim, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    full_layer = 2 * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    kv_projection = 2 * c.hidden_size * 2 * kv
    for prompt, output, cached in ((10, 4, 0), (10, 1, 0), (33, 5, 16), (17, 3, 16)):
        expected = 0
        for pos in range(cached, prompt + output - 1):              # every token that goes through the model
            for layer in range(c.num_layers):
                if layer == c.num_layers - 1 and pos < prompt - 1:  # only its key and value are read later
                    expected += kv_projection
                else:
                    expected += full_layer + 4 * (pos + 1) * c.num_heads * hd
        expected += output * 2 * c.hidden_size * c.vocab_size      # one lm_head row per generated token
        assert bench.sequence_flops(c, prompt, output, cached) == expected, (prompt, output, cached)
