"""One engine step's model input: a flat (ragged) batch of token chunks.

Attention is computed in groups, each one batched operation per layer:

* decodes (one query token each) form one padded group over their block tables;
* short prefill chunks (fewer than ``LONG_CHUNK`` tokens) form a second padded
  group, with a causal mask offset by the tokens already cached;
* long chunks run one by one through ``scaled_dot_product_attention``
  (causally over their own fresh keys when nothing precedes them in the cache).

With the compiled CPU prefill attention (``build_batch(..., compiled_prefill=True)``), every chunk of more
than one token is listed in ``prefill`` instead, for one kernel call per layer that reads all keys from the
pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from .wire import wire_type

if TYPE_CHECKING:
    from .layers.lora import LoRARows

LONG_CHUNK = 512


@dataclass
class SeqChunk:
    token_ids: list[int]        # tokens to compute this step
    start: int                  # tokens of this sequence already in the KV cache
    block_table: list[int]
    sample: bool                # True when the chunk ends the sequence (logits needed)
    adapter: int = -1           # the request's LoRA adapter: index into the step's adapters; -1: base model


@wire_type
@dataclass
class PagedGroup:
    """Sequences attended together: queries padded to ``q_len``, keys gathered by block."""
    num_seqs: int
    q_len: int
    q_rows: torch.Tensor | None      # [num_seqs * q_len] batch row of each padded query (None: rows 0..n-1)
    out_rows: torch.Tensor | None    # batch rows receiving the valid results (None: rows 0..n-1)
    valid: torch.Tensor | None       # padded positions that are real queries
    block_ids: torch.Tensor          # [num_seqs * blocks] padded block tables
    context_lens: torch.Tensor       # [num_seqs] keys each sequence attends (its new tokens included)
    max_context: int
    query_starts: np.ndarray         # [num_seqs] position of each sequence's first query
    num_keys: int                    # keys of the padded tables: blocks * block_size
    sdpa_mask: torch.Tensor | None = None    # ``mask`` as the model's SDPA call takes it (set by the model)

    @cached_property
    def mask(self) -> torch.Tensor:
        """[num_seqs, 1, q_len, keys] additive (0 / -inf), built on first use: the C decode kernel takes the
        context lengths instead, and building it for 64 decodes took about a third of ``build_batch``."""
        query_pos = self.query_starts[:, None] + np.arange(self.q_len)[None, :]        # [P, Q]
        keys = np.arange(self.num_keys)
        allowed = (keys[None, None, :] <= query_pos[:, :, None]) | (keys[None, None, :] == 0)
        return torch.from_numpy(np.where(allowed, 0.0, -np.inf).astype(np.float32)[:, None]).to(self.block_ids.device)


@wire_type
@dataclass
class LongSpan:
    offset: int                 # first row in the flat batch
    length: int                 # query tokens
    context: int                # keys attended: start + length
    block_ids: torch.Tensor | None   # None: nothing cached before, attend the fresh keys causally
    mask: torch.Tensor | None        # [length, context] bool, True = may attend


@wire_type
@dataclass
class PrefillChunks:
    """Every chunk of more than one token, for the compiled prefill attention (one call per layer)."""
    q_rows: torch.Tensor        # [P] first batch row of each chunk
    n_q: torch.Tensor           # [P] its tokens
    starts: torch.Tensor        # [P] tokens of its sequence already cached before it
    tables: torch.Tensor        # [P, width] block tables, padded
    ends: list[int]             # [P] starts + n_q: keys each chunk's sequence has after it


@wire_type
@dataclass
class StepBatch:
    input_ids: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]
    slots: torch.Tensor         # [T] cache slot (block * block_size + offset) per token
    groups: list[PagedGroup]
    long_spans: list[LongSpan]
    logits_rows: torch.Tensor   # rows whose logits are sampled
    sample_order: list[int]     # chunk index for each logits row
    prefill: PrefillChunks | None = None
    position_range: tuple[int, int] | None = None    # smallest and largest of ``positions`` and ``slots``
    slot_range: tuple[int, int] | None = None        # (None: unknown), so kernels check bounds once per step
    # the sampled chunks of ``prefill`` cut to their last token: in the last layer the other rows only had
    # keys and values to store, so only these query rows (and the decodes) need attention and the MLP
    prefill_sampled: PrefillChunks | None = None
    # [T] adapter index of each row (-1: the base model), None when no row has one; the runner turns it into
    # ``lora`` (layers/lora.py) with the step's adapters
    row_adapters: np.ndarray | None = None
    lora: LoRARows | None = None


def _group(chunks: list[SeqChunk], offsets: list[int], block_size: int, device, contiguous: bool) -> PagedGroup:
    n = np.array([len(c.token_ids) for c in chunks])
    start = np.array([c.start for c in chunks])
    q_len, ctx = int(n.max()), start + n
    nb = int(-(-ctx.max() // block_size))
    tables = np.zeros((len(chunks), nb), dtype=np.int64)
    for r, c in enumerate(chunks):
        t = c.block_table[:nb]
        tables[r, :len(t)] = t
    q_rows = out_rows = valid_t = None
    if not contiguous:
        i = np.arange(q_len)
        valid = i[None, :] < n[:, None]                               # [P, Q]
        rows = np.array(offsets)[:, None] + i[None, :]
        q_rows = torch.from_numpy(np.where(valid, rows, 0).reshape(-1)).to(device)
        out_rows = torch.from_numpy(rows[valid]).to(device)
        valid_t = torch.from_numpy(np.flatnonzero(valid)).to(device)
    return PagedGroup(len(chunks), q_len, q_rows, out_rows, valid_t, torch.from_numpy(tables.reshape(-1)).to(device),
                      torch.from_numpy(ctx).to(device), int(ctx.max()), start, nb * block_size)


def build_batch(chunks: list[SeqChunk], block_size: int, device: torch.device, compiled_prefill: bool = False
                ) -> StepBatch:
    """The step's flat batch. With ``compiled_prefill`` (the model runs the C prefill attention) every chunk of
    2+ tokens is described once in ``prefill``; otherwise in the short-chunk group or a long span."""
    kind = lambda c: 0 if len(c.token_ids) == 1 else (1 if len(c.token_ids) < LONG_CHUNK else 2)
    # by kind, and within a kind by LoRA adapter, so each adapter's rows run contiguously (layers/lora.py)
    order = sorted(range(len(chunks)), key=lambda i: (kind(chunks[i]), chunks[i].adapter))
    ids: list[int] = []
    pos: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    rows: list[int] = []
    sample_order: list[int] = []
    offsets: dict[int, int] = {}
    one_pos: list[int] = []
    one_slots: list[int] = []             # single-token chunks (they come first): plain ints, no numpy per chunk
    adapters: list[int] | None = None     # adapter index per row (from the first chunk that has one on)
    long_spans = []
    for i in order:
        c = chunks[i]
        n = len(c.token_ids)
        offsets[i] = len(ids)
        if c.adapter >= 0 and adapters is None:
            adapters = [-1] * len(ids)
        if adapters is not None:
            adapters.extend([c.adapter] * n)
        ids.extend(c.token_ids)
        if n == 1:
            one_pos.append(c.start)
            one_slots.append(c.block_table[c.start // block_size] * block_size + c.start % block_size)
        else:
            p = np.arange(c.start, c.start + n)
            table = np.asarray(c.block_table, dtype=np.int64)
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        if c.sample:
            rows.append(offsets[i] + n - 1)
            sample_order.append(i)
        if kind(c) == 2 and not compiled_prefill:
            ctx = c.start + n
            if c.start == 0:
                long_spans.append(LongSpan(offsets[i], n, ctx, None, None))
            else:
                mask = np.arange(ctx)[None, :] <= p[:, None]
                long_spans.append(LongSpan(offsets[i], n, ctx, torch.from_numpy(table[:-(-ctx // block_size)]).to(device),
                                           torch.from_numpy(mask).to(device)))
    groups = []
    for k in (0,) if compiled_prefill else (0, 1):
        members = [i for i in order if kind(chunks[i]) == k]
        if members:
            groups.append(_group([chunks[i] for i in members], [offsets[i] for i in members], block_size, device,
                                 contiguous=(k == 0)))
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)
    prefill = prefill_sampled = None
    multi = [i for i in order if kind(chunks[i]) > 0]
    if multi and compiled_prefill:
        width = max(-(-(chunks[i].start + len(chunks[i].token_ids)) // block_size) for i in multi)
        tables = np.zeros((len(multi), width), dtype=np.int64)
        for r, i in enumerate(multi):
            row = chunks[i].block_table[:width]
            tables[r, :len(row)] = row
        ends = [chunks[i].start + len(chunks[i].token_ids) for i in multi]
        prefill = PrefillChunks(t([offsets[i] for i in multi]), t([len(chunks[i].token_ids) for i in multi]),
                                t([chunks[i].start for i in multi]), torch.from_numpy(tables).to(device), ends)
        sampled = [r for r, i in enumerate(multi) if chunks[i].sample]
        if sampled:
            last_rows = [offsets[multi[r]] + len(chunks[multi[r]].token_ids) - 1 for r in sampled]
            prefill_sampled = PrefillChunks(t(last_rows), t([1] * len(sampled)), t([ends[r] - 1 for r in sampled]),
                                            torch.from_numpy(tables[sampled]).to(device), [ends[r] for r in sampled])
    positions = np.concatenate([np.asarray(one_pos, dtype=np.int64)] + pos)
    all_slots = np.concatenate([np.asarray(one_slots, dtype=np.int64)] + slots)
    span = lambda a: (int(a.min()), int(a.max())) if len(a) else (0, 0)
    return StepBatch(
        input_ids=t(ids), positions=t(positions), slots=t(all_slots), groups=groups, long_spans=long_spans,
        logits_rows=t(rows), sample_order=sample_order, prefill=prefill, prefill_sampled=prefill_sampled,
        position_range=span(positions), slot_range=span(all_slots),
        row_adapters=np.asarray(adapters, dtype=np.int64) if adapters is not None else None)
