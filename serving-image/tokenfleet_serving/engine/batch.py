"""One engine step's model input: a flat (ragged) batch of token chunks.

Single-token chunks (decodes) come first so attention can treat them as one
padded batch; longer chunks (prefills) follow and are attended one by one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SeqChunk:
    token_ids: list[int]        # tokens to compute this step
    start: int                  # tokens of this sequence already in the KV cache
    block_table: list[int]
    sample: bool                # True when the chunk ends the sequence (logits needed)


@dataclass
class PrefillSpan:
    offset: int                 # first row in the flat batch
    length: int                 # rows (query tokens)
    context: int                # keys to attend: start + length
    block_ids: torch.Tensor | None   # None: no earlier context, attend the fresh keys causally
    mask: torch.Tensor | None        # [length, context] bool, True = may attend


@dataclass
class StepBatch:
    input_ids: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]
    slots: torch.Tensor         # [T] cache slot (block * block_size + offset) per token
    num_decode: int             # rows [0, num_decode) are single-token sequences
    decode_block_ids: torch.Tensor | None   # [B * NB] padded block tables
    decode_mask: torch.Tensor | None        # [B, 1, NB * block_size] additive (0 / -inf)
    prefills: list[PrefillSpan]
    logits_rows: torch.Tensor   # rows whose logits are sampled
    sample_order: list[int]     # chunk index for each logits row


def build_batch(chunks: list[SeqChunk], block_size: int, device: torch.device) -> StepBatch:
    order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)
    ids, pos, slots, rows, sample_order, prefills = [], [], [], [], [], []
    decode = [i for i in order if len(chunks[i].token_ids) == 1]
    for i in order:
        c = chunks[i]
        n, offset = len(c.token_ids), len(ids)
        p = np.arange(c.start, c.start + n)
        table = np.asarray(c.block_table, dtype=np.int64)
        ids.extend(c.token_ids)
        pos.append(p)
        slots.append(table[p // block_size] * block_size + p % block_size)
        if c.sample:
            rows.append(offset + n - 1)
            sample_order.append(i)
        if n > 1:
            ctx = c.start + n
            if c.start == 0:
                prefills.append(PrefillSpan(offset, n, ctx, None, None))
            else:
                nb = -(-ctx // block_size)
                mask = np.arange(ctx)[None, :] <= p[:, None]
                prefills.append(PrefillSpan(offset, n, ctx, torch.from_numpy(table[:nb]).to(device),
                                            torch.from_numpy(mask).to(device)))
    decode_ids = decode_mask = None
    if decode:
        ctx = np.array([chunks[i].start + 1 for i in decode])
        nb = int(-(-ctx.max() // block_size))
        tables = np.zeros((len(decode), nb), dtype=np.int64)
        for r, i in enumerate(decode):
            t = chunks[i].block_table[:nb]
            tables[r, :len(t)] = t
        keys = np.arange(nb * block_size)
        mask = np.where(keys[None, :] < ctx[:, None], 0.0, -np.inf).astype(np.float32)
        decode_ids = torch.from_numpy(tables.reshape(-1)).to(device)
        decode_mask = torch.from_numpy(mask[:, None, :]).to(device)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)
    return StepBatch(
        input_ids=t(ids), positions=t(np.concatenate(pos) if pos else []),
        slots=t(np.concatenate(slots) if slots else []), num_decode=len(decode),
        decode_block_ids=decode_ids, decode_mask=decode_mask, prefills=prefills,
        logits_rows=t(rows), sample_order=sample_order)
