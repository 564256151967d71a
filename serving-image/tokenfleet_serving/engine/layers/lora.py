"""The LoRA deltas of one step's batch, grouped by adapter (S-LoRA/Punica style, in plain matmuls).

Every row of a step's flat batch belongs to one request, and so to one adapter or to the base model. The
base matmul runs once over all rows; then, for each adapter present in the step, its rows are gathered and
go through that adapter's two small matmuls (``lora_adapter.FusedLoRA``), and the result is added back into
those rows. A step mixing several adapters and the base model is still one forward pass; the extra work is
``rows x rank x (in + out)`` per adapter and projection.

``LoRARows`` follows the batch through the layers: the decoder layer narrows it to the row pieces of its
MLP loop and to the rows the last layer keeps.
"""
from __future__ import annotations

import numpy as np
import torch

from ..lora_adapter import LoRAAdapter


class LoRARows:
    """``ids[row]``: index into ``adapters`` of the row's adapter, or -1 for the base model."""

    def __init__(self, ids: np.ndarray, adapters: list[LoRAAdapter], device: torch.device, layer: int = 0):
        self.ids, self.adapters, self.device, self.layer = ids, adapters, device, layer
        self._runs: list[tuple[LoRAAdapter, int, int]] | None = None

    def at(self, layer: int) -> LoRARows:
        """The same rows, for the matmuls of decoder layer ``layer``."""
        view = LoRARows(self.ids, self.adapters, self.device, layer)
        view._runs = self.runs
        return view

    @property
    def runs(self) -> list[tuple[LoRAAdapter, int, int]]:
        """(adapter, first row, last row + 1) of each run of rows of one adapter."""
        if self._runs is None:
            ids = self.ids
            edges = np.flatnonzero(np.diff(ids)) + 1
            starts = np.concatenate([[0], edges])
            ends = np.concatenate([edges, [len(ids)]])
            self._runs = [(self.adapters[ids[a]], int(a), int(b)) for a, b in zip(starts, ends) if ids[a] >= 0]
        return self._runs

    def add(self, y: torch.Tensor, x: torch.Tensor, matmul: str) -> torch.Tensor:
        """``y`` (the base matmul ``matmul`` of this layer over ``x``) plus each row's adapter delta, in place."""
        for adapter, a, b in self.runs:
            fused = adapter.layers[self.layer].get(matmul)
            if fused is not None:
                fused.add(y[a:b], x[a:b])
        return y

    def narrow(self, start: int, end: int) -> LoRARows:
        if start == 0 and end >= len(self.ids):
            return self
        return LoRARows(self.ids[start:end], self.adapters, self.device, self.layer)

    def select(self, rows: torch.Tensor) -> LoRARows:
        return LoRARows(self.ids[rows.cpu().numpy()], self.adapters, self.device, self.layer)


def add_lora(lora: LoRARows | None, y: torch.Tensor, x: torch.Tensor, matmul: str) -> torch.Tensor:
    """``y`` with ``lora``'s deltas added (None: no adapter in this step)."""
    return y if lora is None else lora.add(y, x, matmul)
