"""The vocabulary-parallel embedding and LM head: each rank holds the rows of one shard of the vocabulary
(``padded_shard``: equal widths, the last shard padded with zero rows).

The embedding looks up the tokens of its shard (zeros for the others) and the ranks sum their rows; the head
computes the logits of its shard and rank 0 gathers them side by side.
"""
from __future__ import annotations

import torch
from torch import nn

from ..quantization import Int8Linear
from .linear import Linear, WeightFormat, onednn_packs, weight_bytes
from .parallel import SingleRank, padded_shard


def vocab_shard(weight: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """This rank's rows of ``weight`` [vocab, hidden], padded to the shard width, and the first token id."""
    start, end, width = padded_shard(weight.shape[0], group.size, group.rank)
    rows = weight[start:end]
    if end - start < width:
        rows = torch.cat([rows, rows.new_zeros(width - (end - start), weight.shape[1])])
    return rows, start


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, fmt: WeightFormat, group=None):
        super().__init__()
        self.group = group or SingleRank()
        rows, self.start = vocab_shard(weight, self.group)
        self.weight = fmt.tensor(rows)
        self.width = rows.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.weight[input_ids]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.width)
        x = self.weight[local.masked_fill(outside, 0)]
        x.masked_fill_(outside.unsqueeze(1), 0)
        return self.group.all_reduce(x)

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class ParallelLMHead(nn.Module):
    """Logits over this rank's vocabulary shard; ``forward`` returns rank 0 the whole vocabulary's fp32 logits
    (other ranks: None). With tied embeddings and plain weights the head reads the embedding's shard."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, fmt: WeightFormat, group=None,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.group = group or SingleRank()
        self.vocab_size = vocab_size
        self.shares_embedding = tied_to is not None and fmt.quantization != "int8"
        if self.shares_embedding:
            assert tied_to is not None
            self.matmul: Linear | Int8Linear = Linear(tied_to.weight, None, onednn_packs(fmt.dtype, fmt.device), fmt.kernels)
        else:   # int8: read whole every step, a third of int8 decoding's bytes if kept wide
            self.matmul = fmt.matmul(vocab_shard(weight, self.group)[0], None, "lm_head.weight")
        self.tied_to = tied_to

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = self.matmul(x).float()
        if self.group.size == 1:
            return logits
        whole = self.group.gather_columns(logits)
        return None if whole is None else whole[:, :self.vocab_size]

    def weight_bytes(self) -> int:
        """Bytes of its own (the embedding's rows it reads, when tied and unpacked, are the embedding's)."""
        total = weight_bytes(self.matmul)
        if self.tied_to is not None and getattr(self.matmul, "weight", None) is self.tied_to.weight:
            total -= self.tied_to.weight_bytes()
        return total

