"""How a layer sees the other ranks of its tensor-parallel group: its rank, the group's size, the split of a
dimension into per-rank shards, and the two collectives the layers need (a sum across ranks after a
row-parallel matmul, and rank 0 gathering the vocabulary shards of the logits).

``SingleRank`` is the group of one process (every collective is the identity); ``engine/distributed.py``
builds the ``torch.distributed`` one.
"""
from __future__ import annotations

import torch


class SingleRank:
    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``x`` [rows, n] side by side, [rows, size * n]; other ranks: None."""
        return x


def shard(n: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s share of ``n`` split evenly over ``size`` ranks (``size`` divides ``n``)."""
    if n % size:
        raise ValueError(f"{n} does not split over {size} ranks")
    per = n // size
    return rank * per, (rank + 1) * per


def padded_shard(n: int, size: int, rank: int) -> tuple[int, int, int]:
    """(start, end, width) of ``rank``'s share of ``n`` rows split in ``size`` shards of one ``width`` =
    ceil(n / size); the last shards may be short (or empty), padded to ``width`` by their holder."""
    width = -(-n // size)
    start = min(rank * width, n)
    return start, min(start + width, n), width
