"""Model configuration: parse and validate a Hugging Face ``config.json``.

Only decoder-only Llama-family architectures are accepted (Llama 2/3, Mistral,
Qwen2). Every rejection names the field that caused it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt or inconsistent."""


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


class ConfigError(ValueError):
    """A config.json field is missing, malformed or unsupported."""


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool                # Llama's attention_bias covers o_proj too; Qwen2's q/k/v biases do not
    mlp_bias: bool
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def max_model_len(self) -> int:
        """Longest sequence this engine serves exactly (a sliding window caps it)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token per element byte (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _field(raw: dict, name: str, kind: type, source: str, default: Any = ...) -> Any:
    if name not in raw or raw[name] is None:
        if default is ...:
            raise ConfigError(f"{source}: required field '{name}' is missing")
        return default
    value = raw[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{source}: field '{name}' must be {kind.__name__}, got {value!r}")
    return value


def _positive(value: int, name: str, source: str) -> int:
    if value <= 0:
        raise ConfigError(f"{source}: field '{name}' must be positive, got {value}")
    return value


def _rope_scaling(raw: dict, source: str) -> dict | None:
    # transformers >= 5 writes "rope_parameters" (theta and scaling together); older ones "rope_scaling"
    key = "rope_parameters" if isinstance(raw.get("rope_parameters"), dict) else "rope_scaling"
    scaling = raw.get(key)
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{source}: field '{key}' must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: field '{key}.rope_type' = {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    scaling = dict(scaling, rope_type=rope_type)
    if rope_type == "default":
        return None
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ConfigError(f"{source}: field '{key}.factor' must be a positive number, got {factor!r}")
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if not isinstance(scaling.get(name), (int, float)):
                raise ConfigError(f"{source}: field '{key}.{name}' is required for llama3 rope scaling")
    return scaling


def _rope_theta(raw: dict, source: str) -> float:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return _field(params, "rope_theta", float, source + " rope_parameters")
    return _field(raw, "rope_theta", float, source, 10000.0)


def _token_ids(value: Any, name: str, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{source}: field '{name}' must be an int or a list of ints, got {value!r}")
    return tuple(values)


def parse_model_config(raw: Any, source: str = "config.json") -> ModelConfig:
    """Validate a decoded config.json and return a :class:`ModelConfig`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object at top level")
    architectures = raw.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        raise ConfigError(f"{source}: field 'architectures' is missing or empty")
    architecture = architectures[0]
    quant = raw.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise ConfigError(
            f"{source}: field 'quantization_config.quant_method' = {method!r}: the checkpoint is quantized "
            "already; this engine loads bf16/fp16/fp32 checkpoints only (quantization int8 quantizes them "
            "at load), so use the unquantized checkpoint")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{source}: field 'architectures' = {architecture!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    hidden = _positive(_field(raw, "hidden_size", int, source), "hidden_size", source)
    heads = _positive(_field(raw, "num_attention_heads", int, source), "num_attention_heads", source)
    kv_heads = _positive(_field(raw, "num_key_value_heads", int, source, heads), "num_key_value_heads", source)
    if heads % kv_heads:
        raise ConfigError(f"{source}: field 'num_attention_heads' ({heads}) must be a multiple of "
                          f"'num_key_value_heads' ({kv_heads})")
    head_dim = _field(raw, "head_dim", int, source, None)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{source}: field 'hidden_size' ({hidden}) must be divisible by "
                              f"'num_attention_heads' ({heads}) when 'head_dim' is absent")
        head_dim = hidden // heads
    if _positive(head_dim, "head_dim", source) % 2:
        raise ConfigError(f"{source}: field 'head_dim' must be even for rotary embeddings, got {head_dim}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: field 'hidden_act' = {act!r} is not supported (only 'silu')")
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    # biases as transformers builds these models: Llama's attention_bias (q, k, v and o) and mlp_bias;
    # Qwen2's q, k and v always; Mistral none (its config fields are not read)
    is_llama = architecture == "LlamaForCausalLM"
    attention_bias = is_llama and _field(raw, "attention_bias", bool, source, False)
    sliding = raw.get("sliding_window")
    use_sliding = raw.get("use_sliding_window", not is_qwen2)
    if not isinstance(sliding, int) or isinstance(sliding, bool) or not use_sliding:
        sliding = None
    return ModelConfig(
        architecture=architecture,
        vocab_size=_positive(_field(raw, "vocab_size", int, source), "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_positive(_field(raw, "intermediate_size", int, source), "intermediate_size", source),
        num_layers=_positive(_field(raw, "num_hidden_layers", int, source), "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_field(raw, "rms_norm_eps", float, source, 1e-6),
        rope_theta=_rope_theta(raw, source),
        rope_scaling=_rope_scaling(raw, source),
        max_position_embeddings=_positive(
            _field(raw, "max_position_embeddings", int, source, 2048), "max_position_embeddings", source),
        tie_word_embeddings=_field(raw, "tie_word_embeddings", bool, source, False),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias,
        mlp_bias=is_llama and _field(raw, "mlp_bias", bool, source, False),
        sliding_window=sliding,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        eos_token_ids=_token_ids(raw.get("eos_token_id"), "eos_token_id", source),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
    )
