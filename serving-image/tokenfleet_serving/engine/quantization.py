"""Weight-only int8 quantization: the decoder's linear weights in int8, quantized at load.

Each output channel (row) n of a weight W [out, in] gets one fp32 scale, symmetric around zero:
``scale[n] = max_i |W[n, i]| / 127`` and ``Q[n, i] = round(W[n, i] / scale[n])`` in [-127, 127], so
``W ~ scale * Q``. The source is the checkpoint as stored (bf16, fp16 or fp32), widened to fp32 first. The
q/k/v, o, gate/up and down projections of every layer and the lm_head are quantized; the embedding and the
norms keep the compute dtype. The lm_head is read whole at every step, so kept wide it would be a third of the
bytes an int8 decoding step reads (the reference model: 16.8 of 40 MB); quantizing it too changed the quality
measures of ``bench levers`` by less than their run-to-run spread (mean KL 8.2e-5 -> 8.8e-5, the same greedy
near-tie disagreements), measured on the reference model. A tied lm_head gets its own int8 copy of the
embedding.

Activations stay in the compute dtype; a linear computes ``(x Q^T) * scale``:

* CPU, fp32, compiled kernels (``cpu_kernels.linear_int8``): the int8 panels are read and widened in
  registers (AVX2 + FMA builds) or by a portable loop; a row's result is bitwise the same in any batch;
* CPU, bf16/fp16, up to ``SMALL_ROWS`` rows: torch's ``_weight_int8pack_mm`` (in-features a multiple of 32:
  it returns garbage or crashes for others, seen with torch 2.15);
* elsewhere (CUDA, bigger bf16 batches, no kernels): plain PyTorch, ``F.linear(x, Q.to(dtype)) * scale``,
  which widens the weight on every call (correct everywhere, fast nowhere; not run on a GPU here).

Which compute dtype is faster with int8 weights (fp32 through the kernels, or bf16) is measured on the host
by ``dtype_choice`` (``dtype: auto``), as it is without quantization.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from ..contract.levers import QuantizationError, parse_quantization  # noqa: F401  (re-exported)
from . import cpu_kernels

SMALL_ROWS = 16


def quantize_int8(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(Q int8 [out, in], scale fp32 [out]) with ``weight ~ Q * scale[:, None]``, per output channel."""
    if not weight.is_floating_point() or weight.dim() != 2:
        raise QuantizationError(f"{name}: int8 quantization takes a 2-d float weight, got {weight.dtype} "
                                f"{tuple(weight.shape)}")
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    top = w.abs().amax(dim=1)
    if not bool(torch.isfinite(top).all()):
        raise QuantizationError(f"{name}: the weight holds inf or NaN values, which int8 cannot represent")
    scale = torch.where(top > 0, top / 127.0, torch.ones_like(top))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


class Int8Linear:
    """``y = x (scale * Q)^T + b`` for a weight quantized here at load; called like ``model.Linear``.

    With the compiled kernels (fp32 on CPU) the weight lives only as int8 panels (``panels``, out padded to a
    multiple of 16 with zero rows) and ``scales``, the form ``DecoderLayers`` takes; otherwise as ``q``
    [out, in] int8 on the device and ``scales`` in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: ctypes.CDLL | None,
                 dtype: torch.dtype, device: torch.device, name: str = "weight",
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``quantized``: ``weight`` already quantized, (int8 [out, in], scale [out]) (then ``weight`` is unused)."""
        q, scale = quantized if quantized is not None else quantize_int8(weight, name)
        self.out_features, self.in_features = q.shape
        self.bias = bias
        self.kernels = kernels if device.type == "cpu" and dtype == torch.float32 else None
        self.panels: torch.Tensor | None = None
        self.q: torch.Tensor | None = None
        self.padded = False
        if self.kernels is not None:
            pad = -self.out_features % cpu_kernels.GEMM_PANEL
            self.padded = pad > 0                      # (DecoderLayers takes unpadded panels only)
            if pad:
                q = torch.cat([q, torch.zeros(pad, self.in_features, dtype=torch.int8)])
                scale = torch.cat([scale, torch.ones(pad)])
            self.panels, self.scales = cpu_kernels.pack_weight_int8(q), scale
        else:
            self.q, self.scales = q.to(device), scale.to(device=device, dtype=dtype)
        self.packs_int8_mm = (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
                              and self.in_features % 32 == 0 and hasattr(torch, "_weight_int8pack_mm"))

    @property
    def weight_bytes(self) -> int:
        kept = [t for t in (self.panels, self.q, self.scales, self.bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in kept)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            assert self.kernels is not None
            y = cpu_kernels.linear_int8(self.kernels, x, self.panels, self.scales)
            if y.shape[1] != self.out_features:
                y = y[:, :self.out_features].contiguous()
            return y if self.bias is None else y.add_(self.bias)
        assert self.q is not None
        if self.packs_int8_mm and x.shape[0] <= SMALL_ROWS:
            y = torch._weight_int8pack_mm(x.contiguous(), self.q, self.scales)
        else:
            y = F.linear(x, self.q.to(x.dtype)).mul_(self.scales)
        return y if self.bias is None else y.add_(self.bias)
