"""Prompt lookup: propose the tokens that followed the longest earlier match of a request's last n tokens.

For n from ``max_n`` down to ``min_n``: if the request's last n tokens (prompt and output together) occurred
earlier in its own tokens, propose the up to ``k`` tokens that followed their earliest occurrence (as vLLM's
n-gram proposer does); otherwise try a shorter n; no match, no proposal. Extractive answers (quotes, code
edits, summaries that copy) keep matching the prompt, so the proposals are what the model would write.

``TokenHistory`` keeps a request's tokens in a growing numpy buffer, so a step converts only the tokens
added since the last one.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class TokenHistory:
    """A request's token ids as an int64 array, appended to as it grows."""

    def __init__(self) -> None:
        self.buffer = np.empty(256, dtype=np.int64)
        self.length = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        """The array of ``tokens`` (which extend what was synced before, or replace it when they do not)."""
        n = len(tokens)
        if n < self.length or (self.length and self.buffer[self.length - 1] != tokens[self.length - 1]):
            self.length = 0                                       # not an extension: start over
        if n > self.buffer.shape[0]:
            grown = np.empty(max(n, 2 * self.buffer.shape[0]), dtype=np.int64)
            grown[:self.length] = self.buffer[:self.length]
            self.buffer = grown
        if n > self.length:
            self.buffer[self.length:n] = tokens[self.length:]
            self.length = n
        return self.buffer[:n]


def propose(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens continuing the earliest earlier occurrence of the longest suffix of ``tokens`` of
    length in [min_n, max_n] (an empty list when no such suffix occurred before)."""
    length = tokens.shape[0]
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        windows = sliding_window_view(tokens[:length - 1], n)     # windows ending before the last token
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start:start + k].tolist()
    return []
