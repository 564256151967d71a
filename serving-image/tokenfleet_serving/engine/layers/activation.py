"""SwiGLU's activation: silu(gate) * up over the fused gate/up projection's output."""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_kernels


class SiluAndMul(nn.Module):
    def __init__(self, kernels: ctypes.CDLL | None):
        super().__init__()
        self.kernels = kernels

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return cpu_kernels.silu_mul(self.kernels, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
