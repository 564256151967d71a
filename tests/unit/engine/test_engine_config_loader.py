"""config.json parsing and checkpoint loading: every failure names the file or field."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tokenfleet_serving.engine import LLMEngine
from tokenfleet_serving.engine.config import ConfigError, parse_model_config
from tokenfleet_serving.engine.dtype_choice import choose_dtype
from tokenfleet_serving.engine.loader import CheckpointError, load_checkpoint, load_tokenizer

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}


def test_parse_minimal_and_derived_fields():
    c = parse_model_config(dict(BASE, rope_theta=500000, eos_token_id=[1, 2]))
    assert c.head_dim == 16 and c.rope_theta == 500000.0 and c.eos_token_ids == (1, 2) and not c.qkv_bias
    assert parse_model_config(dict(BASE, architectures=["Qwen2ForCausalLM"])).qkv_bias
    mistral = parse_model_config(dict(BASE, architectures=["MistralForCausalLM"], sliding_window=512))
    assert mistral.max_model_len == 512


@pytest.mark.parametrize("arch,expected", [
    ("LlamaForCausalLM", (True, True, True)),       # attention_bias: q, k, v and o; mlp_bias: the MLP
    ("Qwen2ForCausalLM", (True, False, False)),     # q, k and v always, nothing else
    ("MistralForCausalLM", (False, False, False)),  # transformers' Mistral has no biases
])
def test_biases_follow_each_architecture_as_transformers_builds_it(arch, expected):
    c = parse_model_config(dict(BASE, architectures=[arch], attention_bias=True, mlp_bias=True))
    assert (c.qkv_bias, c.o_bias, c.mlp_bias) == expected
    plain = parse_model_config(dict(BASE, architectures=[arch]))
    assert (plain.qkv_bias, plain.o_bias, plain.mlp_bias) == (arch == "Qwen2ForCausalLM", False, False)


@pytest.mark.parametrize("change,field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"architectures": []}, "architectures"),
    ({"hidden_size": None}, "hidden_size"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear"}}, "rope_parameters.factor"),
])
def test_bad_config_names_the_field(change, field):
    raw = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_model_config(raw)


@pytest.fixture
def ckpt(llama_dir, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(llama_dir, dst)
    return dst


def test_missing_files_are_named(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_checkpoint(ckpt)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"\*\.safetensors"):
        load_checkpoint(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(ckpt / "nope")


def test_corrupt_files_are_named(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json.*not valid JSON"):
        load_checkpoint(ckpt)


def test_corrupt_safetensors_is_named(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(ckpt)


def test_missing_or_misshapen_tensor_is_named(ckpt):
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        load_checkpoint(ckpt)
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="down_proj.weight' has shape"):
        load_checkpoint(ckpt)


def test_sharded_checkpoint_loads_the_same_weights(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, tmp_path / "sharded" / name)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a, b = load_checkpoint(llama_dir), load_checkpoint(tmp_path / "sharded")
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "sharded" / missing).unlink()
    with pytest.raises(CheckpointError, match=missing):
        load_checkpoint(tmp_path / "sharded")


def test_tokenizer_and_chat_template(llama_dir):
    tok = load_tokenizer(llama_dir)
    ids = tok.encode("hello world, the fleet serves tokens")
    assert tok.decode(ids) == "hello world, the fleet serves tokens"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.token_id(tok.eos_token) in tok.special_token_ids


def test_dtype_requests_pass_through_and_bad_names_are_refused():
    assert choose_dtype("fp16", torch.device("cpu")).dtype is torch.float16
    assert choose_dtype("bfloat16", torch.device("cpu")).how == "requested"
    with pytest.raises(ValueError, match="dtype"):
        choose_dtype("int3", torch.device("cpu"))


@pytest.mark.parametrize("dtype,tolerance", [("bfloat16", 0.3), ("float16", 0.05)])
def test_half_precision_logits_match_transformers_in_the_same_dtype(llama_dir, dtype, tolerance):
    """Half precision: |engine - transformers| logits within ``tolerance`` (logits span about +-7)."""
    from transformers import AutoModelForCausalLM

    from tokenfleet_serving.engine.batch import SeqChunk, build_batch
    prompt = list(range(10, 40))
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    eng = LLMEngine.from_pretrained(llama_dir, dtype=dtype, kv_cache_bytes=1 << 20, block_size=4)
    assert eng.runner.kv_pool.dtype == getattr(torch, dtype)
    table = eng.kv.pool.allocate(8)
    got = eng.runner.forward(build_batch([SeqChunk(prompt, 0, table, True)], 4, eng.device), all_logits=True)
    assert (got - ref).abs().max() < tolerance
