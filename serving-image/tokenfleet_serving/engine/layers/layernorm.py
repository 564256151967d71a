"""RMSNorm, optionally fused with the residual add before it (the compiled kernel does both in one pass)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_kernels
from .linear import WeightFormat


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, fmt: WeightFormat):
        super().__init__()
        self.weight, self.eps, self.kernels, self.dtype = fmt.tensor(weight), eps, fmt.kernels, fmt.dtype

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of ``x``; with ``delta``, first ``x += delta`` in place (the residual add before it)."""
        if self.kernels is not None:
            return cpu_kernels.rms_norm(self.kernels, x, self.weight, self.eps, delta)
        if delta is not None:
            x += delta
        if self.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # as HF: normalize in fp32
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(self.dtype)

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
