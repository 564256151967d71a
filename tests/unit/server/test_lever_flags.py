"""`tokenfleet serve` flags for quantization and speculative decoding: what reaches the engine, errors that
name the flag or file (exit code 2, before any weights load), and the metrics they export."""
from __future__ import annotations

import json
import shutil

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet_serving.engine.engine import EngineStats
from tokenfleet_serving.engine.speculative import SpecDecodeStats
from tokenfleet_serving.serve_args import parse_serve_args
from tokenfleet_serving.server.main import config_from_args, main
from tokenfleet_serving.server.metrics import ServerMetrics


def engine_config(model, *flags: str):
    return config_from_args(parse_serve_args(["--model", str(model), *flags])).engine


def test_lever_flags_reach_the_engine(tiny_model):
    plain = engine_config(tiny_model)
    assert plain.quantization == "none" and plain.speculative is None
    e = engine_config(tiny_model, "--quantization", "int8", "--speculative-method", "ngram",
                      "--num-speculative-tokens", "6", "--prompt-lookup-min", "1", "--prompt-lookup-max", "3")
    assert e.quantization == "int8"
    s = e.speculative
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max, s.draft_model) == \
        ("ngram", 6, 1, 3, None)
    d = engine_config(tiny_model, "--speculative-method", "draft", "--speculative-draft-model", str(tiny_model))
    assert (d.speculative.method, d.speculative.num_speculative_tokens, d.speculative.draft_model) == \
        ("draft", 4, str(tiny_model))


@pytest.mark.parametrize("flags,message", [
    (["--quantization", "fp8"], "argument --quantization: fp8 is not implemented by this engine; supported: none, int8"),
    (["--quantization", "awq"], "argument --quantization: awq is not implemented"),
    (["--quantization", "int3"], "argument --quantization: must be one of none, int8, got 'int3'"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "17"],
     "argument --num-speculative-tokens: must be in [1, 16], got 17"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], "must be in [1, 16], got 0"),
    (["--speculative-method", "medusa"], "argument --speculative-method: invalid choice: 'medusa'"),
    (["--speculative-method", "draft"], "--speculative-draft-model: draft_model is required by method draft"),
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens need --speculative-method"),
    (["--speculative-method", "ngram", "--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
     "--prompt-lookup-max: prompt_lookup_max must be an integer in [prompt_lookup_min, 64]"),
])
def test_bad_lever_flags_exit_2_naming_the_flag(tiny_model, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_model), *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_draft_model_with_another_tokenizer_exits_2_naming_its_file(tiny_model, tmp_path, capsys):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_model, draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[50], sorted(vocab)[60]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_model), "--speculative-method", "draft", "--speculative-draft-model", str(draft)])
    assert exit_.value.code == 2
    assert f"{draft / 'tokenizer.json'}: the draft's vocabulary differs from the target's" in capsys.readouterr().err


def samples(metrics: ServerMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(extra.items()))] = s.value
    return out


def stats(spec: SpecDecodeStats | None) -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_kv_blocks=8, block_size=16,
                       prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, num_chunked_prefills=0,
                       num_steps=0, prompt_tokens=0, generation_tokens=0, spec_decode=spec)


def test_speculative_counters_carry_vllm_names():
    m = ServerMetrics("tiny")
    m.snapshot = lambda: stats(None)
    assert not [k for k in samples(m) if "spec_decode" in k]              # off: no series, as in vLLM
    spec = SpecDecodeStats(3, num_drafts=10, num_draft_tokens=28, num_accepted_tokens=17,
                           accepted_per_position=[9, 6, 2], num_steps_speculated=7, num_steps_declined=4)
    m.snapshot = lambda: stats(spec)
    got = samples(m)
    assert got["vllm:spec_decode_num_drafts_total"] == 10
    assert got["vllm:spec_decode_num_draft_tokens_total"] == 28
    assert got["vllm:spec_decode_num_accepted_tokens_total"] == 17
    assert [got[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(3)] == [9, 6, 2]
    assert got["tokenfleet:spec_decode_steps_total{decision=speculated}"] == 7
    assert got["tokenfleet:spec_decode_steps_total{decision=declined}"] == 4
