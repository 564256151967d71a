"""Llama-family decoder (Llama 2/3, Mistral, Qwen2), built from ``layers/`` in its tensor-parallel form.

All sequences of a step are flattened into one [T, hidden] batch, so every linear layer is a single matmul.
Q/K/V and gate/up projections are fused at load time. A rank of a tensor-parallel group of ``tp`` holds:

* the query heads ``[r * H/tp, (r+1) * H/tp)`` and the key/value heads they read: ``KVH/tp`` of them when tp
  divides the KV heads, else (tp a multiple of KVH) the one KV head its query heads share, replicated on
  ``tp/KVH`` ranks; the output projection is row-parallel over those heads;
* ``1/tp`` of the MLP's intermediate features (gate/up column-parallel, down row-parallel);
* ``1/tp`` of the vocabulary, for the embedding and the LM head;
* whole copies of the norms and the rotary tables.

``split_error`` says why a model cannot be split over tp ranks (the operator checks the same before any pod
starts). The model owns no KV cache: ``model_runner.py`` allocates it and passes each layer its part.
"""
from __future__ import annotations

import torch
from torch import nn

from . import cpu_kernels
from .batch import StepBatch
from .config import ModelConfig
from .layers.activation import SiluAndMul
from .layers.attention import PagedAttention
from .layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from .layers.layernorm import RMSNorm
from .layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, WeightFormat, weight_bytes
from .layers.lora import LoRARows, add_lora
from .layers.parallel import SingleRank, shard
from .layers.rotary_embedding import RotaryEmbedding


def split_error(config: ModelConfig, tp: int) -> str | None:
    """Why ``config``'s model cannot be split over ``tp`` tensor-parallel ranks, or None."""
    if tp < 1:
        return f"tensor parallel size must be >= 1, got {tp}"
    if config.num_heads % tp:
        return f"num_attention_heads {config.num_heads} is not divisible by tensor parallel size {tp}"
    if config.num_kv_heads % tp and tp % config.num_kv_heads:
        return (f"num_key_value_heads {config.num_kv_heads} and tensor parallel size {tp}: neither divides the "
                f"other, so the key/value heads can be neither split nor replicated")
    if config.intermediate_size % tp:
        return f"intermediate_size {config.intermediate_size} is not divisible by tensor parallel size {tp}"
    return None


def kv_heads_per_rank(config: ModelConfig, tp: int) -> int:
    return max(config.num_kv_heads // tp, 1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, fmt: WeightFormat,
                 rotary: RotaryEmbedding, group):
        super().__init__()
        c, tp, r = config, group.size, group.rank
        hd = c.head_dim
        self.heads, self.kv_heads, self.head_dim = c.num_heads // tp, kv_heads_per_rank(c, tp), hd
        q0 = r * self.heads                                             # this rank's first query head
        kv0 = (q0 // (c.num_heads // c.num_kv_heads)) if tp > c.num_kv_heads else r * self.kv_heads
        q_rows, kv_rows = (q0 * hd, (q0 + self.heads) * hd), (kv0 * hd, (kv0 + self.kv_heads) * hd)
        a = prefix + "self_attn."
        names = [a + "q_proj", a + "k_proj", a + "v_proj"]
        self.qkv_proj = ColumnParallelLinear([weights[n + ".weight"] for n in names],
                                             [weights[n + ".bias"] for n in names] if c.qkv_bias else None,
                                             [q_rows, kv_rows, kv_rows], fmt, names[0] + ".weight")
        self.o_proj = RowParallelLinear(weights[a + "o_proj.weight"], weights.get(a + "o_proj.bias") if c.o_bias else None,
                                        q_rows, fmt, group, a + "o_proj.weight")
        self.rotary = rotary
        self.attn = PagedAttention(self.heads, self.kv_heads, hd, fmt.kernels, fmt.dtype)
        self.q_size, self.kv_size = self.heads * hd, self.kv_heads * hd

    def forward(self, h: torch.Tensor, kv: torch.Tensor, batch: StepBatch, keep_rows: torch.Tensor | None,
                lora: LoRARows | None = None) -> torch.Tensor:
        """Store this step's keys and values, and return the attention output (not yet projected) of every row,
        or with ``keep_rows`` of those rows only."""
        T, hd = h.shape[0], self.head_dim
        qkv = add_lora(lora, self.qkv_proj(h), h, "qkv")
        qk = self.rotary(qkv[:, :self.q_size + self.kv_size].view(T, -1, hd), batch)     # q and k at once
        q, k = qk[:, :self.heads], qk[:, self.heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.kv_heads, hd)
        self.attn.store(k, v, kv, batch)
        if keep_rows is None:
            return self.attn(q, k, v, kv, batch)
        return self.attn(q, k, v, kv, batch, sampled_only=True).index_select(0, keep_rows)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, fmt: WeightFormat,
                 group):
        super().__init__()
        m = prefix + "mlp."
        cols = shard(config.intermediate_size, group.size, group.rank)
        bias = config.mlp_bias
        self.gate_up_proj = ColumnParallelLinear(
            [weights[m + "gate_proj.weight"], weights[m + "up_proj.weight"]],
            [weights[m + "gate_proj.bias"], weights[m + "up_proj.bias"]] if bias else None, [cols, cols], fmt,
            m + "gate_proj.weight")
        self.down_proj = RowParallelLinear(weights[m + "down_proj.weight"],
                                           weights[m + "down_proj.bias"] if bias else None, cols, fmt, group,
                                           m + "down_proj.weight")
        self.act = SiluAndMul(fmt.kernels)

    def forward(self, h: torch.Tensor, lora: LoRARows | None = None) -> torch.Tensor:
        a = self.act(add_lora(lora, self.gate_up_proj(h), h, "gate_up"))
        return add_lora(lora, self.down_proj(a), a, "down")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], index: int, fmt: WeightFormat,
                 rotary: RotaryEmbedding, group):
        super().__init__()
        p = f"model.layers.{index}."
        self.index = index
        self.input_layernorm = RMSNorm(weights[p + "input_layernorm.weight"], config.rms_norm_eps, fmt)
        self.self_attn = LlamaAttention(config, weights, p, fmt, rotary, group)
        self.post_attention_layernorm = RMSNorm(weights[p + "post_attention_layernorm.weight"], config.rms_norm_eps,
                                                fmt)
        self.mlp = LlamaMLP(config, weights, p, fmt, group)
        self.piece_rows: int | None = None     # rows per MLP piece (None: Linear.PIECE); the runner may set fewer

    def linears(self) -> dict:
        """The layer's four local matmuls by the names the one-call decoder kernel takes."""
        return {"qkv": self.self_attn.qkv_proj.matmul, "o": self.self_attn.o_proj.matmul,
                "gate_up": self.mlp.gate_up_proj.matmul, "down": self.mlp.down_proj.matmul}

    def biases(self) -> dict:
        """The biases of ``linears()`` by the one-call decoder's names: the row-parallel ones as added after the
        sum across ranks (with one rank, inside their matmul)."""
        rows = {"o": self.self_attn.o_proj, "down": self.mlp.down_proj}
        return {n + "_bias": (rows[n].bias if n in rows and rows[n].bias is not None else m.bias)
                for n, m in self.linears().items()}

    def forward(self, x: torch.Tensor, kv: torch.Tensor, batch: StepBatch, keep_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``x`` [T, hidden] through the layer, updated in place; with ``keep_rows`` only those rows go on past
        the KV write (and are returned)."""
        lora = batch.lora.at(self.index) if batch.lora is not None else None    # adapters' rows (layers/lora.py)
        attn = self.self_attn(self.input_layernorm(x), kv, batch, keep_rows, lora)
        if keep_rows is not None:
            x = x.index_select(0, keep_rows)
            lora = lora.select(keep_rows) if lora is not None else None
        rows = self.piece_rows or Linear.PIECE
        for start in range(0, x.shape[0], rows):           # row pieces bound the MLP's wide intermediates
            r = slice(start, start + rows)
            piece = lora.narrow(start, start + rows) if lora is not None else None
            o = add_lora(piece, self.self_attn.o_proj(attn[r]), attn[r], "o")
            h = self.post_attention_layernorm(x[r], delta=o)   # x[r] += o(attn) first
            x[r] += self.mlp(h, piece)
        return x

    def weight_bytes(self) -> int:
        return (self.input_layernorm.weight_bytes() + self.post_attention_layernorm.weight_bytes()
                + sum(weight_bytes(m) for m in self.linears().values()))


class LlamaForCausalLM(nn.Module):
    """``weights``: the checkpoint's tensors by their HF names (every rank is given the whole checkpoint and
    keeps its share)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], fmt: WeightFormat, max_model_len: int,
                 group=None):
        super().__init__()
        group = group or SingleRank()
        why = split_error(config, group.size)
        if why is not None:
            raise ValueError(why)
        self.config, self.group = config, group
        self.embed_tokens = VocabParallelEmbedding(weights["model.embed_tokens.weight"], fmt, group)
        self.rotary = RotaryEmbedding(config, max_model_len, fmt)
        self.decoders = [LlamaDecoderLayer(config, weights, i, fmt, self.rotary, group)
                         for i in range(config.num_layers)]
        self.layers = nn.ModuleList(self.decoders)
        self.norm = RMSNorm(weights["model.norm.weight"], config.rms_norm_eps, fmt)
        tied = config.tie_word_embeddings
        head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
        self.lm_head = ParallelLMHead(head, config.vocab_size, fmt, group,
                                      tied_to=self.embed_tokens if tied else None)
        self.kernels = fmt.kernels
        # whether chunks of 2+ tokens can go through the compiled prefill attention (build_batch's flag;
        # else SDPA over gathered blocks)
        self.compiled_prefill = cpu_kernels.prefill_attends(fmt.kernels, config.head_dim)

    def weight_bytes(self) -> int:
        """Bytes of every weight this rank keeps (packed, quantized or plain; biases and scales included)."""
        return (self.embed_tokens.weight_bytes() + self.norm.weight_bytes() + self.lm_head.weight_bytes()
                + sum(layer.weight_bytes() for layer in self.decoders))

    def decoder_layers(self, x: torch.Tensor, kv_layers: list[torch.Tensor], batch: StepBatch,
                       keep_rows: torch.Tensor | None) -> torch.Tensor:
        """The decoder layers over ``x`` [T, hidden], one kernel or torch op at a time; with ``keep_rows`` the
        last layer finishes only those rows (and returns them)."""
        self.decoders[0].self_attn.attn.prepare(batch)
        last = len(self.decoders) - 1
        for i, (layer, kv) in enumerate(zip(self.decoders, kv_layers)):
            x = layer(x, kv, batch, keep_rows if i == last else None)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits of the final hidden rows ``x`` (rank 0; other ranks of a group: None)."""
        return self.lm_head(self.norm(x))
