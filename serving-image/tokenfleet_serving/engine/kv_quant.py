"""An int8 KV cache (``kv_cache_dtype="int8"``, ``--kv-cache-dtype int8``): keys and values in int8, one scale per
token and KV head.

Each key (or value) vector x of one token and one KV head, head_dim elements, is stored as

    scale = bf16(max_i |x_i| / 127)           (rounded to nearest even; 0 for a zero vector)
    q_i   = clamp(round(x_i / scale), -127, 127)   (round half to even)

and read back as ``q_i * scale``. A token's scale depends only on that token, so a block is written a token at a
time (decoding appends into a partly filled block) and never re-quantized, and a prefix-cache hit reads exactly
the bits a fresh computation would write. The scale is kept in bfloat16 (fp32's range, two bytes): quantizing
against the rounded scale makes its rounding cost nothing but the clamp of an element at most 0.4 % over 127.
One token and KV head then take head_dim + 2 bytes instead of 2 * head_dim (bf16) or 4 * head_dim (fp32): with
head_dim 64, 1.94x and 3.8x the tokens in the same budget. The error of an element is at most half a step,
``scale / 2`` = ``max|x| / 254`` (plus the clamp above).

The pool of one layer is a :class:`QuantizedKV`: ``data`` int8 [2, kv_heads, blocks, block_size, head_dim] (the
layout of a model-dtype pool) and ``scales`` bf16 [2, kv_heads, blocks, block_size]. Every attention path reads
it: the PyTorch path dequantizes the blocks it gathers; the compiled C kernels (``cpu_kernels.py``) quantize on
the KV write (bit for bit as :func:`quantize` does) and widen int8 in registers in the decode attention and while
packing keys and values in the prefill attention. Attention always sees the dequantized values, on every path:
a chunk with nothing cached before it, which SDPA computes from the step's own keys, takes them through
:func:`round_trip` first, so a prompt gives the same logits whichever path ran it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

SCALE_DTYPE = torch.bfloat16
QMAX = 127


class QuantizedKV(NamedTuple):
    """One layer's int8 pool: ``data`` [2, kv_heads, blocks, block_size, head_dim] int8, ``scales``
    [2, kv_heads, blocks, block_size] bfloat16 (keys at index 0, values at 1)."""
    data: torch.Tensor
    scales: torch.Tensor


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, bf16 scales) of ``x`` [..., head_dim], one scale per vector along the last dimension."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / QMAX).to(SCALE_DTYPE)
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(xf / s.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` [..., head_dim] int8 times ``scale`` [...]: the stored values in ``dtype``. In bf16 and fp32 the
    product is formed in ``dtype`` directly (|q| <= 127 and the scale are exact there, and the product rounds
    once either way: the same values as through fp32, without an fp32 copy); fp16 goes through fp32 (a bf16
    scale need not fit fp16)."""
    if dtype in (torch.bfloat16, torch.float32):
        return q.to(dtype) * scale.to(dtype).unsqueeze(-1)
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """What the int8 cache gives back for ``x`` (in x's dtype)."""
    q, s = quantize(x)
    return dequantize(q, s, x.dtype)


def allocate(num_layers: int, kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
             device: torch.device, zeros) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole int8 pool: (data [layers, 2, kv_heads, blocks, block_size, head_dim] int8, scales [layers, 2,
    kv_heads, blocks, block_size] bf16); ``zeros(shape, dtype)`` allocates on CPU (huge pages)."""
    shape = (num_layers, 2, kv_heads, num_blocks, block_size, head_dim)
    if device.type == "cpu":
        return zeros(shape, torch.int8), zeros(shape[:-1], SCALE_DTYPE)
    return (torch.zeros(shape, dtype=torch.int8, device=device),
            torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device))
