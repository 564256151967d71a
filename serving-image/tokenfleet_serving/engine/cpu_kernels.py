"""Compiled CPU kernels, built on first use with the system C compiler and loaded through ctypes.

``csrc/cpu_kernels.c`` holds fp32 kernels:

* paged decode attention, which reads keys and values in place through the block tables, where the pure
  PyTorch path first gathers a copy of every sequence's blocks;
* RMSNorm fused with the residual add before it (one pass instead of torch's six small ops), the SwiGLU
  activation silu(gate) * up, the rotary embedding and the KV-cache write, each in one pass;
* the linear layers' matmul over weights packed once into 16-column panels (AVX2 + FMA builds only),
  which beats oneDNN on the few-row matmuls of decoding;
* prefill attention over the pool for every chunk of 2+ tokens of a step (AVX2 + FMA builds only);
* the linear layers' matmul over int8 weights with a per-output-channel scale (weight-only quantization,
  ``quantization.py``), computed in fp32: AVX2 + FMA tiles, and a portable loop for other builds;
* an int8 KV cache (``kv_quant.py``): the KV write quantizes (the same bits as ``kv_quant.quantize``), the
  decode attention widens int8 keys and values in registers and folds their scales into the scores and
  weights, the prefill attention widens them while it packs its key and value panels.

``huge_page_zeros`` allocates the KV pool in transparent huge pages, for the decode kernel's scattered reads.

The shared library is cached under ``$TOKENFLEET_KERNEL_CACHE`` (default ``~/.cache/tokenfleet/kernels``),
keyed by a hash of the source and the flags, so a source change rebuilds it, an image can ship it
prebuilt, and concurrent processes never see a half-written file. Without a compiler, or with
``TOKENFLEET_CPU_KERNELS=0``, the engine keeps the pure PyTorch path; tests hold the two to each other.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from . import cpu_features

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
log = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    if os.environ.get("TOKENFLEET_KERNEL_CACHE"):
        return Path(os.environ["TOKENFLEET_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenfleet" / "kernels"


def flags_for(avx2_fma: bool) -> list[str]:
    """The compile flags of one variant: generic x86-64 (or the host's architecture), or AVX2 + FMA."""
    flags = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp"]
    if avx2_fma:
        flags.append("-march=x86-64-v3")      # AVX2 + FMA; the hash keeps it apart from a generic build
    return flags


def compile_flags() -> list[str]:
    """The flags of the variant this host uses: AVX2 + FMA when it has them (as capped by TOKENFLEET_CPU_ISA).
    An AVX-512 host uses the same x86-64-v3 variant as an AVX2-only one."""
    return flags_for(cpu_features.has_avx2_fma())


def library_path(flags: list[str] | None = None) -> Path:
    """Where the library for this source and these flags (default: this host's) lives. The key leaves the
    compiler out, so an image can ship a prebuilt library without a compiler."""
    flags = compile_flags() if flags is None else flags
    key = hashlib.sha256(SOURCE.read_bytes() + b"\0" + " ".join(flags).encode()).hexdigest()[:16]
    return cache_dir() / f"tokenfleet-kernels-{key}.so"


def variants() -> list[list[str]]:
    """The flags of every variant a host of this architecture may look up."""
    return [flags_for(False), flags_for(True)] if platform.machine() == "x86_64" else [flags_for(False)]


def build(compiler: str | None = None, flags: list[str] | None = None) -> Path:
    """Compile the kernels (this host's variant, or the one ``flags`` name) unless they are built already;
    returns the library's path."""
    flags = compile_flags() if flags is None else flags
    target = library_path(flags)
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
            done = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                                  text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelUnavailable(f"C compiler {cc!r} does not run: {e}") from e
        if done.returncode != 0:
            raise KernelUnavailable(f"compiling {SOURCE.name} failed:\n{done.stderr[-2000:]}")
        os.chmod(tmp, 0o644)     # mkstemp's 0600 would hide a library an image builds as root from its user
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the kernels' C signatures on a loaded library."""
    lib.tf_paged_decode_attention.restype = ctypes.c_int
    lib.tf_paged_decode_attention.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64,
                                              _I64, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _PTR, _PTR]
    lib.tf_rms_norm.restype = None
    lib.tf_rms_norm.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _F32]
    lib.tf_gemm_available.restype = ctypes.c_int
    lib.tf_gemm_available.argtypes = []
    lib.tf_pack_weight.restype = None
    lib.tf_pack_weight.argtypes = [_PTR, _I64, _I64, _PTR]
    lib.tf_gemm.restype = ctypes.c_int
    lib.tf_gemm.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR]
    lib.tf_gemm_int8.restype = ctypes.c_int
    lib.tf_gemm_int8.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR]
    lib.tf_write_kv.restype = None
    lib.tf_write_kv.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64]
    lib.tf_write_kv_int8.restype = None
    lib.tf_write_kv_int8.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64]
    lib.tf_rope.restype = None
    lib.tf_rope.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR]
    lib.tf_silu_mul.restype = None
    lib.tf_silu_mul.argtypes = [_PTR, _I64, _I64, _PTR]
    lib.tf_prefill_attention.restype = ctypes.c_int
    lib.tf_prefill_attention.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                                         _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _PTR, _PTR, _PTR]
    lib.tf_decoder_layers.restype = ctypes.c_int
    lib.tf_decoder_layers.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR]
    lib.tf_comm_sum.restype = ctypes.c_int
    lib.tf_comm_sum.argtypes = [_PTR, _PTR, _PTR, _I64]
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library, or None (with one warning) when it cannot be built or is switched off."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        lib = None
        if os.environ.get("TOKENFLEET_CPU_KERNELS", "1") not in ("0", "false", "no"):
            try:
                torch.get_num_threads()            # torch (and its OpenMP runtime) first, so the kernels share it
                lib = bind(ctypes.CDLL(str(build())))
            except (KernelUnavailable, OSError, AttributeError) as e:
                log.warning("CPU kernels unavailable, using the PyTorch attention path: %s", e)
                lib = None
        _loaded["lib"] = lib
        return lib


_HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in a fresh anonymous mapping, 2 MB aligned and advised for transparent huge
    pages before its first touch (on Linux; elsewhere plain memory).

    The KV pool is read in scattered 4 KB blocks, one 4 KB page each, so with small pages the decode
    attention missed the TLB on every block (measured: 7.2 -> 8.5 GB/s over scattered blocks, 2 vCPUs). A
    fresh mapping is needed: a buffer from the heap may already be touched, and the advice then comes late.
    The tensor keeps the mapping alive; the zeros are written at once, so the memory is committed up front."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass                                  # a kernel without transparent huge pages
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    t = raw[start:start + nbytes].view(dtype).view(shape)
    t.zero_()
    return t


def _require(condition: bool, what: str) -> None:
    if not condition:      # the kernels trust their pointers and strides, so check before calling
        raise ValueError(f"CPU kernel needs {what}")


def _within(index: torch.Tensor, known: tuple[int, int] | None, limit: int) -> bool:
    """Whether every entry of ``index`` lies in [0, limit); ``known`` (smallest, largest), where the caller
    has it (``build_batch`` computes it once per step), saves two reductions."""
    if index.numel() == 0:
        return True
    low, high = known if known is not None else (int(index.min()), int(index.max()))
    return 0 <= low <= high < limit


def _cache_layers(k_layer: torch.Tensor, v_layer: torch.Tensor, k_scales: torch.Tensor | None,
                  v_scales: torch.Tensor | None) -> tuple[int | None, int | None]:
    """Check one layer's keys and values (fp32; or int8 with bf16 scales [kv_heads, blocks, block_size]) and
    return the scales' addresses (None for fp32)."""
    if k_scales is None and v_scales is None:
        _require(k_layer.dtype == v_layer.dtype == torch.float32, "fp32 cache layers")
        return None, None
    _require(k_scales is not None and v_scales is not None and k_layer.dtype == v_layer.dtype == torch.int8
             and k_scales.dtype == v_scales.dtype == torch.bfloat16 and k_scales.is_contiguous()
             and v_scales.is_contiguous() and k_scales.shape == v_scales.shape == k_layer.shape[:3],
             "int8 cache layers with contiguous bf16 scales, one per slot")
    assert k_scales is not None and v_scales is not None
    return k_scales.data_ptr(), v_scales.data_ptr()


def paged_decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                           tables: torch.Tensor, lens: torch.Tensor, max_len: int, out: torch.Tensor,
                           scale: float, k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None) -> None:
    """Write attention of ``q`` [seqs, heads, head_dim] (fp32, rows may be strided) into ``out``
    [seqs, heads * head_dim] over ``tables`` [seqs, width] and ``lens`` [seqs] (int64, contiguous;
    ``max_len`` >= every length). An int8 cache comes with its scales (``kv_quant.py``)."""
    seqs, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_layer.shape
    _require(q.dtype == out.dtype == torch.float32, "fp32 queries and output")
    ks, vs = _cache_layers(k_layer, v_layer, k_scales, v_scales)
    _require(q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(1) == 1, "contiguous query/output rows")
    _require(k_layer.is_contiguous() and v_layer.is_contiguous() and v_layer.shape == k_layer.shape,
             "contiguous cache layers of one shape")
    _require(tables.dtype == lens.dtype == torch.int64 and tables.is_contiguous() and lens.is_contiguous()
             and tables.shape[0] == lens.shape[0] == seqs and out.shape[0] >= seqs, "int64 tables and lens")
    rc = lib.tf_paged_decode_attention(
        q.data_ptr(), q.stride(0), k_layer.data_ptr(), v_layer.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), out.stride(0), seqs, heads, kv_heads, head_dim, num_blocks,
        block_size, scale, max_len, ks, vs)
    if rc != 0:
        raise MemoryError("paged decode attention could not allocate its score buffer")


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` [rows, dim] (fp32); with ``delta``, first ``x += delta`` in place."""
    rows, dim = x.shape
    _require(x.dtype == weight.dtype == torch.float32 and x.stride(1) == 1 and weight.is_contiguous()
             and weight.shape == (dim,), "fp32 rows and a weight of their width")
    _require(delta is None or (delta.shape == x.shape and delta.dtype == torch.float32 and delta.stride(1) == 1),
             "a delta shaped like x")
    out = torch.empty((rows, dim), dtype=x.dtype)
    lib.tf_rms_norm(x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
                    0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(), dim, rows, dim,
                    eps)
    return out

GEMM_PANEL = 16     # output columns per packed weight panel
PREFILL_SCRATCH_BYTES = 64 << 20     # packed keys and values per prefill-attention call (see prefill_attention)
_workspaces = threading.local()


def _workspace(floats: int) -> torch.Tensor:
    """A float buffer of at least ``floats`` elements, kept per thread and grown as needed: fresh multi-MB
    allocations per call cost a page fault per 4 KB (measured: several ms per W3 hit)."""
    buf = getattr(_workspaces, "buf", None)
    if buf is None or buf.numel() < floats:
        buf = _workspaces.buf = torch.empty(max(floats, 1 << 16), dtype=torch.float32)
    return buf


def gemm_packs(lib: ctypes.CDLL | None, weight: torch.Tensor) -> bool:
    """Whether ``weight`` [out, in] can go through the packed GEMM: fp32 on CPU, ``out`` a multiple of 16,
    and a library built with AVX2 + FMA."""
    return (lib is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.shape[0] % GEMM_PANEL == 0 and bool(lib.tf_gemm_available()))


def pack_weight(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] as panels [out / 16, in, 16] (torch's allocations are 64-byte aligned, which
    the kernel's aligned panel loads need)."""
    _require(gemm_packs(lib, weight), "an fp32 CPU weight with a multiple of 16 rows, and an AVX2 build")
    w = weight.contiguous()
    panels = torch.empty(w.shape[0] // GEMM_PANEL, w.shape[1], GEMM_PANEL, dtype=torch.float32)
    _require(panels.data_ptr() % 32 == 0, "32-byte aligned panels")
    lib.tf_pack_weight(w.data_ptr(), w.shape[0], w.shape[1], panels.data_ptr())
    return panels


def linear(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, in] (fp32, rows may be strided) times the packed weight: [rows, out], contiguous."""
    rows, k = x.shape
    n = panels.shape[0] * GEMM_PANEL
    _require(x.dtype == torch.float32 and panels.shape[1] == k, f"fp32 input rows of width {panels.shape[1]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    if rows:
        scratch = _workspace(rows * k)
        lib.tf_gemm(x.data_ptr(), x.stride(0), rows, k, panels.data_ptr(), n, y.data_ptr(), scratch.data_ptr())
    return y


def pack_weight_int8(weight: torch.Tensor) -> torch.Tensor:
    """An int8 ``weight`` [out, in] (out a multiple of 16) as panels [out / 16, in, 16], the fp32 layout."""
    _require(weight.dtype == torch.int8 and weight.dim() == 2 and weight.shape[0] % GEMM_PANEL == 0,
             "an int8 [out, in] weight with a multiple of 16 rows")
    out, k = weight.shape
    return weight.reshape(out // GEMM_PANEL, GEMM_PANEL, k).transpose(1, 2).contiguous()


def linear_int8(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, in] (fp32, rows may be strided) times an int8 weight packed by ``pack_weight_int8``, each
    output channel times its scale: [rows, out], contiguous."""
    rows, k = x.shape
    n = panels.shape[0] * GEMM_PANEL
    _require(x.dtype == torch.float32 and panels.dtype == torch.int8 and panels.is_contiguous()
             and panels.shape[1:] == (k, GEMM_PANEL), f"fp32 input rows of width {panels.shape[1]} and int8 panels")
    _require(scales.dtype == torch.float32 and scales.is_contiguous() and scales.shape == (n,), "fp32 scales")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    if rows:
        scratch = _workspace(rows * k)
        if lib.tf_gemm_int8(x.data_ptr(), x.stride(0), rows, k, panels.data_ptr(), scales.data_ptr(), n,
                            y.data_ptr(), scratch.data_ptr()) != 0:
            raise MemoryError("the int8 GEMM could not allocate its buffers")
    return y


def write_kv(lib: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_layer: torch.Tensor,
             v_layer: torch.Tensor, slot_range: tuple[int, int] | None = None) -> None:
    """Store ``k`` and ``v`` [rows, kv_heads, head_dim] (fp32; rows may be strided) at cache slots ``slots``
    [rows] of one layer's pool, ``k_layer`` / ``v_layer`` [kv_heads, blocks, block_size, head_dim].
    ``slot_range`` (smallest, largest slot), where the caller knows it, saves two reductions per call."""
    rows, kv_heads, head_dim = k.shape
    _require(k.dtype == v.dtype == k_layer.dtype == v_layer.dtype == torch.float32 and v.shape == k.shape
             and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == head_dim,
             "fp32 key/value rows of contiguous heads")
    _require(k_layer.is_contiguous() and v_layer.is_contiguous() and k_layer.shape == v_layer.shape
             and k_layer.shape[0] == kv_heads and k_layer.shape[3] == head_dim, "contiguous cache layers")
    per_head = k_layer.shape[1] * k_layer.shape[2]
    _require(slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (rows,)
             and _within(slots, slot_range, per_head), "int64 slots in the pool")
    lib.tf_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), rows,
                    k_layer.data_ptr(), v_layer.data_ptr(), kv_heads, per_head, head_dim)


def write_kv_int8(lib: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_layer: torch.Tensor,
                  v_layer: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor,
                  slot_range: tuple[int, int] | None = None) -> None:
    """``write_kv`` into an int8 cache layer: ``k`` / ``v`` quantized per token and KV head (the bits of
    ``kv_quant.quantize``), their scales into ``k_scales`` / ``v_scales`` [kv_heads, blocks, block_size]."""
    rows, kv_heads, head_dim = k.shape
    _require(k.dtype == v.dtype == torch.float32 and v.shape == k.shape
             and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == head_dim,
             "fp32 key/value rows of contiguous heads")
    _require(k_layer.is_contiguous() and v_layer.is_contiguous() and k_layer.shape == v_layer.shape
             and k_layer.shape[0] == kv_heads and k_layer.shape[3] == head_dim, "contiguous cache layers")
    ks, vs = _cache_layers(k_layer, v_layer, k_scales, v_scales)
    _require(ks is not None, "an int8 cache")
    per_head = k_layer.shape[1] * k_layer.shape[2]
    _require(slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (rows,)
             and _within(slots, slot_range, per_head), "int64 slots in the pool")
    lib.tf_write_kv_int8(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), rows,
                         k_layer.data_ptr(), v_layer.data_ptr(), ks, vs, kv_heads, per_head, head_dim)


def rope_(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
          position_range: tuple[int, int] | None = None) -> None:
    """Rotate ``x`` [rows, heads, head_dim] (fp32; rows may be strided, heads contiguous) in place by the
    rows of the ``cos`` / ``sin`` tables [max_positions, head_dim] that ``positions`` [rows] pick.
    ``position_range`` (smallest, largest position), where the caller knows it, saves two reductions."""
    rows, heads, head_dim = x.shape
    _require(x.dtype == cos.dtype == sin.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == head_dim
             and cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape and cos.shape[1] == head_dim,
             "fp32 rows of contiguous heads and cos/sin tables of their width")
    _require(positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape == (rows,)
             and _within(positions, position_range, cos.shape[0]),
             "int64 positions within the tables")
    lib.tf_rope(x.data_ptr(), rows, x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                positions.data_ptr())


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the fused gate/up output [rows, 2 * inter] (fp32, contiguous): silu(gate) * up, [rows, inter]."""
    rows, width = gate_up.shape
    _require(gate_up.dtype == torch.float32 and gate_up.is_contiguous() and width % 2 == 0,
             "a contiguous fp32 [rows, 2 * inter] input")
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    lib.tf_silu_mul(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
    return out


def prefill_attends(lib: ctypes.CDLL | None, head_dim: int) -> bool:
    """Whether prefill chunks can go through the compiled attention (AVX2 build, head_dim a multiple of 16)."""
    return lib is not None and head_dim % GEMM_PANEL == 0 and bool(lib.tf_gemm_available())


def prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                      tables: torch.Tensor, q_rows: torch.Tensor, n_q: torch.Tensor, starts: torch.Tensor,
                      out: torch.Tensor, scale: float, ends: list[int] | None = None,
                      k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> None:
    """Write into ``out`` [rows, heads * head_dim] the attention of prefill chunks: chunk s is ``n_q[s]``
    query rows of ``q`` [rows, heads, head_dim] from row ``q_rows[s]``, at positions ``starts[s]``.., each
    attending its sequence's keys up to its own position through ``tables[s]`` (keys already in the pool).
    ``ends`` (``starts + n_q`` as ints), where the caller has it, saves a tensor op per call. An int8 cache
    comes with its scales (``kv_quant.py``)."""
    rows, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_layer.shape
    _require(prefill_attends(lib, head_dim), "an AVX2 build and head_dim a multiple of 16")
    _require(q.dtype == out.dtype == torch.float32, "fp32 queries and output")
    ks, vs = _cache_layers(k_layer, v_layer, k_scales, v_scales)
    _require(q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(1) == 1, "contiguous query/output rows")
    _require(k_layer.is_contiguous() and v_layer.is_contiguous() and v_layer.shape == k_layer.shape,
             "contiguous cache layers of one shape")
    seqs = n_q.shape[0]
    _require(all(t.dtype == torch.int64 and t.is_contiguous() and t.shape[0] == seqs
                 for t in (tables, q_rows, n_q, starts)), "int64 tables, rows, lengths and starts")
    ends = (starts + n_q).tolist() if ends is None else ends
    run_ends, floats = prefill_runs(ends, kv_heads, head_dim)
    scratch = _workspace(floats)
    first = 0
    for last in run_ends:
        at = lambda t, first=first: t.data_ptr() + first * t.stride(0) * t.element_size()
        rc = lib.tf_prefill_attention(
            q.data_ptr(), q.stride(0), k_layer.data_ptr(), v_layer.data_ptr(), at(tables), tables.shape[1],
            at(q_rows), at(n_q), at(starts), last - first, out.data_ptr(), out.stride(0), heads, kv_heads,
            head_dim, num_blocks, block_size, scale, scratch.data_ptr(), ks, vs)
        if rc != 0:
            raise MemoryError("prefill attention could not allocate its buffers")
        first = last


def prefill_runs(ends: list[int], kv_heads: int, head_dim: int) -> tuple[list[int], int]:
    """How prefill chunks whose sequences end at ``ends`` go through the kernel: in runs (the end index of
    each) and with how many floats of scratch. The kernel may pack a chunk's keys and values once (a
    layer's worth of its sequence's cache) for the chunk's work items to share, so the chunks of one run
    are those whose packed copies stay under PREFILL_SCRATCH_BYTES together (a longer one runs alone)."""
    floats = [2 * kv_heads * head_dim * -(-end // GEMM_PANEL) * GEMM_PANEL for end in ends]
    run_ends, most, first = [], 0, 0
    while first < len(ends):
        last, total = first + 1, floats[first]
        while last < len(ends) and (total + floats[last]) * 4 <= PREFILL_SCRATCH_BYTES:
            total += floats[last]
            last += 1
        run_ends.append(last)
        most, first = max(most, total), last
    return run_ends, most


# ---- the decoder layers in one call (tf_decoder_layers) ------------------------------------------------------
def _fields(kind, names: str) -> list[tuple[str, type]]:
    return [(name, kind) for name in names.split()]


class _Layer(ctypes.Structure):        # struct tf_layer in the C file, field for field (and so on below)
    _fields_ = _fields(_PTR, "ln1 ln2 qkv qkv_bias o o_bias gate_up gate_up_bias down down_bias k_cache v_cache "
                             "qkv_scale o_scale gate_up_scale down_scale k_scales v_scales")


class _Buffers(ctypes.Structure):
    _fields_ = _fields(_PTR, "h qkv attn gemm delta gate_up act attn_scratch")


class _Chunks(ctypes.Structure):
    _fields_ = _fields(_I64, "count table_width runs") + _fields(_PTR, "tables q_rows n_q starts run_ends")


class _Step(ctypes.Structure):
    _fields_ = (_fields(_I64, "rows decodes decode_width decode_max_len keep")
                + _fields(_PTR, "positions slots decode_tables decode_lens keep_rows")
                + [("prefill", _Chunks), ("sampled", _Chunks)])


class Comm(ctypes.Structure):
    """struct tf_comm: a rank's view of a shared-memory channel (``shm_channel.py`` fills it in)."""
    _fields_ = (_fields(_I64, "rank size slot_bytes") + _fields(_PTR, "header slots round pids")
                + [("timeout_s", ctypes.c_double), ("seconds", ctypes.c_double), ("failed_rank", _I64)])


COMM_PEER_EXITED, COMM_PEER_LATE = -3, -4      # tf_comm_sum's and tf_decoder_layers' failed waits


class CommFailure(RuntimeError):
    """A sum across ranks inside a kernel failed: ``code`` (COMM_PEER_EXITED or COMM_PEER_LATE) for
    ``comm.failed_rank``."""

    def __init__(self, code: int, rank: int):
        super().__init__(f"sum across ranks failed ({code}) waiting for rank {rank}")
        self.code, self.rank = code, rank


def comm_sum_(lib: ctypes.CDLL, comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` (contiguous fp32, CPU) over the channel's ranks, in place."""
    _require(x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu", "contiguous fp32 CPU rows")
    rc = lib.tf_comm_sum(ctypes.byref(comm), x.data_ptr(), x.data_ptr(), x.numel())
    if rc:
        raise CommFailure(rc, comm.failed_rank)
    return x


class _Shape(ctypes.Structure):
    _fields_ = (_fields(_I64, "hidden heads kv_heads head_dim inter num_blocks block_size piece")
                + _fields(_F32, "eps scale") + _fields(_PTR, "cos sin"))


def _chunks(c, kv_heads: int, head_dim: int) -> tuple[_Chunks, int, object]:
    """A batch's PrefillChunks (or None) as the C struct, its scratch floats, and what must outlive the call."""
    if c is None:
        return _Chunks(), 0, None
    ok = all(t.dtype == torch.int64 and t.is_contiguous() and t.shape[0] == len(c.ends)
             for t in (c.tables, c.q_rows, c.n_q, c.starts))
    _require(ok, "int64 chunk tables, rows, lengths and starts")
    run_ends, floats = prefill_runs(c.ends, kv_heads, head_dim)
    runs = torch.tensor(run_ends, dtype=torch.int64)
    return _Chunks(len(c.ends), c.tables.shape[1], len(run_ends), c.tables.data_ptr(), c.q_rows.data_ptr(),
                   c.n_q.data_ptr(), c.starts.data_ptr(), runs.data_ptr()), floats, runs


class DecoderLayers:
    """A model's decoder layers run as one kernel call per step: the same kernels, in the same order and
    with the same arguments, as the model's Python layer loop (so the same bits), without the interpreter
    between them. Needs packed weights (``pack_weight``) for every linear, an AVX2 build, and a head_dim
    the prefill attention takes (``prefill_attends``).

    ``layers``: per layer a dict of ``ln1``, ``ln2`` (norm weights), ``qkv``, ``o``, ``gate_up``, ``down``
    (packed panels) and ``qkv_bias``, ``o_bias``, ``gate_up_bias``, ``down_bias`` (or None); ``kv_layers``: per layer its
    [2, kv_heads, blocks, block_size, head_dim] slice of the pool (fp32, or an int8 ``kv_quant.QuantizedKV``);
    ``cos`` / ``sin`` as ``rope_`` takes them.
    Int8 weights (``pack_weight_int8``) come with their scales as ``qkv_scale``, ... (absent or None: fp32).

    Tensor parallelism: ``heads`` and the weights are this rank's, and ``comm`` (this rank's shared-memory
    channel) sums the ``o`` and ``down`` outputs across the ranks before their biases (``o_bias``,
    ``down_bias``: the row-parallel layers' biases, added once after the sum), as the layer loop does; a
    failed wait raises ``CommFailure``."""

    def __init__(self, lib: ctypes.CDLL, layers: list[dict], kv_layers: list, cos: torch.Tensor,
                 sin: torch.Tensor, heads: int, eps: float, scale: float, piece: int, comm: Comm | None = None):
        from .kv_quant import QuantizedKV
        scales = [kv.scales if isinstance(kv, QuantizedKV) else None for kv in kv_layers]
        kv_layers = [kv.data if isinstance(kv, QuantizedKV) else kv for kv in kv_layers]
        _require(prefill_attends(lib, kv_layers[0].shape[-1]), "an AVX2 build and head_dim a multiple of 16")
        _, kv_heads, num_blocks, block_size, head_dim = kv_layers[0].shape
        hidden, inter = layers[0]["ln1"].shape[0], layers[0]["down"].shape[1]
        widths = {"qkv": (hidden, (heads + 2 * kv_heads) * head_dim), "o": (heads * head_dim, hidden),
                  "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}
        for layer, kv in zip(layers, kv_layers):
            for name, (k, n) in widths.items():
                w, bias, w_scale = layer[name], layer.get(name + "_bias"), layer.get(name + "_scale")
                _require(w.dtype == (torch.float32 if w_scale is None else torch.int8) and w.is_contiguous()
                         and w.shape == (n // GEMM_PANEL, k, GEMM_PANEL)
                         and (bias is None or (bias.shape == (n,) and bias.is_contiguous()))
                         and (w_scale is None or (w_scale.shape == (n,) and w_scale.dtype == torch.float32
                                                  and w_scale.is_contiguous())), f"packed {name} panels")
            _require(kv.is_contiguous() and kv.shape == kv_layers[0].shape and kv.dtype == kv_layers[0].dtype,
                     "contiguous cache layers of one shape")
        for kv, sc in zip(kv_layers, scales):
            _cache_layers(kv[0], kv[1], None if sc is None else sc[0], None if sc is None else sc[1])
        _require(cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape and cos.shape[1] == head_dim,
                 "cos/sin tables of head_dim width")
        ptr = lambda t: None if t is None else t.data_ptr()
        self.lib, self.cos_rows, self.slots_per_head = lib, cos.shape[0], num_blocks * block_size
        self.kept = (layers, kv_layers, scales, cos, sin)   # the structs point into these
        self.comm = comm
        self.layers = (_Layer * len(layers))(*[
            _Layer(*[ptr(layer.get(f)) for f in ("ln1", "ln2", "qkv", "qkv_bias", "o", "o_bias", "gate_up",
                                                  "gate_up_bias", "down", "down_bias")], kv[0].data_ptr(), kv[1].data_ptr(),
                   *[ptr(layer.get(f)) for f in ("qkv_scale", "o_scale", "gate_up_scale", "down_scale")],
                   *((None, None) if sc is None else (sc[0].data_ptr(), sc[1].data_ptr())))
            for layer, kv, sc in zip(layers, kv_layers, scales)])
        self.shape = _Shape(hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size, piece, eps, scale,
                            cos.data_ptr(), sin.data_ptr())

    def __call__(self, x: torch.Tensor, batch, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run every layer over ``x`` [rows, hidden] (the embedded tokens, updated in place) for ``batch``
        (a StepBatch with the compiled prefill and at most its one decode group). With ``keep_rows``
        (increasing), the last layer finishes only those rows: returns them, else all of ``x``."""
        sh = self.shape
        rows = x.shape[0]
        _require(x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == sh.hidden, "contiguous fp32 rows")
        _require(not batch.long_spans and all(g.q_len == 1 for g in batch.groups), "decodes and prefill chunks only")
        _require(all(t.dtype == torch.int64 and t.is_contiguous() and t.shape == (rows,)
                     for t in (batch.positions, batch.slots)), "int64 positions and slots, one per row")
        _require(_within(batch.positions, batch.position_range, self.cos_rows)
                 and _within(batch.slots, batch.slot_range, self.slots_per_head),
                 "positions within the rope tables and slots in the pool")
        step = _Step(rows=rows, keep=rows, positions=batch.positions.data_ptr(), slots=batch.slots.data_ptr())
        if batch.groups:
            g = batch.groups[0]
            _require(g.block_ids.dtype == g.context_lens.dtype == torch.int64 and g.context_lens.is_contiguous()
                     and g.context_lens.shape == (g.num_seqs,) and g.block_ids.numel() % max(g.num_seqs, 1) == 0,
                     "int64 decode tables and lengths")
            step.decodes, step.decode_max_len = g.num_seqs, g.max_context
            step.decode_width = g.block_ids.numel() // max(g.num_seqs, 1)
            step.decode_tables, step.decode_lens = g.block_ids.data_ptr(), g.context_lens.data_ptr()
        step.prefill, floats, runs = _chunks(batch.prefill, sh.kv_heads, sh.head_dim)
        if keep_rows is not None:
            _require(keep_rows.dtype == torch.int64 and keep_rows.is_contiguous() and keep_rows.shape[0] <= rows
                     and (keep_rows.shape[0] == 0 or (int(keep_rows[0]) >= 0 and int(keep_rows[-1]) < rows
                                                      and bool((keep_rows[1:] > keep_rows[:-1]).all()))),
                     "increasing int64 rows to keep, within the batch")     # the kernel moves rows forward
            step.sampled, sampled_floats, sampled_runs = _chunks(batch.prefill_sampled, sh.kv_heads, sh.head_dim)
            step.keep, step.keep_rows, floats = keep_rows.shape[0], keep_rows.data_ptr(), max(floats, sampled_floats)
        piece = min(rows, sh.piece)
        q_width = sh.heads * sh.head_dim
        sizes = [rows * sh.hidden, rows * (q_width + 2 * sh.kv_heads * sh.head_dim), rows * q_width,
                 max(rows * max(sh.hidden, q_width), piece * sh.inter), piece * sh.hidden, piece * 2 * sh.inter,
                 piece * sh.inter, floats]
        sizes = [-(-n // 16) * 16 for n in sizes]          # 64-byte aligned parts (the panels' aligned loads)
        space, parts, at = _workspace(sum(sizes)), [], 0
        for n in sizes:
            parts.append(space.data_ptr() + 4 * at)
            at += n
        # (runs, sampled_runs: the run tables the structs point to, alive until the call returns)
        rc = self.lib.tf_decoder_layers(ctypes.byref(sh), self.layers, len(self.layers), ctypes.byref(step),
                                        x.data_ptr(), ctypes.byref(_Buffers(*parts)),
                                        None if self.comm is None else ctypes.byref(self.comm))
        if rc in (COMM_PEER_EXITED, COMM_PEER_LATE):
            assert self.comm is not None
            raise CommFailure(rc, self.comm.failed_rank)
        if rc != 0:
            raise MemoryError("the decoder layers could not allocate their buffers")
        return x[:step.keep]


if __name__ == "__main__":
    # python -m tokenfleet_serving.engine.cpu_kernels [--all-variants]: prebuild this host's variant, or
    # every variant (images: built on one host, run on AVX2-only and AVX-512 hosts alike)
    import sys
    for path in ([build(flags=f) for f in variants()] if "--all-variants" in sys.argv[1:] else [build()]):
        print(path)
