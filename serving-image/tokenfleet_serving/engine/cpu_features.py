"""What the CPU offers the engine: its model name and instruction-set flags, optionally capped.

The hosts behind one machine kind differ (AVX2-only and AVX-512 with native bf16 EPYCs both occur), and
the engine makes choices by what it finds: the compile flags of its C kernels and the dtypes ``auto`` tries.
``TOKENFLEET_CPU_ISA`` caps what it finds, so one host can run every path:

* ``native`` (the default): the flags as /proc/cpuinfo lists them;
* ``avx2``: no AVX-512 and no AMX (an AVX2-only EPYC as the engine sees it);
* ``baseline``: not even AVX2/FMA (the portable C loops).

torch picks its own kernels by the CPU too. ``torch_env`` gives the variables that cap torch the same way
(``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, and ``MKL_ENABLE_INSTRUCTIONS`` for the oneMKL GEMMs that
fp32 linear layers run on); they work only if set before torch is first used, so
``tokenfleet`` sets them at start-up and ``hack/test.sh`` exports them for the test processes.

This module imports no torch.
"""
from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

ENV = "TOKENFLEET_CPU_ISA"
CAPS = ("native", "avx2", "baseline")
# Flag prefixes removed under each cap: everything above the level it names.
_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni", "avx10")
_ABOVE_BASELINE = _ABOVE_AVX2 + ("avx2", "fma", "f16c", "bmi2")
_DROPPED = {"native": (), "avx2": _ABOVE_AVX2, "baseline": _ABOVE_BASELINE}
# What torch is told under each cap: ATen's kernels, oneDNN's and oneMKL's (None: leave torch to its own detection).
_TORCH = {"native": None, "avx2": ("AVX2", "AVX2", "AVX2"), "baseline": ("DEFAULT", "SSE41", "SSE4_2")}


class CpuIsaError(ValueError):
    pass


def isa_cap() -> str:
    cap = os.environ.get(ENV, "native").strip().lower() or "native"
    if cap not in CAPS:
        raise CpuIsaError(f"{ENV} must be one of {', '.join(CAPS)}, got {cap!r}")
    return cap


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo."""
    model, flags = "", frozenset[str]()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = frozenset(value.split())
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def host_flags() -> frozenset[str]:
    """The flags the CPU really has, whatever the cap."""
    return _cpuinfo()[1]


def cpu_flags() -> frozenset[str]:
    """The flags the engine may use: the host's, less what ``TOKENFLEET_CPU_ISA`` caps away."""
    dropped = _DROPPED[isa_cap()]
    return frozenset(f for f in host_flags() if not f.startswith(dropped))


def has_avx2_fma() -> bool:
    return platform.machine() == "x86_64" and {"avx2", "fma"} <= cpu_flags()


def has_native_bf16() -> bool:
    """bf16 dot-product units (AVX-512 BF16 or AMX): where bf16 matmuls can beat fp32 on a CPU."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def isa_level() -> str:
    """A short name for what the engine sees: avx512_bf16, avx512, avx2 or baseline."""
    flags = cpu_flags()
    if has_native_bf16():
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if has_avx2_fma() else "baseline"


def torch_env() -> dict[str, str]:
    """The variables that cap torch's own kernel choice like the engine's (empty for ``native``)."""
    caps = _TORCH[isa_cap()]
    if caps is None:
        return {}
    aten, onednn, mkl = caps
    return {"ATEN_CPU_CAPABILITY": aten.lower(), "ONEDNN_MAX_CPU_ISA": onednn, "MKL_ENABLE_INSTRUCTIONS": mkl}


def apply_torch_env() -> None:
    """Set ``torch_env()`` in this process (before torch loads), leaving variables already set alone."""
    for key, value in torch_env().items():
        os.environ.setdefault(key, value)


def describe() -> dict[str, object]:
    """The CPU as benchmarks report it."""
    return {"cpu": cpu_model(), "isa": isa_level(), "isa_cap": isa_cap(),
            "host_has_avx512_bf16": "avx512_bf16" in host_flags()}
