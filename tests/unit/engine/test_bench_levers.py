"""`tokenfleet bench levers` parts: W5's copying models (built and trained), the request runners the rows
are measured with, and the table and plot (the full benchmark runs for minutes: `tokenfleet bench levers`)."""
from __future__ import annotations

import json

import pytest
import torch

from tokenfleet_serving.bench import copy_task, levers
from tokenfleet_serving.engine import LLMEngine
from tokenfleet_serving.engine.speculative import SpeculativeConfig


@pytest.fixture(scope="module")
def copier(tmp_path_factory):
    return tmp_path_factory.mktemp("w5") / "copier"


def test_the_built_circuit_copies_from_its_prompt_and_prompt_lookup_holds(copier):
    report = copy_task.build(copier, copy_task.CIRCUIT_TARGET)
    assert report["how"] == "built" and json.loads((copier / "copy_task.json").read_text()) == report
    prompts = copy_task.prompts(copy_task.W5, 2, seed=5)
    assert levers.copied_fraction(copier, prompts) > 0.8                 # its answers are spans of its prompt
    eng = LLMEngine.from_pretrained(copier, dtype="float32", kv_cache_bytes=16 << 20, load_tokenizer=False,
                                    speculative=SpeculativeConfig("ngram", 4, adaptive=False))
    run = levers.run_engine(eng, "w5", prompts, None, concurrency=1, max_tokens=40)
    stats = eng.stats().spec_decode
    assert stats.num_accepted_tokens > 0.6 * stats.num_draft_tokens     # so prompt lookup's drafts hold
    assert run.output_tokens == 2 * 40 and len(run.ttft) == 2 and all(t > 0 for t in run.tpot)


def test_the_circuits_filler_layers_compute_but_change_no_greedy_token(tmp_path):
    bare = copy_task.CircuitShape(hidden_size=256)
    padded = copy_task.CircuitShape(hidden_size=256, filler_layers=2, intermediate_size=64)
    copy_task.build(tmp_path / "bare", bare)
    copy_task.build(tmp_path / "padded", padded)
    prompts = copy_task.prompts(copy_task.W5, 3, seed=9)
    outs = {}
    for name in ("bare", "padded"):
        eng = LLMEngine.from_pretrained(tmp_path / name, dtype="float32", kv_cache_bytes=16 << 20, load_tokenizer=False)
        assert eng.model_config.num_layers == (2 if name == "bare" else 4)
        outs[name] = [o.new_token_ids for o in eng.generate(prompts, levers.SamplingParams(max_tokens=40, temperature=0.0))]
        if name == "padded":       # the filler is not zero: it moves the logits, only not their argmax
            filler = eng.runner.layers[3]
            assert filler.linears()["gate_up"](torch.ones(1, 256)).abs().max() > 0
    assert outs["padded"] == outs["bare"] and all(outs["bare"])


def test_training_a_copy_model_saves_a_checkpoint_the_engine_loads(tmp_path):
    shape = copy_task.CopyModelShape(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=32)
    task = copy_task.CopyTask(doc_min=8, doc_max=12, span_min=2, span_max=4)
    report = copy_task.train(tmp_path / "trained", shape, task, max_steps=3, batch_size=2, log=lambda m: None)
    assert report["how"] == "trained" and report["steps"] == 3
    eng = LLMEngine.from_pretrained(tmp_path / "trained", dtype="float32", kv_cache_bytes=4 << 20)
    [out] = eng.generate([copy_task.prompts(task, 1, seed=0)[0]])
    assert out.new_token_ids


def test_static_batches_run_to_their_longest_request_and_the_engine_does_not(llama_dir):
    prompts = [[5 + i, 6, 7, 8] for i in range(4)]
    lengths = [2, 12, 3, 4]
    static = levers.run_static(llama_dir, "static", prompts, lengths, LLMEngine.from_pretrained(
        llama_dir, dtype="float32", kv_cache_bytes=4 << 20).dtype, batch_size=2)
    assert static.output_tokens == sum(lengths) and len(static.ttft) == 4 and len(static.tpot) == 4
    assert static.ttft[0] == static.ttft[1] < static.ttft[2] == static.ttft[3]     # the second batch waits
    eng = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=4 << 20, max_num_seqs=2)
    run = levers.run_engine(eng, "cb", prompts, lengths)
    assert run.output_tokens == sum(lengths) and len(run.ttft) == 4


def test_the_table_and_the_plot(tmp_path):
    def row(label, workload, tps):
        return levers.Run(label, 100, 100 / tps, [0.1, 0.2], [0.01, 0.02]).row(2.0) | {"workload": workload}

    result = {"price_per_hour": 2.0, "auto_dtype": "float32", "loadavg_start": (1.0, 1.0, 1.0),
              "loadavg_end": (2.0, 1.0, 1.0),
              "hardware": {"cpu": "test cpu", "isa": "avx2", "cores": 2},
              "rows": [row("baseline", "WM", 10.0), row("+ cb", "WM", 20.0) | {"vs_previous": 2.0}],
              "speculation_sweep": [{"batch": b, "off_tokens_per_second": 10.0 * b, "always_tokens_per_second": 20.0 * b,
                                     "rule_tokens_per_second": 20.0 * b} for b in (1, 2, 4)],
              "ngram_speedup_batch1": 2.0, "int8_mean_kl": 0.001}
    assert row("x", "WM", 10.0)["dollars_per_mtok"] == pytest.approx(2.0 / 36000 * 1e6, rel=1e-3)
    text = levers.table(result)
    assert "| baseline | WM | 10.0 | 36,000 | 55.556 |" in text and "ngram_speedup_batch1: 2" in text
    levers.plot(result, str(tmp_path / "levers.png"))
    assert (tmp_path / "levers.png").read_bytes()[:4] == b"\x89PNG"


def test_a_ratio_of_paired_rounds_is_their_median():
    def run(tps):
        return levers.Run("r", 100, 100 / tps, [0.1], [0.01])
    ratio, ratios = levers.paired_ratio([run(110), run(93), run(104)], [run(100), run(100), run(100)])
    assert ratios == pytest.approx([1.1, 0.93, 1.04]) and ratio == pytest.approx(1.04)
    # the rounds are paired: a slow round of both engines is a ratio of 1, not a loss for the lever
    ratio, _ = levers.paired_ratio([run(50), run(100)], [run(50), run(100)])
    assert ratio == pytest.approx(1.0)
    with pytest.raises(ValueError):
        levers.paired_ratio([run(1)], [run(1), run(2)])
