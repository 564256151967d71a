"""Load a Hugging Face checkpoint directory: config, safetensors weights, tokenizer.

Every failure raises :class:`CheckpointError` naming the file (and tensor or
field) at fault.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .config import CheckpointError, ConfigError, ModelConfig, parse_model_config, read_json
from .tokenizer import Tokenizer, load_tokenizer


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None


def load_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / "config.json"
    try:
        return parse_model_config(read_json(path), source=str(path))
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes the model needs."""
    h, hd, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i)})
        if config.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,),
                           p + "mlp.down_proj.bias": (h,)})
    return shapes


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: field 'weight_map' is missing or empty")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: file not found (listed in {index.name})")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors file found")
    return files


LOAD_FORMATS = ("mmap", "read")


def load_weights(directory: str | Path, config: ModelConfig, dtype: torch.dtype,
                 load_format: str = "mmap") -> dict[str, torch.Tensor]:
    """The model's tensors in ``dtype``. ``mmap``: views of the memory-mapped files where the dtype already
    matches (``safetensors_mmap.py``: no copy until the model packs them); ``read``: every tensor read into
    memory of its own first (safetensors' ``get_tensor``)."""
    from safetensors import safe_open

    from .safetensors_mmap import mapped_tensors

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    directory = Path(directory)
    wanted = expected_tensors(config)
    weights: dict[str, torch.Tensor] = {}
    for path in _weight_files(directory):
        try:
            if load_format == "mmap":
                found = mapped_tensors(path, set(wanted))
            else:
                with safe_open(str(path), framework="pt") as f:
                    found = {name: f.get_tensor(name) for name in f.keys() if name in wanted}
        except Exception as exc:  # safetensors raises several error types for corrupt files
            raise CheckpointError(f"{path}: cannot read safetensors file ({exc})") from exc
        for name, tensor in found.items():
            if not tensor.is_floating_point():     # a quantized checkpoint's integer tensors, say
                raise CheckpointError(f"{path}: tensor '{name}' is {tensor.dtype}; this engine loads "
                                      "float (bf16/fp16/fp32) weights only")
            weights[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    for name, shape in wanted.items():
        if name not in weights:
            raise CheckpointError(f"{directory}: tensor '{name}' not found in any *.safetensors file")
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"{directory}: tensor '{name}' has shape {tuple(weights[name].shape)}, "
                                  f"config.json implies {shape}")
    return weights


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32,
                    with_tokenizer: bool = True, load_format: str = "mmap") -> Checkpoint:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    config = load_config(directory)
    weights = load_weights(directory, config, dtype, load_format)
    tokenizer = load_tokenizer(directory) if with_tokenizer else None
    return Checkpoint(directory, config, weights, tokenizer)
