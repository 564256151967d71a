"""LLMEngine: the step loop tying scheduler, KV cache, model and sampler together.

Thread safety: ``add_request``, ``abort_request``, ``stats`` and ``step`` take
one lock, so a server may call ``step()`` from a worker thread and
add/abort from its event loop. ``abort_request`` frees the request's blocks
before it returns; its final output (finish_reason "abort") comes with the
next ``step()``.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .batch import SeqChunk, build_batch
from .kv_cache_manager import KVCacheManager
from .loader import load_checkpoint
from .model import LlamaModel
from .request import Request, RequestOutput, RequestStatus
from .sampler import sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .tokenizer import IncrementalDetokenizer, Tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def choose_dtype(requested: str, device: torch.device) -> torch.dtype:
    """'auto': bf16 (fp16 on pre-Ampere) on CUDA; on CPU bf16 only with native bf16 units, else fp32
    (bf16 matmuls on AVX2-only CPUs run many times slower than fp32)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {requested!r}")
        return DTYPES[requested]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int = 512 * 2**20
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_threads: int | None = None
    load_tokenizer: bool = True
    cpu_kernels: bool = True            # compiled fp32 CPU kernels (cpu_kernels.py); False: PyTorch only


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float              # 0..1, blocks held by live requests
    num_kv_blocks: int
    block_size: int
    prefix_cache_queries: int          # prompt tokens looked up (tokens)
    prefix_cache_hits: int             # prompt tokens served from cache (tokens)
    num_preemptions: int
    num_chunked_prefills: int
    num_steps: int
    prompt_tokens: int                 # prompt tokens computed
    generation_tokens: int
    finished: dict[str, int] = field(default_factory=dict)   # finish_reason -> count


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        device = torch.device(config.device if config.device != "auto" else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cpu":
            torch.set_num_threads(config.num_threads or usable_cpus())
        self.device, self.dtype = device, choose_dtype(config.dtype, device)
        ckpt = load_checkpoint(config.model, dtype=self.dtype, with_tokenizer=config.load_tokenizer)
        self.model_config, self.tokenizer = ckpt.config, ckpt.tokenizer
        self.max_model_len = min(config.max_model_len or ckpt.config.max_model_len, ckpt.config.max_model_len)
        self.model = LlamaModel(ckpt.config, ckpt.weights, self.dtype, device, self.max_model_len,
                                use_kernels=config.cpu_kernels)
        del ckpt
        if config.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {config.block_size}")
        num_blocks = config.kv_cache_bytes // self.model.kv_block_bytes(config.block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} is smaller than one KV block "
                             f"({self.model.kv_block_bytes(config.block_size)} bytes)")
        self.kv_cache_bytes = self.model.allocate_kv_cache(num_blocks, config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.enable_chunked_prefill), self.kv)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.token_id(self.tokenizer.eos_token) is not None:
            eos.add(self.tokenizer.token_id(self.tokenizer.eos_token))
        self.eos_token_ids = tuple(sorted(eos))
        self.requests: dict[str, Request] = {}
        self.aborted: list[Request] = []
        self.generation_tokens = 0
        self.finished_counts: dict[str, int] = {}
        self.lock = threading.RLock()

    @classmethod
    def from_pretrained(cls, model: str | Path, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(model=str(model), **kwargs))

    # ---- requests --------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; this model serves at most "
                             f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab})")
        worst = min(n + params.max_tokens, self.max_model_len)
        if -(-worst // self.kv.block_size) > self.kv.pool.num_blocks:
            raise ValueError(f"request needs up to {worst} tokens of KV cache; the pool holds "
                             f"{self.kv.pool.num_blocks * self.kv.block_size}")
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids)
        with self.lock:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.requests[request_id] = req
            self.scheduler.add(req)

    def abort_request(self, request_id: str) -> bool:
        with self.lock:
            req = self.requests.get(request_id)
            if req is None or req.is_finished:
                return False
            self.scheduler.finish(req, "abort")
            self.aborted.append(req)
            return True

    def has_unfinished(self) -> bool:
        with self.lock:
            return self.scheduler.has_unfinished() or bool(self.aborted)

    # ---- the step --------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self.lock:
            outputs = [self._output(r) for r in self.aborted]
            self.aborted.clear()
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return outputs
            chunks = [SeqChunk(r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens + n],
                               r.num_computed_tokens, self.kv.block_table(r.request_id),
                               r.num_computed_tokens + n == r.num_tokens) for r, n in scheduled]
            batch = build_batch(chunks, self.kv.block_size, self.device, self.model.compiled_prefill)
            logits = self.model.forward(batch)
            to_sample = [scheduled[i][0] for i in batch.sample_order]
            tokens, logprobs = sample(logits, to_sample) if to_sample else ([], [])
            for req, n in scheduled:
                req.num_computed_tokens += n
            for req, token, lp in zip(to_sample, tokens, logprobs):
                self._append(req, token, lp)
            for req in to_sample:
                outputs.append(self._output(req))
            return outputs

    def _append(self, req: Request, token: int, lp) -> None:
        req.append_token(token)
        self.generation_tokens += 1
        if lp is not None:
            req.pending_logprobs.append(lp)
        p = req.params
        reason = None
        if token in req.eos_token_ids:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, req.stop_reason = "stop", token
        if req.detokenizer is not None and not (reason and token in self.tokenizer.special_token_ids):
            before = len(req.output_text)
            req.output_text += req.detokenizer.push([token])
            if p.stop and reason is None:
                longest = max(len(s) for s in p.stop)
                window = max(0, before - longest + 1)
                hits = [(req.output_text.find(s, window), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    i, s = min(hits)
                    req.output_text = req.output_text[:i + len(s) if p.include_stop_str_in_output else i]
                    reason, req.stop_reason = "stop", s
        if reason is None and (len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(req, reason)

    def _output(self, req: Request) -> RequestOutput:
        finished = req.is_finished
        text_end = len(req.output_text)
        if not finished and req.params.stop:   # hold back what might become a stop string
            text_end = max(req.reported_text_len, text_end - max(len(s) for s in req.params.stop) + 1)
        delta = req.output_text[req.reported_text_len:text_end]
        req.reported_text_len = text_end
        out = RequestOutput(
            request_id=req.request_id, new_token_ids=req.pending_token_ids, text_delta=delta,
            finished=finished, finish_reason=req.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids), num_cached_tokens=max(req.num_cached_tokens, 0),
            logprobs=req.pending_logprobs if req.params.logprobs is not None else None,
            stop_reason=req.stop_reason)
        req.pending_token_ids, req.pending_logprobs = [], []
        if finished:
            self.requests.pop(req.request_id, None)
            self.finished_counts[req.finish_reason] = self.finished_counts.get(req.finish_reason, 0) + 1
        return out

    # ---- observability ---------------------------------------------------
    def stats(self) -> EngineStats:
        with self.lock:
            s, c = self.scheduler, self.scheduler.counters
            return EngineStats(
                num_running=len(s.running), num_waiting=len(s.waiting), kv_cache_usage=self.kv.usage,
                num_kv_blocks=self.kv.pool.num_blocks, block_size=self.kv.block_size,
                prefix_cache_queries=self.kv.stats.queries, prefix_cache_hits=self.kv.stats.hits,
                num_preemptions=c.num_preemptions, num_chunked_prefills=c.num_chunked_prefills,
                num_steps=c.num_steps, prompt_tokens=c.num_prompt_tokens,
                generation_tokens=self.generation_tokens, finished=dict(self.finished_counts))

    def cached_block_hashes(self) -> list[str]:
        """Hex sha256 chain hashes of every cached full block (spec in block_pool.py)."""
        with self.lock:
            return self.kv.pool.cached_hashes()

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (e.g. between benchmark runs, so none reuses the last one's prompts).
        Refused, returning False, while requests are unfinished, as their blocks are in use."""
        with self.lock:
            return not self.requests and self.kv.pool.reset_cache()

    # ---- offline convenience ----------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion; returns one aggregated output per prompt, in order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        results: dict[str, RequestOutput] = {}
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        while self.has_unfinished():
            for out in self.step():
                if out.request_id not in results:
                    results[out.request_id] = out
                    continue
                agg = results[out.request_id]
                agg.new_token_ids = agg.new_token_ids + out.new_token_ids
                agg.text_delta += out.text_delta
                if out.logprobs is not None:
                    agg.logprobs = (agg.logprobs or []) + out.logprobs
                agg.finished, agg.finish_reason, agg.stop_reason = out.finished, out.finish_reason, out.stop_reason
                agg.num_output_tokens, agg.num_cached_tokens = out.num_output_tokens, out.num_cached_tokens
        return [results[rid] for rid in ids]
