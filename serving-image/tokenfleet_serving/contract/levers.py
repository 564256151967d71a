"""The cost levers' names and bounds, shared by the server's argument parser, the engine and the operator's
validation. Imports no torch: the operator image checks serving command lines without it."""
from __future__ import annotations

QUANTIZATION_METHODS = ("none", "int8")
QUANTIZATIONS_NOT_BUILT = ("fp8", "awq", "gptq")      # names the API knows, which this engine does not implement
MAX_SPECULATIVE_TOKENS = 16


class QuantizationError(ValueError):
    """A quantization this engine or this checkpoint cannot take; the message names the field or file."""


def parse_quantization(name: str | None, field: str = "quantization") -> str:
    """'none' or 'int8'; anything else is a QuantizationError naming ``field``."""
    value = "none" if name is None else str(name).strip().lower()
    if value in QUANTIZATION_METHODS:
        return value
    if value in QUANTIZATIONS_NOT_BUILT:
        raise QuantizationError(f"{field}: {value} is not implemented by this engine; supported: "
                                f"{', '.join(QUANTIZATION_METHODS)} (int8 quantizes a bf16/fp16/fp32 checkpoint at load)")
    raise QuantizationError(f"{field} must be one of {', '.join(QUANTIZATION_METHODS)}, got {name!r}")


# ---- the KV cache's storage dtype (--kv-cache-dtype, engine.kvCacheDtype) ---------------------------------------
KV_CACHE_DTYPES = ("auto", "int8")
KV_CACHE_DTYPES_NOT_BUILT = ("fp8",)     # names the API knows, which this engine does not implement


def parse_kv_cache_dtype(name: str | None, field: str = "kv_cache_dtype") -> str:
    """'auto' (the compute dtype) or 'int8'; anything else is a QuantizationError naming ``field``."""
    value = "auto" if name is None else str(name).strip().lower()
    if value in KV_CACHE_DTYPES:
        return value
    if value in KV_CACHE_DTYPES_NOT_BUILT or value.startswith("fp8"):
        raise QuantizationError(f"{field}: {value} is not implemented by this engine; supported: "
                                f"{', '.join(KV_CACHE_DTYPES)} (int8: one scale per token and KV head)")
    raise QuantizationError(f"{field} must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


KV_SCALE_BYTES = 2      # an int8 KV cache keeps one bfloat16 scale per token, KV head, and keys or values


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes one token takes in a KV cache of ``layers`` layers with ``kv_heads`` KV heads (one rank's share):
    keys and values of head_dim elements each, in the compute dtype (``auto``, ``dtype_bytes`` each) or in int8
    plus a bfloat16 scale per head."""
    per_head = head_dim * dtype_bytes if kv_cache_dtype == "auto" else head_dim + KV_SCALE_BYTES
    return 2 * layers * kv_heads * per_head
