"""Attention of this rank's heads over the paged KV cache.

The KV pool is one tensor per layer laid out as [2 (keys, values), kv_heads, num_blocks, block_size, head_dim]
(this rank's KV heads only): gathering a sequence's blocks copies contiguous block_size x head_dim tiles of
keys and values in one call and yields contiguous [kv_heads, tokens, head_dim] views.

Paths: the compiled decode kernel reads the pool in place through the block tables (the decode group), the
compiled prefill kernel does every chunk of 2+ tokens in one call (``batch.prefill``); otherwise padded groups
and long spans go through ``scaled_dot_product_attention`` over gathered blocks.

With an int8 KV cache (``kv_quant.py``) a layer's pool is a ``QuantizedKV`` (int8 values and bf16 scales): the
kernels quantize on write and widen on read, the PyTorch path dequantizes what it gathers, and a chunk with
nothing cached before it attends its own keys and values as the cache gives them back.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_kernels, kv_quant
from ..batch import PagedGroup, StepBatch
from ..kv_quant import QuantizedKV

KVLayer = torch.Tensor | QuantizedKV     # one layer's pool: model dtype, or int8 with scales


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kernels: ctypes.CDLL | None,
                 dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group_size = num_heads // num_kv_heads       # queries per key/value head
        self.scale = head_dim ** -0.5
        self.kernels, self.dtype = kernels, dtype

    def prepare(self, batch: StepBatch) -> None:
        """Build, once per step, the masks the SDPA path takes: [P, 1, Q, L] -> [1, P, g*Q, L], matching the
        (g, Q) query order."""
        for grp in batch.groups:
            if grp.q_len == 1 and self.kernels is not None:
                continue              # the C decode kernel takes lengths, not a mask
            if grp.sdpa_mask is None:
                mask = grp.mask.to(self.dtype).squeeze(1)
                grp.sdpa_mask = (mask if grp.q_len == 1 else mask.repeat(1, self.group_size, 1)).unsqueeze(0)

    def store(self, k: torch.Tensor, v: torch.Tensor, kv: KVLayer, batch: StepBatch) -> None:
        """Write this step's keys and values [rows, kv_heads, head_dim] into their cache slots."""
        KVH, hd = self.num_kv_heads, self.head_dim
        if isinstance(kv, QuantizedKV):
            if self.kernels is not None:
                cpu_kernels.write_kv_int8(self.kernels, k, v, batch.slots, kv.data[0], kv.data[1], kv.scales[0],
                                          kv.scales[1], batch.slot_range)
                return
            for i, x in enumerate((k, v)):
                q, s = kv_quant.quantize(x.transpose(0, 1))
                kv.data[i].view(KVH, -1, hd).index_copy_(1, batch.slots, q)
                kv.scales[i].view(KVH, -1).index_copy_(1, batch.slots, s)
            return
        if self.kernels is not None:
            cpu_kernels.write_kv(self.kernels, k, v, batch.slots, kv[0], kv[1], batch.slot_range)
            return
        kv[0].view(KVH, -1, hd).index_copy_(1, batch.slots, k.transpose(0, 1))
        kv[1].view(KVH, -1, hd).index_copy_(1, batch.slots, v.transpose(0, 1))

    def gather(self, kv: KVLayer, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the listed blocks of one layer's keys and values: two [kv_heads, len(block_ids),
        block_size * head_dim] (int8 ones dequantized to the compute dtype). (Selecting on the flattened block
        is twice as fast as on the 5-d view, and keys and values in one call a third faster than in two,
        measured.)"""
        if isinstance(kv, QuantizedKV):
            d = kv.data
            q = d.view(2, d.shape[1], d.shape[2], -1, self.head_dim).index_select(2, block_ids)
            s = kv.scales.view(2, d.shape[1], d.shape[2], -1).index_select(2, block_ids)
            both = kv_quant.dequantize(q, s, self.dtype).flatten(3)
            return both[0], both[1]
        both = kv.view(2, kv.shape[1], kv.shape[2], -1).index_select(2, block_ids)
        return both[0], both[1]

    @staticmethod
    def _layers(kv: KVLayer) -> tuple[torch.Tensor, torch.Tensor]:
        data = kv.data if isinstance(kv, QuantizedKV) else kv
        return data[0], data[1]

    @staticmethod
    def _scales(kv: KVLayer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (kv.scales[0], kv.scales[1]) if isinstance(kv, QuantizedKV) else (None, None)

    def _paged(self, q: torch.Tensor, kv: KVLayer, grp: PagedGroup) -> torch.Tensor:
        """Attention of one padded group; returns [valid queries, heads * head_dim]."""
        KVH, hd, P, Q, g = self.num_kv_heads, self.head_dim, grp.num_seqs, grp.q_len, self.group_size
        qg = q[:P] if grp.q_rows is None else q.index_select(0, grp.q_rows)       # [P*Q, H, hd]
        qg = qg.view(P, Q, KVH, g, hd).permute(2, 0, 3, 1, 4).reshape(KVH, P, g * Q, hd)
        keys, vals = self.gather(kv, grp.block_ids)
        keys, vals = keys.view(KVH, P, -1, hd), vals.view(KVH, P, -1, hd)             # [KVH, P, L, hd]
        out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=grp.sdpa_mask, scale=self.scale)
        out = out.view(KVH, P, g, Q, hd).permute(1, 3, 0, 2, 4).reshape(P * Q, -1)
        return out if grp.valid is None else out.index_select(0, grp.valid)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVLayer, batch: StepBatch,
                sampled_only: bool = False) -> torch.Tensor:
        """Attention output [rows, heads * head_dim]; with ``sampled_only`` the compiled prefill computes only
        the sampled rows of its chunks (the other prefill rows of the result are left unset)."""
        H, KVH, hd = self.num_heads, self.num_kv_heads, self.head_dim
        out = torch.empty(q.shape[0], H * hd, dtype=q.dtype, device=q.device)
        p = batch.prefill_sampled if sampled_only else batch.prefill
        if p is not None:                                        # chunks of 2+ tokens, keys from the pool
            assert self.kernels is not None, "batches carry prefill chunks only for the compiled kernels"
            cpu_kernels.prefill_attention(self.kernels, q, *self._layers(kv), p.tables, p.q_rows, p.n_q, p.starts,
                                          out, self.scale, p.ends, *self._scales(kv))
        for grp in batch.groups:
            if grp.q_len == 1 and self.kernels is not None:          # the decode group: rows 0..num_seqs-1
                cpu_kernels.paged_decode_attention(self.kernels, q[:grp.num_seqs], *self._layers(kv),
                                                   grp.block_ids.view(grp.num_seqs, -1), grp.context_lens,
                                                   grp.max_context, out, self.scale, *self._scales(kv))
                continue
            res = self._paged(q, kv, grp)
            if grp.out_rows is None:
                out[:grp.num_seqs] = res
            else:
                out.index_copy_(0, grp.out_rows, res)
        for span in batch.long_spans:
            rows = slice(span.offset, span.offset + span.length)
            qs = q[rows].transpose(0, 1).unsqueeze(0)                                  # [1, H, n, hd]
            if span.block_ids is None:
                ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
                if isinstance(kv, QuantizedKV):           # what the cache gives back, as on the other paths
                    ks, vs = kv_quant.round_trip(ks), kv_quant.round_trip(vs)
                o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), is_causal=True,
                                                   scale=self.scale, enable_gqa=H > KVH)
            else:
                ks, vs = self.gather(kv, span.block_ids)
                ks, vs = ks.view(KVH, -1, hd)[:, :span.context], vs.view(KVH, -1, hd)[:, :span.context]
                o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=span.mask,
                                                   scale=self.scale, enable_gqa=H > KVH)
            out[rows] = o[0].transpose(0, 1).reshape(span.length, H * hd)
        return out
