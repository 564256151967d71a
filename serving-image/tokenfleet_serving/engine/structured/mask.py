"""The grammar's token mask for a whole batch: one bitmask row per constrained request, unpacked for all of them
at once (``logits_processors.py`` applies it in one vectorized operation).

The rows are computed one after another on the step thread (llguidance takes microseconds a row for a JSON
schema). Not on llguidance's thread pool: on a CPU host the engine's torch threads already hold every core, and
a second pool's threads would compete with them for it.
"""
from __future__ import annotations

import numpy as np
import torch
from llguidance import LLMatcher


def fill_bitmask(matchers: list[LLMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(vocab/32)] int32: bit j of word w set when token 32*w + j may come next."""
    bitmask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    row_bytes = bitmask.shape[1] * 4
    for i, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(bitmask.data_ptr() + i * row_bytes, row_bytes)
    return bitmask


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """[rows, vocab_size] bool from a bitmask (bit j of word w: token 32*w + j; words little-endian)."""
    bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)
