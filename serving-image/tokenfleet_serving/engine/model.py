"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) running over a paged KV cache.

All sequences of a step are flattened into one [T, hidden] batch, so every
linear layer is a single matmul. Q/K/V and gate/up projections are fused at
load time. The KV pool is one tensor per layer laid out as
[2 (keys, values), kv_heads, num_blocks, block_size, head_dim]: gathering a
sequence's blocks copies contiguous block_size x head_dim tiles of keys and
values in one call and yields contiguous [kv_heads, tokens, head_dim] views.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from . import cpu_kernels
from .batch import PagedGroup, StepBatch
from .config import ModelConfig
from .quantization import Int8Linear


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


def _onednn_packs(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    """``y = x W^T + b``, by the fastest path this device has:

    * the compiled kernels' GEMM over a weight packed once into 16-column panels (fp32 on an AVX2 CPU, out
      features a multiple of 16): 1.2-2x oneDNN on the few-row matmuls of decoding and as fast at
      thousands of rows (measured in docs/engine.md);
    * otherwise, for fp32 on CPU, oneDNN with the weight reordered once into its blocked layout: 1.5-2x the
      default BLAS call on those matmuls. oneDNN compiles and keeps a primitive (0.2-1.2 MB) per input
      shape, so the row counts it sees are bounded: up to ``SMALL`` rows are padded to a multiple of 8;
      longer inputs run as pieces of a multiple of ``SMALL`` rows (at most ``PIECE``) plus one short tail.
      That is at most 40 primitives per weight;
    * elsewhere ``F.linear``.
    """
    SMALL, PIECE = 256, 2048

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, kernels=None):
        self.bias, self.kernels = bias, kernels
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        if cpu_kernels.gemm_packs(kernels, weight):
            self.panels, self.weight = cpu_kernels.pack_weight(kernels, weight), None
        elif pack:
            self.packed, self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None), None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            y = cpu_kernels.linear(self.kernels, x, self.panels)
            return y if self.bias is None else y.add_(self.bias)
        if self.packed is None:
            assert self.weight is not None
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if rows <= self.SMALL:
            padded = -(-rows // 8) * 8
            if padded != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:rows]
        pieces, start = [], 0
        while rows - start > self.SMALL:
            n = min(self.PIECE, (rows - start) // self.SMALL * self.SMALL)
            pieces.append(torch.ops.mkldnn._linear_pointwise(x[start:start + n], self.packed, self.bias,
                                                             "none", [], ""))
            start += n
        if start < rows:
            pieces.append(self(x[start:]))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device, max_model_len: int, use_kernels: bool = True,
                 quantization: str = "none"):
        """``quantization`` 'int8': the decoder's linear weights in int8 (``quantization.py``), quantized here
        from ``weights`` as given (pass them in fp32, or the checkpoint's own dtype, to quantize from full
        precision)."""
        self.config, self.dtype, self.device = config, dtype, device
        self.quantization = quantization
        # compiled C kernels (GEMM, attention over the pool, one-pass norm/SwiGLU/RoPE/KV write), fp32 CPU
        # only; None: PyTorch
        on_cpu_fp32 = device.type == "cpu" and dtype == torch.float32
        self.kernels = cpu_kernels.load() if use_kernels and on_cpu_fp32 else None
        # whether chunks of 2+ tokens can go through the compiled prefill attention (build_batch's flag;
        # else SDPA over gathered blocks)
        self.compiled_prefill = cpu_kernels.prefill_attends(self.kernels, config.head_dim)
        if quantization not in ("none", "int8"):
            raise ValueError(f"quantization must be 'none' or 'int8', got {quantization!r}")
        w = lambda name: weights[name].to(device=device, dtype=dtype).contiguous()
        pack = _onednn_packs(dtype, device)

        def lin(names: tuple[str, ...], bias_names: tuple[str, ...] | None) -> Linear | Int8Linear:
            """The linear of the concatenated weights (and biases) ``names``."""
            weight = torch.cat([weights[n] for n in names])
            bias = torch.cat([weights[n] for n in bias_names]).to(device=device, dtype=dtype) if bias_names else None
            if quantization == "int8":     # from the weights as given, not cast to the compute dtype first
                return Int8Linear(weight, bias, self.kernels, dtype, device, names[0])
            return Linear(weight.to(device=device, dtype=dtype).contiguous(), bias, pack, self.kernels)

        self.embed = w("model.embed_tokens.weight")
        self.lm_head: Linear | Int8Linear
        if quantization == "int8":        # read whole every step: a third of int8 decoding's bytes if kept wide
            head = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
            self.lm_head = Int8Linear(head, None, self.kernels, dtype, device, "lm_head.weight")
        else:
            self.lm_head = Linear(self.embed if config.tie_word_embeddings else w("lm_head.weight"), None, pack,
                                  self.kernels)
        self.norm = w("model.norm.weight")
        self.layers: list[dict[str, Any]] = []
        for n in range(config.num_layers):
            p = f"model.layers.{n}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(dict(
                ln1=w(p + "input_layernorm.weight"), ln2=w(p + "post_attention_layernorm.weight"),
                qkv=lin((a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                        (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if config.qkv_bias else None),
                o=lin((a + "o_proj.weight",), (a + "o_proj.bias",) if config.o_bias else None),
                gate_up=lin((m + "gate_proj.weight", m + "up_proj.weight"),
                            (m + "gate_proj.bias", m + "up_proj.bias") if config.mlp_bias else None),
                down=lin((m + "down_proj.weight",), (m + "down_proj.bias",) if config.mlp_bias else None)))
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float32), rope_inv_freq(config))
        # rotate-half RoPE as x * cos2 + cat(x2, x1) * sin2, with the sign folded into sin2
        self.cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1).to(device=device, dtype=dtype)
        self.sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        self.kv_layers: list[torch.Tensor] = []     # per layer [2, kv_heads, num_blocks, block_size, head_dim]
        self.block_size = 0
        # every layer in one kernel call per step (built with the pool) where all its linears are packed;
        # ``use_decoder_call = False`` keeps the Python layer loop over the same kernels
        self.decoder_call: cpu_kernels.DecoderLayers | None = None
        self.use_decoder_call = True

    def weight_bytes(self) -> int:
        """Bytes of every weight the model keeps (packed, quantized or plain; biases and scales included)."""
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        def linear(lin) -> int:
            if isinstance(lin, Int8Linear):
                return lin.weight_bytes
            return size(lin.weight) + size(lin.packed) + size(lin.panels) + size(lin.bias)

        tied = self.config.tie_word_embeddings      # the lm_head then reads the embedding (packed copy aside)
        shares_embed = tied and getattr(self.lm_head, "weight", None) is self.embed
        total = size(self.embed) + size(self.norm) + linear(self.lm_head) - (size(self.embed) if shares_embed else 0)
        for layer in self.layers:
            total += size(layer["ln1"]) + size(layer["ln2"])
            total += sum(linear(layer[n]) for n in ("qkv", "o", "gate_up", "down"))
        return total

    # ---- KV pool -------------------------------------------------------
    def kv_block_bytes(self, block_size: int) -> int:
        return block_size * self.config.kv_bytes_per_token * torch.finfo(self.dtype).bits // 8

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> int:
        """Allocate the pool; returns its size in bytes."""
        c = self.config
        shape = (c.num_layers, 2, c.num_kv_heads, num_blocks, block_size, c.head_dim)
        if self.device.type == "cpu":
            pool = cpu_kernels.huge_page_zeros(shape, self.dtype)
        else:
            pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_layers = [pool[i] for i in range(c.num_layers)]
        self.block_size = block_size
        self.kv_pool = pool
        linears = ("qkv", "o", "gate_up", "down")
        self.decoder_call = None
        if (self.kernels is not None and self.compiled_prefill
                and all(layer[n].panels is not None and not getattr(layer[n], "padded", False)
                        for layer in self.layers for n in linears)):
            weights = [dict(ln1=layer["ln1"], ln2=layer["ln2"],
                            **{n: layer[n].panels for n in linears}, **{n + "_bias": layer[n].bias for n in linears},
                            **{n + "_scale": getattr(layer[n], "scales", None) for n in linears})
                       for layer in self.layers]
            self.decoder_call = cpu_kernels.DecoderLayers(self.kernels, weights, self.kv_layers, self.cos, self.sin,
                                                          c.num_heads, c.rms_norm_eps, self.scale, Linear.PIECE)
        return pool.numel() * pool.element_size()

    # ---- forward -------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of ``x``; with ``delta``, first ``x += delta`` in place (the residual add before it)."""
        eps = self.config.rms_norm_eps
        if self.kernels is not None:
            return cpu_kernels.rms_norm(self.kernels, x, weight, eps, delta)
        if delta is not None:
            x += delta
        if self.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(self.dtype)   # as HF: normalize in fp32

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return cpu_kernels.silu_mul(self.kernels, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)

    @staticmethod
    def _gather(kv: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the listed blocks of one layer's keys and values: two [kv_heads, len(block_ids),
        block_size * head_dim]. (Selecting on the flattened block is twice as fast as on the 5-d view, and
        keys and values in one call a third faster than in two, measured.)"""
        both = kv.view(2, kv.shape[1], kv.shape[2], -1).index_select(2, block_ids)
        return both[0], both[1]

    def _paged_attention(self, q: torch.Tensor, kv: torch.Tensor, grp: PagedGroup) -> torch.Tensor:
        """Attention of one padded group; returns [valid queries, heads * head_dim]."""
        c = self.config
        KVH, hd, P, Q = c.num_kv_heads, c.head_dim, grp.num_seqs, grp.q_len
        g = c.num_heads // KVH
        qg = q[:P] if grp.q_rows is None else q.index_select(0, grp.q_rows)       # [P*Q, H, hd]
        qg = qg.view(P, Q, KVH, g, hd).permute(2, 0, 3, 1, 4).reshape(KVH, P, g * Q, hd)
        keys, vals = self._gather(kv, grp.block_ids)
        keys, vals = keys.view(KVH, P, -1, hd), vals.view(KVH, P, -1, hd)             # [KVH, P, L, hd]
        out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=grp.sdpa_mask, scale=self.scale)
        out = out.view(KVH, P, g, Q, hd).permute(1, 3, 0, 2, 4).reshape(P * Q, -1)
        return out if grp.valid is None else out.index_select(0, grp.valid)

    def _attention(self, q, k, v, kv, batch: StepBatch, sampled_only: bool = False) -> torch.Tensor:
        """Attention output [rows, heads * head_dim]; with ``sampled_only`` the compiled prefill computes only
        the sampled rows of its chunks (the other prefill rows of the result are left unset)."""
        c = self.config
        H, KVH, hd = c.num_heads, c.num_kv_heads, c.head_dim
        out = torch.empty(q.shape[0], H * hd, dtype=q.dtype, device=q.device)
        p = batch.prefill_sampled if sampled_only else batch.prefill
        if p is not None:                                        # chunks of 2+ tokens, keys from the pool
            assert self.kernels is not None, "batches carry prefill chunks only for the compiled kernels"
            cpu_kernels.prefill_attention(self.kernels, q, kv[0], kv[1], p.tables, p.q_rows, p.n_q, p.starts,
                                          out, self.scale, p.ends)
        for grp in batch.groups:
            if grp.q_len == 1 and self.kernels is not None:          # the decode group: rows 0..num_seqs-1
                cpu_kernels.paged_decode_attention(self.kernels, q[:grp.num_seqs], kv[0], kv[1],
                                                   grp.block_ids.view(grp.num_seqs, -1), grp.context_lens,
                                                   grp.max_context, out, self.scale)
                continue
            res = self._paged_attention(q, kv, grp)
            if grp.out_rows is None:
                out[:grp.num_seqs] = res
            else:
                out.index_copy_(0, grp.out_rows, res)
        for span in batch.long_spans:
            rows = slice(span.offset, span.offset + span.length)
            qs = q[rows].transpose(0, 1).unsqueeze(0)                                  # [1, H, n, hd]
            if span.block_ids is None:
                ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), is_causal=True,
                                                   scale=self.scale, enable_gqa=H > KVH)
            else:
                ks, vs = self._gather(kv, span.block_ids)
                ks, vs = ks.view(KVH, -1, hd)[:, :span.context], vs.view(KVH, -1, hd)[:, :span.context]
                o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=span.mask,
                                                   scale=self.scale, enable_gqa=H > KVH)
            out[rows] = o[0].transpose(0, 1).reshape(span.length, H * hd)
        return out

    @torch.inference_mode()
    def forward(self, batch: StepBatch, all_logits: bool = False) -> torch.Tensor:
        """Run one step; returns fp32 logits for ``batch.logits_rows`` (or every row)."""
        x = self.embed[batch.input_ids]
        # In the last layer only the sampled rows go on past the KV write: the others' output would feed
        # nothing but logits nobody reads (for a prompt chunk, all its rows but the last).
        trim = not all_logits and batch.logits_rows.shape[0] < x.shape[0]
        if (self.decoder_call is not None and self.use_decoder_call and not batch.long_spans
                and all(grp.q_len == 1 for grp in batch.groups)):
            x = self.decoder_call(x, batch, batch.logits_rows if trim else None)
        else:
            x = self._layers(x, batch, trim)
        if not all_logits and not trim:
            x = x[batch.logits_rows]
        return self.lm_head(self._rms_norm(x, self.norm)).float()

    def _layers(self, x: torch.Tensor, batch: StepBatch, trim: bool) -> torch.Tensor:
        """The decoder layers over ``x`` [T, hidden], one kernel or torch op at a time; with ``trim`` the last
        layer finishes only ``batch.logits_rows`` (and returns those rows)."""
        c = self.config
        KVH, hd = c.num_kv_heads, c.head_dim
        g = c.num_heads // KVH
        for grp in batch.groups:      # [P, 1, Q, L] -> [1, P, g*Q, L], matching the (g, Q) query order
            if grp.q_len == 1 and self.kernels is not None:
                continue              # the C decode kernel takes lengths, not a mask
            if grp.sdpa_mask is None:
                mask = grp.mask.to(self.dtype).squeeze(1)
                grp.sdpa_mask = (mask if grp.q_len == 1 else mask.repeat(1, g, 1)).unsqueeze(0)
        if self.kernels is None:
            cos, sin = self.cos[batch.positions].unsqueeze(1), self.sin[batch.positions].unsqueeze(1)
        T = x.shape[0]
        last = len(self.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.layers, self.kv_layers)):
            h = self._rms_norm(x, layer["ln1"])
            qkv = layer["qkv"](h)
            qk = qkv[:, :self.q_size + self.kv_size].view(T, -1, hd)                          # q and k at once
            if self.kernels is not None:
                cpu_kernels.rope_(self.kernels, qk, self.cos, self.sin, batch.positions, batch.position_range)
            else:
                qk = self._rope(qk, cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(T, KVH, hd)
            if self.kernels is not None:
                cpu_kernels.write_kv(self.kernels, k, v, batch.slots, kv[0], kv[1], batch.slot_range)
            else:
                kv[0].view(KVH, -1, hd).index_copy_(1, batch.slots, k.transpose(0, 1))
                kv[1].view(KVH, -1, hd).index_copy_(1, batch.slots, v.transpose(0, 1))
            if i == last and trim:
                attn = self._attention(q, k, v, kv, batch, sampled_only=True).index_select(0, batch.logits_rows)
                x = x.index_select(0, batch.logits_rows)
            else:
                attn = self._attention(q, k, v, kv, batch)
            for start in range(0, x.shape[0], Linear.PIECE):   # row pieces bound the MLP's wide intermediates
                r = slice(start, start + Linear.PIECE)
                h = self._rms_norm(x[r], layer["ln2"], delta=layer["o"](attn[r]))       # x[r] += o(attn) first
                x[r] += layer["down"](self._silu_mul(layer["gate_up"](h)))
        return x
