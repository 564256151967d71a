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
        self._groups: list[tuple[LoRAAdapter, torch.Tensor | None]] | None = None

    def at(self, layer: int) -> LoRARows:
        """The same rows, for the matmuls of decoder layer ``layer``."""
        view = LoRARows(self.ids, self.adapters, self.device, layer)
        view._groups = self.groups
        return view

    @property
    def groups(self) -> list[tuple[LoRAAdapter, torch.Tensor | None]]:
        """(adapter, its rows; None when it has every row) for each adapter with rows here."""
        if self._groups is None:
            groups = []
            for k in np.unique(self.ids):
                if k < 0:
                    continue
                rows = np.flatnonzero(self.ids == k)
                whole = len(rows) == len(self.ids)
                groups.append((self.adapters[k], None if whole else torch.from_numpy(rows).to(self.device)))
            self._groups = groups
        return self._groups

    def add(self, y: torch.Tensor, x: torch.Tensor, matmul: str) -> torch.Tensor:
        """``y`` (the base matmul ``matmul`` of this layer over ``x``) plus each row's adapter delta, in place."""
        for adapter, rows in self.groups:
            fused = adapter.layers[self.layer].get(matmul)
            if fused is not None:
                fused.add(y, x, rows)
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
