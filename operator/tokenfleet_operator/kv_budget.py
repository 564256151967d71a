"""InferenceService -> the KV-cache budget of each rank: the server flags that set it, and whether a context of
``engine.maxModelLen`` fits in it once (pure; the arithmetic is ``tokenfleet_serving.contract.kv_budget``).

Where the budget comes from (at most one of the three fields; the schema refuses two):

* ``engine.kvCacheMemory`` (a quantity per rank) -> ``--kv-cache-memory-bytes``; ``engine.kvCacheMb`` ->
  ``--kv-cache-mb``;
* ``engine.acceleratorMemoryUtilization`` -> ``--gpu-memory-utilization``: that fraction of a device's memory
  less the rank's weights and the headroom. The device's memory is ``accelerator.memoryPerDevice``, else the
  table ``ACCELERATOR_MEMORY_GIB`` for ``accelerator.type`` (passed as ``--accelerator-memory-bytes`` so the
  server sizes from the same number), else what the server reads from the device; on CPU the container's
  ``resources.limits.memory``, which the server reads from its cgroup;
* none of them: utilization 0.9 on an accelerator, and with ``accelerator.type: cpu`` when the replica has a
  memory limit; with ``cpu`` and no limit, the server's default (512 MiB). A budget flag in ``engine.extraArgs``
  replaces the default. (An accelerator-typed replica that runs on the CPU after all, on a node that only
  pretends to have the device, is capped by the server: at its memory limit, and without one at
  ``CPU_KV_BYTES_WITHOUT_LIMIT``.)

The check needs the model's shape (``status.modelShape``: layers, KV heads, head width, weight bytes), which the
operator reads before starting a split model; the server checks the same at start for any replica and exits 1
naming the fields. The dtype counts at its smallest plausible size (``auto``: 2 bytes) and unknown weights as
zero, so a budget is refused only when it certainly cannot hold one context.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenfleet_operator.api.common import quantity_value
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.parallelism import ModelShape, parallel_sizes
from tokenfleet_serving.contract.kv_budget import (
    DEFAULT_UTILIZATION,
    HEADROOM_BYTES,
    accelerator_memory_bytes,
    budget_from_memory,
    shortfall,
)
from tokenfleet_serving.serve_args import ServeArgs, ServeArgsError, parse_serve_args

BUDGET_FLAGS = ("--kv-cache-mb", "--kv-cache-memory-bytes", "--gpu-memory-utilization")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "auto": 2}


@dataclass(frozen=True)
class KVBudget:
    flags: tuple[str, ...]                 # the server flags that set it
    field: str                             # the spec field it comes from (for messages)
    bytes_per_rank: int | None = None      # an explicit size
    utilization: float | None = None       # or a fraction of memory_bytes, less weights and headroom
    memory_bytes: int | None = None        # a device's memory (CPU: the memory limit), when the operator knows it


def _bytes(quantity) -> int | None:
    value = quantity_value(quantity) if quantity is not None else None
    return None if value is None else int(value)


def _memory_limit(spec: InferenceServiceSpec) -> int | None:
    limits = spec.resources.limits or {}
    return _bytes(limits.get("memory"))


def _extra_sets_budget(spec: InferenceServiceSpec) -> bool:
    return any(arg.split("=", 1)[0] in BUDGET_FLAGS for arg in spec.engine.extra_args or [])


def _extra_args(spec: InferenceServiceSpec) -> ServeArgs | None:
    """engine.extraArgs as the server reads them (None when its parser refuses them: the argument check names
    that)."""
    try:
        return parse_serve_args(["--model", "m", *(spec.engine.extra_args or [])])
    except ServeArgsError:
        return None


def _extra_budget_bytes(spec: InferenceServiceSpec) -> int | None:
    args = _extra_args(spec)
    if args is None or (args.kv_cache_mb is None and args.kv_cache_memory_bytes is None):
        return None
    return args.kv_cache_bytes


def kv_budget(spec: InferenceServiceSpec) -> KVBudget:
    """How each rank's KV budget is set (see the module's doc)."""
    eng, acc = spec.engine, spec.accelerator
    if eng.kv_cache_memory is not None:
        size = _bytes(eng.kv_cache_memory) or 0
        return KVBudget(("--kv-cache-memory-bytes", str(size)), "spec.engine.kvCacheMemory", bytes_per_rank=size)
    if eng.kv_cache_mb is not None:
        return KVBudget(("--kv-cache-mb", str(eng.kv_cache_mb)), "spec.engine.kvCacheMb",
                        bytes_per_rank=eng.kv_cache_mb << 20)
    if eng.accelerator_memory_utilization is not None:
        utilization, field = eng.accelerator_memory_utilization, "spec.engine.acceleratorMemoryUtilization"
    elif _extra_sets_budget(spec):
        return KVBudget((), "spec.engine.extraArgs", bytes_per_rank=_extra_budget_bytes(spec))
    elif acc.type != "cpu" or _memory_limit(spec) is not None:
        utilization, field = DEFAULT_UTILIZATION, "spec.engine.acceleratorMemoryUtilization (default 0.9)"
    else:
        return KVBudget((), "the server's default (512 MiB)", bytes_per_rank=512 << 20)
    flags: tuple[str, ...] = ("--gpu-memory-utilization", f"{utilization:g}")
    if acc.type == "cpu":
        memory = _memory_limit(spec)
    else:
        memory = _bytes(acc.memory_per_device) if acc.memory_per_device is not None else accelerator_memory_bytes(acc.type)
        if memory is not None:
            flags += ("--accelerator-memory-bytes", str(memory))
    return KVBudget(flags, field, utilization=utilization, memory_bytes=memory)


def rank_memory_bytes(spec: InferenceServiceSpec) -> tuple[int, str] | None:
    """(bytes, what they are) of the memory one rank has, when the operator knows it: the container's memory
    limit on CPU, else accelerator.memoryPerDevice or the table's figure for accelerator.type."""
    acc = spec.accelerator
    if acc.type == "cpu":
        limit = _memory_limit(spec)
        return None if limit is None else (limit, "spec.resources.limits.memory")
    if acc.memory_per_device is not None:
        stated = _bytes(acc.memory_per_device)
        return None if stated is None else (stated, "spec.accelerator.memoryPerDevice")
    table = accelerator_memory_bytes(acc.type)
    return None if table is None else (table, f"the memory of one {acc.type}")


def kv_budget_memory_error(spec: InferenceServiceSpec) -> tuple[str, str] | None:
    """(field, message) when an explicit budget (kvCacheMemory, kvCacheMb) is more than a rank's memory holds
    (the operator's condition KVCacheTooLarge): the server could not allocate it and would exit at start.
    None when it fits, when the budget is a fraction, or when the operator does not know the memory (CPU
    without a memory limit, an accelerator type outside the table: the server checks it at start)."""
    budget = kv_budget(spec)
    memory = rank_memory_bytes(spec)
    if budget.bytes_per_rank is None or memory is None or budget.bytes_per_rank <= memory[0]:
        return None
    what = budget.field if budget.field != "spec.engine.extraArgs" else \
        "--kv-cache-mb / --kv-cache-memory-bytes in spec.engine.extraArgs"
    return (budget.field,
            f"{_human(budget.bytes_per_rank)} of KV cache per rank is more than a rank has: {_human(memory[0])} "
            f"({memory[1]}); the server could not allocate it. Lower {what}, or use "
            "spec.engine.acceleratorMemoryUtilization to size the cache from the memory")


def host_tier_memory_error(spec: InferenceServiceSpec) -> tuple[str, str] | None:
    """(field, message) when the KV host tier (engine.kvOffload.hostMemory, or --kv-offload-host-mb in
    extraArgs) is more than the container's memory limit: the server could never hold it."""
    limit = _memory_limit(spec)
    offload = spec.engine.kv_offload
    size, field = (_bytes(offload.host_memory), "spec.engine.kvOffload.hostMemory") \
        if offload is not None and offload.host_memory is not None else (None, "")
    args = _extra_args(spec) if any(a.startswith("--kv-offload-host-mb") for a in spec.engine.extra_args or []) else None
    if args is not None and args.kv_offload_host_mb:
        size, field = args.kv_offload_host_mb << 20, "spec.engine.extraArgs"
    if limit is None or size is None or size <= limit:
        return None
    flag = " (--kv-offload-host-mb)" if field == "spec.engine.extraArgs" else ""
    return (field, f"a KV host tier of {_human(size)}{flag} is more than the container's memory limit "
                   f"(spec.resources.limits.memory, {_human(limit)}); lower it, or raise the limit by as much")


def _human(size: int) -> str:
    for unit, shift in (("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.4g} {unit}"
    return f"{size} bytes"


def kv_budget_error(spec: InferenceServiceSpec, shape: ModelShape | None) -> tuple[str, str] | None:
    """(field, message) when the budget certainly cannot hold one context of engine.maxModelLen (the operator's
    condition KVCacheTooSmall); None when it can, or without the model's shape or a maxModelLen to check."""
    eng = spec.engine
    if shape is None or shape.head_dim is None or eng.max_model_len is None:
        return None
    try:
        tp = parallel_sizes(spec).tensor
    except ValueError:
        return None
    budget = kv_budget(spec)
    if budget.bytes_per_rank is not None:
        per_rank = budget.bytes_per_rank
    elif budget.utilization is not None and budget.memory_bytes is not None:
        weights = (shape.weight_bytes or 0) // tp
        per_rank = budget_from_memory(budget.memory_bytes, budget.utilization, weights, HEADROOM_BYTES)
    else:
        return None
    why = shortfall(per_rank, eng.max_model_len, shape.layers, max(shape.kv_heads // tp, 1), shape.head_dim,
                    DTYPE_BYTES[eng.dtype], eng.kv_cache_dtype if eng.kv_cache_dtype != "fp8" else "auto",
                    eng.kv_block_size)
    if why is None:
        return None
    return ("spec.engine.maxModelLen",
            f"maxModelLen {eng.max_model_len} does not fit the KV cache once: {why} (from {budget.field}). Raise "
        "spec.engine.kvCacheMemory or spec.engine.acceleratorMemoryUtilization (or accelerator.memoryPerDevice, "
        "resources.limits.memory on CPU), set spec.engine.kvCacheDtype int8, or lower spec.engine.maxModelLen")
