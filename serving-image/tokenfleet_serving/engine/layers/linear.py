"""Linear layers: the local matmul (``Linear``: packed compiled GEMM, oneDNN or ``F.linear``; or ``Int8Linear``
from ``quantization.py``), and the two tensor-parallel forms built on it:

* ``ColumnParallelLinear``: each rank holds some output rows of one or more fused weights (Q/K/V, gate/up) and
  returns its share of the outputs, no communication;
* ``RowParallelLinear``: each rank holds some input columns and multiplies its share of the inputs; the partial
  sums are added across ranks (an all-reduce), then the bias.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_kernels
from ..quantization import Int8Linear, quantize_int8
from .parallel import SingleRank


def onednn_packs(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    """``y = x W^T + b``, by the fastest path this device has:

    * the compiled kernels' GEMM over a weight packed once into 16-column panels (fp32 on an AVX2 CPU, out
      features a multiple of 16): 1.2-2x oneDNN on the few-row matmuls of decoding and as fast at
      thousands of rows (measured in docs/engine.md);
    * otherwise, for fp32 on CPU, oneDNN with the weight reordered once into its blocked layout: 1.5-2x the
      default BLAS call on those matmuls. oneDNN compiles and keeps a primitive (0.2-1.2 MB) per input
      shape, so the row counts it sees are bounded: up to ``SMALL`` rows are padded to a multiple of 8;
      longer inputs run as pieces of a multiple of ``SMALL`` rows (at most ``PIECE``) plus one short tail.
      That is at most 40 primitives per weight;
    * elsewhere ``F.linear``.
    """
    SMALL, PIECE = 256, 2048

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, kernels=None):
        self.bias, self.kernels = bias, kernels
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        if cpu_kernels.gemm_packs(kernels, weight):
            self.panels, self.weight = cpu_kernels.pack_weight(kernels, weight), None
        elif pack:
            self.packed, self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None), None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            y = cpu_kernels.linear(self.kernels, x, self.panels)
            return y if self.bias is None else y.add_(self.bias)
        if self.packed is None:
            assert self.weight is not None
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if rows <= self.SMALL:
            padded = -(-rows // 8) * 8
            if padded != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:rows]
        pieces, start = [], 0
        while rows - start > self.SMALL:
            n = min(self.PIECE, (rows - start) // self.SMALL * self.SMALL)
            pieces.append(torch.ops.mkldnn._linear_pointwise(x[start:start + n], self.packed, self.bias,
                                                             "none", [], ""))
            start += n
        if start < rows:
            pieces.append(self(x[start:]))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


@dataclass(frozen=True)
class WeightFormat:
    """How a model keeps its weights: compute dtype and device, the compiled CPU kernels (None: PyTorch) and the
    quantization of its linears ('none' or 'int8')."""
    dtype: torch.dtype
    device: torch.device
    kernels: ctypes.CDLL | None
    quantization: str = "none"

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def matmul(self, weight: torch.Tensor, bias: torch.Tensor | None, name: str = "weight",
               columns: tuple[int, int] | None = None) -> Linear | Int8Linear:
        """The local matmul of ``weight`` [out, in] (as given: int8 quantizes from it, not from a cast copy), or of
        its input ``columns`` (int8: quantized over whole rows first, so every rank has the scales of one rank)."""
        if bias is not None:
            bias = bias.to(device=self.device, dtype=self.dtype)
        if self.quantization == "int8":
            quantized = None
            if columns is not None:
                q, scale = quantize_int8(weight, name)
                quantized = (q[:, columns[0]:columns[1]].contiguous(), scale)
            return Int8Linear(weight, bias, self.kernels, self.dtype, self.device, name, quantized)
        if columns is not None:
            weight = weight[:, columns[0]:columns[1]]
        return Linear(self.tensor(weight), bias, onednn_packs(self.dtype, self.device), self.kernels)


def weight_bytes(matmul: Linear | Int8Linear) -> int:
    """Bytes a matmul keeps (packed, quantized or plain; bias and scales included)."""
    if isinstance(matmul, Int8Linear):
        return matmul.weight_bytes
    return sum(t.numel() * t.element_size() for t in (matmul.weight, matmul.packed, matmul.panels, matmul.bias)
               if t is not None)


class ColumnParallelLinear(nn.Module):
    """This rank's output rows of the weights ``parts`` fused into one matmul: of each part (and its bias) the
    rows ``ranges[i]``. The output is this rank's share, in the order of the parts."""

    def __init__(self, parts: list[torch.Tensor], biases: list[torch.Tensor] | None, ranges: list[tuple[int, int]],
                 fmt: WeightFormat, name: str = "weight"):
        super().__init__()
        weight = torch.cat([w[a:b] for w, (a, b) in zip(parts, ranges)])
        bias = torch.cat([b_[a:b] for b_, (a, b) in zip(biases, ranges)]) if biases is not None else None
        self.matmul = fmt.matmul(weight, bias, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class RowParallelLinear(nn.Module):
    """This rank's input columns ``columns`` of ``weight``: multiplies its share of the inputs, sums the partial
    outputs over the group, then adds the bias (once)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, columns: tuple[int, int], fmt: WeightFormat,
                 group=None, name: str = "weight"):
        super().__init__()
        self.group = group or SingleRank()
        a, b = columns
        whole = self.group.size == 1
        # with one rank the bias goes into the matmul, as the plain layer has it
        self.matmul = fmt.matmul(weight, bias if whole else None, name, None if whole else (a, b))
        self.bias = None if whole or bias is None else bias.to(device=fmt.device, dtype=fmt.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.group.size == 1:
            return y
        y = self.group.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)
