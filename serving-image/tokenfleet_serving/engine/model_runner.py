"""The model runner: one rank's model, its part of the KV cache, the forward pass and the calls between ranks.

Rank 0 (the engine's) calls ``forward`` with each step's batch; in a tensor-parallel group it first hands the
batch to the other ranks (``distributed.py``), which run ``follow``: receive a batch, run the same forward
pass over their shards, repeat until told to stop. Only rank 0 gets logits.

On CPU in fp32, where every linear is packed for the compiled GEMM, a rank runs every decoder layer in one
kernel call per step (``cpu_kernels.DecoderLayers``: the same kernels in the same order, so the same bits as
the Python layer loop). With more ranks on one host the call sums each row-parallel matmul across them over
the group's shared-memory channel; without that channel (gloo or NCCL) the layers run one by one from Python,
with a collective after each row-parallel matmul.
"""
from __future__ import annotations

import time

import torch

from ..contract.levers import kv_bytes_per_token, parse_kv_cache_dtype
from . import cpu_kernels, kv_quant
from .batch import StepBatch
from .config import ModelConfig
from .distributed import ProcessGroup
from .layers.linear import Linear, WeightFormat
from .layers.parallel import SingleRank
from .model import LlamaForCausalLM, kv_heads_per_rank


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_model_len: int, use_kernels: bool = True, quantization: str = "none",
                 group=None, kv_cache_dtype: str = "auto"):
        """``quantization`` 'int8': the decoder's linear weights in int8 (``quantization.py``), quantized here
        from ``weights`` as given (pass them in fp32, or the checkpoint's own dtype, to quantize from full
        precision). ``group``: the tensor-parallel group (``distributed.py``); default: this process alone.
        ``kv_cache_dtype`` 'int8': the KV pool in int8 with a scale per token and KV head (``kv_quant.py``)."""
        if quantization not in ("none", "int8"):
            raise ValueError(f"quantization must be 'none' or 'int8', got {quantization!r}")
        self.config, self.dtype, self.device, self.quantization = config, dtype, device, quantization
        self.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype)
        self.group = group or SingleRank()
        self.peers: ProcessGroup | None = group if isinstance(group, ProcessGroup) and group.size > 1 else None
        # compiled C kernels (GEMM, attention over the pool, one-pass norm/SwiGLU/RoPE/KV write), fp32 CPU
        # only; None: PyTorch
        on_cpu_fp32 = device.type == "cpu" and dtype == torch.float32
        self.kernels = cpu_kernels.load() if use_kernels and on_cpu_fp32 else None
        self.model = LlamaForCausalLM(config, weights, WeightFormat(dtype, device, self.kernels, quantization),
                                      max_model_len, self.group)
        self.compiled_prefill = self.model.compiled_prefill
        self.kv_heads = kv_heads_per_rank(config, self.group.size)
        # per layer [2, kv_heads, num_blocks, block_size, head_dim] (int8: a QuantizedKV, with its scales)
        self.kv_layers: list = []
        self.kv_pool = torch.empty(0)               # every layer's values (int8: kv_scales holds the scales)
        self.kv_scales: torch.Tensor | None = None  # int8: [layers, 2, kv_heads, num_blocks, block_size] bf16
        self.block_size = 0
        # every layer in one kernel call per step (built with the pool) where all its linears are packed;
        # ``use_decoder_call = False`` keeps the Python layer loop over the same kernels
        self.decoder_call: cpu_kernels.DecoderLayers | None = None
        self.use_decoder_call = True
        self.forward_seconds = self.last_forward_seconds = 0.0   # time in forward passes, and steps run
        self.steps = 0
        # rank 0 of a group: time in collectives during decode-only steps (every row a one-token decode), and
        # those steps (bench parallel's collective time per decode step)
        self.decode_collective_seconds = 0.0
        self.decode_steps = 0

    @property
    def layers(self):
        return self.model.decoders

    @property
    def lm_head(self):
        return self.model.lm_head

    def weight_bytes(self) -> int:
        """Bytes of every weight this rank keeps."""
        return self.model.weight_bytes()

    # ---- KV pool -------------------------------------------------------
    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block on this rank (its KV heads only)."""
        c = self.config
        return block_size * kv_bytes_per_token(c.num_layers, self.kv_heads, c.head_dim,
                                               torch.finfo(self.dtype).bits // 8, self.kv_cache_dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> int:
        """Allocate this rank's pool; returns its size in bytes."""
        c = self.config
        shape = (c.num_layers, 2, self.kv_heads, num_blocks, block_size, c.head_dim)
        if self.kv_cache_dtype == "int8":
            pool, scales = kv_quant.allocate(*shape[:1], *shape[2:], self.device, cpu_kernels.huge_page_zeros)
            self.kv_scales = scales
            self.kv_layers = [kv_quant.QuantizedKV(pool[i], scales[i]) for i in range(c.num_layers)]
        else:
            if self.device.type == "cpu":
                pool = cpu_kernels.huge_page_zeros(shape, self.dtype)
            else:
                pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.kv_layers = [pool[i] for i in range(c.num_layers)]
        self.block_size = block_size
        self.kv_pool = pool
        self.decoder_call = None
        linears = [layer.linears() for layer in self.model.decoders]
        # with more ranks the call sums across them itself, over the shared-memory channel (when there is one)
        comm = self.peers.kernel_comm if self.peers is not None else None
        piece = Linear.PIECE
        if comm is not None:
            # MLP pieces of at most a slot's rows, so the row-parallel GEMMs write their parts straight into the
            # rank's slot (a GEMM row does not depend on the rows beside it: the same bits). The layer loop takes
            # the same pieces, so both paths make the same rounds in the same order.
            piece = max(1, min(Linear.PIECE, comm.slot_bytes // (4 * c.hidden_size)))
            for layer in self.model.decoders:
                layer.piece_rows = piece
        if ((self.group.size == 1 or comm is not None) and self.kernels is not None and self.compiled_prefill
                and all(m.panels is not None and not getattr(m, "padded", False) for ls in linears for m in ls.values())):
            weights = [dict(ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                            **{n: m.panels for n, m in ls.items()}, **layer.biases(),
                            **{n + "_scale": getattr(m, "scales", None) for n, m in ls.items()})
                       for layer, ls in zip(self.model.decoders, linears)]
            rotary = self.model.rotary
            self.decoder_call = cpu_kernels.DecoderLayers(self.kernels, weights, self.kv_layers, rotary.cos,
                                                          rotary.sin, self.config.num_heads // self.group.size,
                                                          self.config.rms_norm_eps, self.config.head_dim ** -0.5,
                                                          piece, comm)
        return self.kv_bytes()

    def kv_bytes(self) -> int:
        """Bytes of this rank's pool (values and, with int8, scales)."""
        scales = 0 if self.kv_scales is None else self.kv_scales.numel() * self.kv_scales.element_size()
        return self.kv_pool.numel() * self.kv_pool.element_size() + scales

    # ---- forward -------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: StepBatch, all_logits: bool = False) -> torch.Tensor:
        """Run one step; returns fp32 logits for ``batch.logits_rows`` (or every row)."""
        started = time.perf_counter()
        collectives = self.peers.collective_seconds if self.peers is not None else 0.0
        if self.peers is not None:
            self.peers.broadcast(("forward", batch, all_logits))
        logits = self.run(batch, all_logits)
        self.last_forward_seconds = time.perf_counter() - started
        self.forward_seconds += self.last_forward_seconds
        self.steps += 1
        if self.peers is not None and batch.input_ids.shape[0] == len(batch.sample_order):   # decodes only
            self.decode_collective_seconds += self.peers.collective_seconds - collectives
            self.decode_steps += 1
        assert logits is not None
        return logits

    def run(self, batch: StepBatch, all_logits: bool) -> torch.Tensor | None:
        """This rank's forward pass over ``batch`` (rank 0: the logits; other ranks: None)."""
        x = self.model.embed_tokens(batch.input_ids)
        # In the last layer only the sampled rows go on past the KV write: the others' output would feed
        # nothing but logits nobody reads (for a prompt chunk, all its rows but the last).
        trim = not all_logits and batch.logits_rows.shape[0] < x.shape[0]
        keep = batch.logits_rows if trim else None
        if (self.decoder_call is not None and self.use_decoder_call and not batch.long_spans and batch.lora is None
                and all(grp.q_len == 1 for grp in batch.groups)):
            x = (self.decoder_call(x, batch, keep) if self.peers is None
                 else self.peers.run_kernels(self.decoder_call, x, batch, keep))
        else:
            x = self.model.decoder_layers(x, self.kv_layers, batch, keep)
        if not all_logits and not trim:
            x = x[batch.logits_rows]
        return self.model.logits(x)

    # ---- the other ranks -------------------------------------------------
    def keepalive(self) -> None:
        """Rank 0, idle: tell the other ranks it is alive once a quarter of the collective timeout has gone by
        without a message (their wait for the next batch is bounded by that timeout)."""
        if self.peers is not None and time.monotonic() - self.peers.last_message > self.peers.config.timeout_s / 4:
            self.peers.broadcast(("keepalive",))

    def stop_followers(self) -> None:
        """Rank 0: release the other ranks (they return from ``follow``)."""
        if self.peers is not None and self.peers.broken is None:
            self.peers.broadcast(("stop",))

    @torch.inference_mode()
    def follow(self) -> None:
        """A rank other than 0: run every forward pass rank 0 sends, until it says stop (or a collective fails:
        RankFailure)."""
        assert self.peers is not None, "only a rank of a group follows"
        while True:
            message = self.peers.broadcast()
            if message[0] == "stop":
                return
            if message[0] == "forward":
                _, batch, all_logits = message
                started = time.perf_counter()
                self.run(batch, all_logits)
                self.forward_seconds += time.perf_counter() - started
                self.steps += 1
