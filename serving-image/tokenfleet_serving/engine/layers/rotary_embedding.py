"""Rotary position embedding (rotate-half, with the default, linear and llama3 frequency scalings), applied to
the queries and keys of every head at once."""
from __future__ import annotations

import math

import torch
from torch import nn

from .. import cpu_kernels
from ..config import ModelConfig
from .linear import WeightFormat


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    hd = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, max_model_len: int, fmt: WeightFormat):
        super().__init__()
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float32), rope_inv_freq(config))
        # rotate-half RoPE as x * cos2 + cat(x2, x1) * sin2, with the sign folded into sin2
        self.cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1).to(device=fmt.device, dtype=fmt.dtype)
        self.sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(device=fmt.device, dtype=fmt.dtype)
        self.kernels = fmt.kernels

    def forward(self, qk: torch.Tensor, batch) -> torch.Tensor:
        """``qk`` [rows, heads, head_dim] rotated by each row's position (in place with the kernels)."""
        if self.kernels is not None:
            cpu_kernels.rope_(self.kernels, qk, self.cos, self.sin, batch.positions, batch.position_range)
            return qk
        return self.rotate(qk, self.cos[batch.positions].unsqueeze(1), self.sin[batch.positions].unsqueeze(1))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)
