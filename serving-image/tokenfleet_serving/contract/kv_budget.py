"""How much memory the KV cache of one rank gets, and whether a context length fits in it: the arithmetic the
server and the operator share (no torch; the operator imports it).

A budget comes from one of (the operator's fields / the server's flags):

* an explicit size: ``engine.kvCacheMemory`` / ``--kv-cache-memory-bytes`` (``engine.kvCacheMb`` /
  ``--kv-cache-mb`` in MiB), per rank;
* a fraction of the memory a rank has (``engine.acceleratorMemoryUtilization`` / ``--gpu-memory-utilization``,
  vLLM's flag): that fraction of the accelerator's memory (on CPU, of the container's memory limit), less the
  rank's weights and ``HEADROOM_BYTES`` for activations, workspaces and the runtime. The operator takes the
  accelerator's memory from ``accelerator.memoryPerDevice`` or from ``ACCELERATOR_MEMORY_GIB``; the server
  reads it from the device (CUDA) or the cgroup (CPU). A rank that runs on the CPU with no memory limit (an
  accelerator-typed pod on a node that only pretends to have the device, or a bare ``tokenfleet serve``) shares a
  host whose size says nothing of its share: it takes the same rule over the host's memory, but never more than
  ``CPU_KV_BYTES_WITHOUT_LIMIT`` (4 GiB, as vLLM's CPU build defaults ``VLLM_CPU_KVCACHE_SPACE``).

A context of ``max_model_len`` tokens needs ``ceil(max_model_len / block_size)`` blocks of ``block_size *
kv_bytes_per_token`` bytes (``levers.kv_bytes_per_token``: the rank's KV heads, the dtype, ``kvCacheDtype``).
A budget that cannot hold one such context is refused before it runs (operator: condition
``KVCacheTooSmall``; server: exit 1 at start, the termination message naming the fields).
"""
from __future__ import annotations

import math

from .levers import kv_bytes_per_token

GIB = 1 << 30
DEFAULT_UTILIZATION = 0.9          # vLLM's --gpu-memory-utilization default
HEADROOM_BYTES = 1 * GIB           # activations, workspaces, CUDA context / Python and torch on CPU
# The most a utilization rule gives a CPU rank without a memory limit (vLLM's CPU build: VLLM_CPU_KVCACHE_SPACE=4).
CPU_KV_BYTES_WITHOUT_LIMIT = 4 * GIB

# Memory per device of the accelerator types the docs name (GiB as the vendors state it, in binary units as
# Kubernetes quantities count them); accelerator.memoryPerDevice overrides it, and is needed for any other type.
ACCELERATOR_MEMORY_GIB: dict[str, float] = {
    "nvidia-h200": 141, "nvidia-h200-141gb": 141,
    "nvidia-h100-80gb": 80, "nvidia-h100": 80, "nvidia-h100-94gb": 94,
    "nvidia-a100-80gb": 80, "nvidia-a100-40gb": 40,
    "nvidia-l40s": 48, "nvidia-l4": 24, "nvidia-a10g": 24, "nvidia-t4": 16,
    "nvidia-b200": 180, "nvidia-gb200": 186,
    "amd-mi300x": 192, "amd-mi325x": 256,
    "tpu-v5e": 16, "tpu-v5p": 95, "tpu-v6e": 32,
}


def accelerator_memory_bytes(accelerator_type: str) -> int | None:
    """Memory of one device of this type from the table, or None for a type it does not list."""
    gib = ACCELERATOR_MEMORY_GIB.get(accelerator_type)
    return None if gib is None else int(gib * GIB)


def budget_from_memory(memory_bytes: int, utilization: float, weight_bytes: int,
                       headroom_bytes: int = HEADROOM_BYTES) -> int:
    """KV bytes left of ``utilization`` x ``memory_bytes`` after the weights and the headroom (may be <= 0)."""
    return int(memory_bytes * utilization) - weight_bytes - headroom_bytes


def bounded_without_limit(budget_bytes: int) -> int:
    """A CPU rank's utilization budget when it has no memory limit: at most CPU_KV_BYTES_WITHOUT_LIMIT."""
    return min(budget_bytes, CPU_KV_BYTES_WITHOUT_LIMIT)


def tokens_that_fit(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Tokens of KV a budget holds (whole blocks)."""
    if budget_bytes <= 0:
        return 0
    return budget_bytes // (bytes_per_token * block_size) * block_size


def context_bytes(max_model_len: int, bytes_per_token: int, block_size: int) -> int:
    """Bytes one context of ``max_model_len`` tokens takes (whole blocks)."""
    return math.ceil(max_model_len / block_size) * block_size * bytes_per_token


def shortfall(budget_bytes: int, max_model_len: int, layers: int, kv_heads_per_rank: int, head_dim: int,
              dtype_bytes: int, kv_cache_dtype: str, block_size: int) -> str | None:
    """Why a rank's budget cannot hold one context of ``max_model_len`` tokens, or None when it can."""
    per_token = kv_bytes_per_token(layers, kv_heads_per_rank, head_dim, dtype_bytes, kv_cache_dtype)
    need = context_bytes(max_model_len, per_token, block_size)
    if budget_bytes >= need:
        return None
    return (f"a context of {max_model_len} tokens needs {need / 2**20:,.0f} MiB of KV cache per rank "
            f"({per_token:,} bytes per token with KV cache dtype {kv_cache_dtype}), but the budget is "
            f"{max(budget_bytes, 0) / 2**20:,.0f} MiB ({tokens_that_fit(budget_bytes, per_token, block_size):,} tokens)")
