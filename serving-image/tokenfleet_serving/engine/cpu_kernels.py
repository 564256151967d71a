"""Compiled CPU kernels, built on first use with the system C compiler and loaded through ctypes.

The one kernel so far is paged decode attention (``csrc/paged_attention.c``): it reads keys and values in
place through the block tables, where the pure PyTorch path first gathers a copy of every sequence's
blocks. The shared library is cached under ``$TOKENFLEET_KERNEL_CACHE`` (default
``~/.cache/tokenfleet/kernels``), keyed by a hash of the source and the flags, so a source change
rebuilds it, an image can ship it prebuilt, and concurrent processes never see a half-written file. Without a compiler, or with
``TOKENFLEET_CPU_KERNELS=0``, the engine keeps the pure PyTorch path; tests hold the two to each other.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
log = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    if os.environ.get("TOKENFLEET_KERNEL_CACHE"):
        return Path(os.environ["TOKENFLEET_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenfleet" / "kernels"


def compile_flags() -> list[str]:
    flags = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp"]
    try:
        cpu = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpu = ""
    if platform.machine() == "x86_64" and " avx2" in cpu and " fma" in cpu:
        flags.append("-march=x86-64-v3")      # AVX2 + FMA; the hash keeps it apart from a generic build
    return flags


def library_path() -> Path:
    """Where the library for this source and these flags lives (the key leaves the compiler out, so an
    image can ship a prebuilt library without a compiler)."""
    key = hashlib.sha256(SOURCE.read_bytes() + b"\0" + " ".join(compile_flags()).encode()).hexdigest()[:16]
    return cache_dir() / f"tokenfleet-kernels-{key}.so"


def build(compiler: str | None = None) -> Path:
    """Compile the kernels unless this source and flags are built already; returns the library's path."""
    target = library_path()
    if target.exists():
        return target
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable("no C compiler found (set CC, or install gcc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run([cc, *compile_flags(), str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                                  text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelUnavailable(f"C compiler {cc!r} does not run: {e}") from e
        if done.returncode != 0:
            raise KernelUnavailable(f"compiling {SOURCE.name} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def load() -> ctypes.CDLL | None:
    """The kernel library, or None (with one warning) when it cannot be built or is switched off."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        lib = None
        if os.environ.get("TOKENFLEET_CPU_KERNELS", "1") not in ("0", "false", "no"):
            try:
                torch.get_num_threads()            # torch (and its OpenMP runtime) first, so the kernels share it
                lib = ctypes.CDLL(str(build()))
                fn = lib.tf_paged_decode_attention
                fn.restype = ctypes.c_int
                fn.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
                               _I64, _I64, ctypes.c_float, _I64]
            except (KernelUnavailable, OSError, AttributeError) as e:
                log.warning("CPU kernels unavailable, using the PyTorch attention path: %s", e)
                lib = None
        _loaded["lib"] = lib
        return lib


def paged_decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                           tables: torch.Tensor, lens: torch.Tensor, max_len: int, out: torch.Tensor,
                           scale: float) -> None:
    """Write attention of ``q`` [seqs, heads, head_dim] (fp32, rows may be strided) into ``out``
    [seqs, heads * head_dim] over ``tables`` [seqs, width] and ``lens`` [seqs] (int64, contiguous)."""
    seqs, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_layer.shape
    assert q.dtype == out.dtype == k_layer.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == head_dim
    assert out.stride(1) == 1 and k_layer.is_contiguous() and v_layer.is_contiguous()
    assert tables.dtype == lens.dtype == torch.int64 and tables.is_contiguous() and lens.is_contiguous()
    rc = lib.tf_paged_decode_attention(
        q.data_ptr(), q.stride(0), k_layer.data_ptr(), v_layer.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), out.stride(0), seqs, heads, kv_heads, head_dim, num_blocks,
        block_size, scale, max_len)
    if rc != 0:
        raise MemoryError("paged decode attention could not allocate its score buffer")


if __name__ == "__main__":          # python -m tokenfleet_serving.engine.cpu_kernels: prebuild (images)
    print(build())
