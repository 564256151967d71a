"""LLMEngine: the step loop tying scheduler, KV cache, model and sampler together.

Thread safety: ``add_request``, ``abort_request``, ``stats`` and ``step`` take
one lock, so a server may call ``step()`` from a worker thread and
add/abort from its event loop. ``abort_request`` frees the request's blocks
before it returns; its final output (finish_reason "abort") comes with the
next ``step()``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..contract.levers import parse_kv_cache_dtype
from . import continuation as cont_
from .batch import SeqChunk, StepBatch, build_batch
from .distributed import ParallelConfig, ProcessGroup, RankFailure, check_identities, checkpoint_identity, join
from .dtype_choice import choose_dtype
from .kv_cache_manager import KVCacheManager
from .kv_offload import BlockRecord, KVOffload, KVOffloadConfig, PoolIO, TierCounters
from .layers.lora import LoRARows
from .loader import load_config
from .lora_adapter import LoRAAdapter
from .lora_manager import LoRAConfig, LoRAManager, UnknownAdapter
from .model import split_error
from .quantization import parse_quantization
from .request import Request, RequestOutput, TokenLogprob
from .sampler import sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .speculative import SpecDecodeStats, SpeculativeConfig, Speculator
from .structured.spec import StructuredOutputError, StructuredOutputSpec
from .tokenizer import IncrementalDetokenizer
from .worker import RankSetup, load_rank, rank_threads, spawn_local_ranks, stop_ranks

if TYPE_CHECKING:
    from .structured.compiler import CompiledGrammar, GrammarCompiler

log = logging.getLogger("tokenfleet.engine")


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> float | None:
    """The CFS quota of this process's cpu cgroup in cores (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), as
    the kubelet (or the local pod runner) sets it from a container's CPU limit; None without one."""
    try:
        lines = Path(membership).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        try:
            if controllers == "":                                          # v2: one unified hierarchy
                quota, period = (Path(root) / rel / "cpu.max").read_text().split()
                return None if quota == "max" else int(quota) / int(period)
            if "cpu" in controllers.split(","):
                base = Path(root) / controllers / rel
                quota_us = int((base / "cpu.cfs_quota_us").read_text())
                return None if quota_us < 0 else quota_us / int((base / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
    return None


def usable_cpus() -> int:
    """Cores this process may use: those it may run on, capped by its cgroup's CPU quota (whole cores, >= 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return cores if limit is None else max(1, min(cores, int(limit)))


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
    quantization: str = "none"          # "int8": weight-only int8 linears, quantized at load (quantization.py)
    kv_cache_dtype: str = "auto"        # "int8": the KV cache in int8, a scale per token and KV head (kv_quant.py)
    # size the KV budget as this fraction of the device's memory (CPU: the memory limit), less weights and
    # headroom (contract/kv_budget.py), instead of kv_cache_bytes
    memory_utilization: float | None = None
    device_memory_bytes: int | None = None   # the memory memory_utilization takes a fraction of (None: measured)
    speculative: SpeculativeConfig | None = None    # speculative decoding (speculative.py); None: off
    load_format: str = "mmap"           # loader.py: mmap (views of the mapped files) or read (copied first)
    parallel: ParallelConfig | None = None   # tensor parallelism over processes (distributed.py); None: one rank
    model_revision: str | None = None   # the checkpoint's revision every rank must share (None: a fingerprint)
    structured_output_timeout_s: float = 10.0   # a grammar not compiled by then: the request is refused
    structured_output_cache_size: int = 256     # compiled grammars kept (least recently used dropped)
    lora: LoRAConfig | None = None      # LoRA adapters (lora_manager.py); None: adapters off
    served_model_names: tuple[str, ...] = ()   # names the base model goes by (adapters' base must be one)
    kv_offload: KVOffloadConfig | None = None   # host-memory and disk tiers of the prefix cache (kv_offload.py)


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
    spec_decode: SpecDecodeStats | None = None                # None: speculative decoding is off
    lora: LoRAStats | None = None                             # None: LoRA adapters are off
    kv_offload: dict[str, TierCounters] | None = None         # per tier (accelerator, host, disk); None: no offload


@dataclass
class LoRAStats:
    """vLLM's lora_requests_info (adapters of running and waiting requests, max_lora) and each adapter's
    tokens (prompt, generated) since it was first loaded."""
    running: list[str]
    waiting: list[str]
    max_lora: int
    adapters: list[str]                                       # servable now
    in_memory: list[str]                                      # of those, loaded (not to be read again first)
    tokens: dict[str, tuple[int, int]]
    roots: dict[str, str] = field(default_factory=dict)       # adapter -> hex root its new requests' blocks chain from


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        parallel = config.parallel or ParallelConfig()
        parallel.check()
        if config.lora is not None and parallel.world_size > 1:
            raise ValueError("LoRA adapters (--enable-lora) with --tensor-parallel-size > 1 are not implemented yet")
        device = torch.device(config.device if config.device != "auto" else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and parallel.world_size > 1:
            device = torch.device("cuda", 0)               # local rank 0 of the leader host
        threads = config.num_threads or rank_threads(parallel, usable_cpus())
        if device.type == "cpu":
            torch.set_num_threads(threads)
        self.quantization = parse_quantization(config.quantization)
        self.kv_cache_dtype = parse_kv_cache_dtype(config.kv_cache_dtype, "kv_cache_dtype")
        model_config = load_config(config.model)
        self.dtype_choice = choose_dtype(config.dtype, device, model_config, config.cpu_kernels, self.quantization)
        self.device, self.dtype = device, self.dtype_choice.dtype
        self.group: ProcessGroup | None = None
        self.followers: list = []              # this host's other ranks (worker processes)
        if parallel.world_size > 1:
            self._join(parallel, model_config, threads)
        setup = RankSetup(self.dtype, self.quantization, config.cpu_kernels, config.max_model_len,
                          config.kv_cache_bytes, config.block_size, config.load_format, self.kv_cache_dtype,
                          config.memory_utilization, config.device_memory_bytes)
        self.startup_marks: dict[str, float] = {}                        # server/startup.py reports them
        try:
            if self.group is not None:
                self.group.broadcast(setup)
            loaded = load_rank(setup, config.model, device, self.group, config.load_tokenizer, self.startup_marks)
            if self.group is not None:
                self.group.barrier()
        except BaseException:
            self.close()
            raise
        self.runner, self.model_config, self.tokenizer = loaded.runner, loaded.config, loaded.tokenizer
        self.max_model_len, num_blocks, self.kv_cache_bytes = loaded.max_model_len, loaded.num_blocks, loaded.kv_cache_bytes
        if config.max_model_len is not None and -(-self.max_model_len // config.block_size) > num_blocks:
            self.close()
            raise ValueError(
                f"--max-model-len {self.max_model_len} (engine.maxModelLen) does not fit the KV cache once: it holds "
                f"{num_blocks * config.block_size} tokens ({self.kv_cache_bytes >> 20} MiB per rank, KV cache dtype "
                f"{self.kv_cache_dtype}); raise the budget (--kv-cache-memory-bytes / --kv-cache-mb / "
                "--gpu-memory-utilization; engine.kvCacheMemory / acceleratorMemoryUtilization), use "
                "--kv-cache-dtype int8, or lower --max-model-len")
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.offload: KVOffload | None = None
        if config.kv_offload is not None and config.kv_offload.enabled:
            self._attach_offload(config.kv_offload, parallel)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.enable_chunked_prefill,
                                                   config.lora.max_loras if config.lora else 0), self.kv)
        self.lora: LoRAManager | None = None
        if config.lora is not None:
            names = {Path(str(config.model).rstrip("/")).name, *config.served_model_names}
            self.lora = LoRAManager(config.lora, self.model_config, self.dtype, self.device, names)
        self.speculator = (Speculator(config.speculative, self.runner, config.model, num_blocks, config.block_size,
                                      self.max_model_len, config.cpu_kernels) if config.speculative else None)
        eos = set(self.model_config.eos_token_ids)
        eos_id = self.tokenizer.token_id(self.tokenizer.eos_token) if self.tokenizer is not None else None
        if eos_id is not None:
            eos.add(eos_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.requests: dict[str, Request] = {}
        self.aborted: list[Request] = []
        self.generation_tokens = 0
        self.finished_counts: dict[str, int] = {}
        self.lock = threading.RLock()
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_compiler_lock = threading.Lock()
        self.startup_marks["kernels_ready"] = time.monotonic()

    def _attach_offload(self, offload: KVOffloadConfig, parallel: ParallelConfig) -> None:
        from .identity import engine_identity

        if parallel.world_size > 1:
            raise ValueError("--kv-offload-host-mb / --kv-offload-disk-path with --tensor-parallel-size > 1 are not "
                             "implemented yet: each rank would need its own tier of its KV shard")
        if not self.config.enable_prefix_caching:
            raise ValueError("KV offload tiers hold prefix-cache blocks: they need prefix caching "
                             "(drop --no-prefix-caching)")
        if self.config.lora is not None and offload.disk_path is not None:
            raise ValueError("--kv-offload-disk-path with --enable-lora is not implemented yet (an unloaded "
                             "adapter's blocks on disk could not be forgotten)")
        identity = engine_identity(self, self.config.model_revision)
        identity["kv_cache_dtype"] = getattr(self.config, "kv_cache_dtype", "auto")
        identity["tensor_parallel"] = [parallel.node_rank, parallel.world_size]
        tensors = [self.runner.kv_pool]
        scales = getattr(self.runner, "kv_scales", None)         # a quantized KV cache's scales
        if scales is not None:
            tensors.append(scales)
        self.offload = KVOffload(offload, PoolIO(tensors), identity)
        self.kv.attach_offload(self.offload)

    def _join(self, parallel: ParallelConfig, model_config, threads: int) -> None:
        """Start this host's other ranks, form the group as rank 0 and check every rank's checkpoint."""
        why = split_error(model_config, parallel.tensor_parallel_size)
        if why is not None:
            raise ValueError(f"--tensor-parallel-size {parallel.tensor_parallel_size}: {why}")
        identity = checkpoint_identity(self.config.model, self.config.model_revision)
        if parallel.key is None and parallel.nnodes == 1:      # every rank is a child of this process
            parallel = dataclasses.replace(parallel, key=secrets.token_bytes(32))
        if parallel.node_rank == 0:
            self.followers = spawn_local_ranks(parallel, self.config.model, self.config.model_revision,
                                               range(1, parallel.local_ranks), threads, self.device.type)
        try:
            self.group = join(parallel, 0, self.device)
            check_identities(self.group, identity, self.config.model)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the other ranks and wait for this host's worker processes (tensor parallelism; else a no-op)."""
        offload = getattr(self, "offload", None)
        if offload is not None:
            offload.close()
        group, self.group = self.group, None
        if group is not None:
            runner = getattr(self, "runner", None)
            try:
                if runner is not None:
                    runner.stop_followers()
            except RankFailure:
                pass
            group.close()
        followers, self.followers = self.followers, []
        stop_ranks(followers, timeout_s=10.0 if group is not None and group.broken is None else 0.1)

    def keepalive(self) -> None:
        """Called while idle: keeps the other ranks' wait for the next step bounded (RankFailure when one is
        gone)."""
        with self.lock:
            self.runner.keepalive()

    @classmethod
    def from_pretrained(cls, model: str | Path, **kwargs) -> LLMEngine:
        return cls(EngineConfig(model=str(model), **kwargs))

    # ---- structured outputs ------------------------------------------------
    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Built on first use (llguidance reads the checkpoint's tokenizer.json)."""
        with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                from .structured.compiler import GrammarCompiler

                tokenizer_file = Path(self.config.model) / "tokenizer.json"
                if self.tokenizer is None or not tokenizer_file.is_file():
                    raise StructuredOutputError("response_format", "structured outputs need the model's tokenizer.json")
                self._grammar_compiler = GrammarCompiler(
                    str(tokenizer_file), self.model_config.vocab_size, self.eos_token_ids,
                    timeout_s=self.config.structured_output_timeout_s,
                    cache_size=self.config.structured_output_cache_size)
            return self._grammar_compiler

    def compile_structured(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """Compile (or find cached) the grammar of ``spec``; waits at most ``structured_output_timeout_s``.
        Call it off the step thread and pass the result to ``add_request``: a compile never holds up a step.
        Raises :class:`StructuredOutputError` (a ValueError naming the request field) for a bad spec."""
        return self.grammar_compiler.compile(spec)

    # ---- requests --------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, continuation: cont_.Continuation | None = None,
                    grammar: CompiledGrammar | None = None, share_prompt_with: str | None = None,
                    lora: str | None = None, lora_read: LoRAAdapter | None = None) -> None:
        """Queue a request. ``continuation``: output another replica already delivered for it, taken as this
        request's own (``continuation.py``); a structured output's grammar is advanced over it. ``grammar``:
        ``compile_structured(params.structured)`` done beforehand (else it is compiled here). ``share_prompt_with``:
        the id of a request with the same prompt (n > 1): this one starts once that one has computed the prompt,
        and takes its full blocks from the prefix cache. ``lora``: the name of a loaded or registered LoRA adapter
        to run it with (``UnknownAdapter`` if there is none of that name); ``lora_read``: ``prepare_lora(lora)``
        done beforehand, off the step thread (else a registered adapter that is not in memory is read here, before
        the lock is taken)."""
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
        if continuation is not None:
            cont_.check(continuation, n, params.max_tokens, vocab, self.max_model_len)
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:
            raise ValueError(f"sampling parameter 'logit_bias' has token id {params.logit_bias[-1][0]}, outside this "
                             f"model's vocabulary [0, {vocab})")
        if lora is not None and (self.lora is None or not self.lora.servable(lora)):
            raise UnknownAdapter(lora)
        if lora is not None and lora_read is None:
            lora_read = self.prepare_lora(lora)
        if params.structured is not None and (grammar is None or grammar.spec.key != params.structured.key):
            grammar = self.compile_structured(params.structured)
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids, lora=lora)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                     params.skip_special_tokens)
        if continuation is not None:
            cont_.apply(req, continuation, vocab)
        if grammar is not None:
            req.grammar = grammar.new_matcher()
            if req.output_token_ids and not req.grammar.consume_tokens(req.output_token_ids):
                raise StructuredOutputError("continuation", "the delivered output does not match the request's "
                                                            "structured output")
        with self.lock:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            if share_prompt_with is not None:
                parent = self.requests.get(share_prompt_with)
                if parent is not None and parent.prompt_token_ids == req.prompt_token_ids:
                    req.prompt_parent = parent
            if lora is not None:
                assert self.lora is not None
                req.adapter = self.lora.acquire_under(self.lock, lora, lora_read)
                req.root_hash = req.adapter.root_hash
            self.requests[request_id] = req
            self.scheduler.add(req)
            if self.offload is not None:         # start reading its disk-tier blocks while it waits
                req.update_block_hashes(self.kv.block_size)
                pool, hashes = self.kv.pool, req.block_hashes
                i = 0
                while i < len(hashes) and pool.lookup(hashes[i]) is not None:
                    i += 1
                self.offload.prefetch(hashes[i:])

    def prepare_lora(self, name: str) -> LoRAAdapter | None:
        """Read the adapter ``name`` if a request for it would have to (it is registered but not in memory):
        pass the result to ``add_request`` as ``lora_read``. Call it off the step thread; takes no lock while it
        reads."""
        if self.lora is None:
            raise UnknownAdapter(name)
        with self.lock:
            directory = self.lora.to_read(name)
        return None if directory is None else self.lora.read(name, directory)

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
        """One engine step: schedule -> run -> sample -> update; returns the outputs of the requests it moved."""
        with self.lock:
            started = time.perf_counter()
            outputs = self._take_aborted()
            scheduled = self._schedule()
            if not scheduled:
                return outputs
            batch, rows = self._prepare(scheduled)
            logits = self.runner.forward(batch)
            return outputs + self._sample_and_update(scheduled, rows, logits, started)

    def _take_aborted(self) -> list[RequestOutput]:
        outputs = [self._output(r) for r in self.aborted]
        self.aborted.clear()
        return outputs

    def _schedule(self) -> list[tuple[Request, int]]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        return self.scheduler.schedule()

    def _prepare(self, scheduled: list[tuple[Request, int]]) -> tuple[StepBatch, list[Request]]:
        """The step's batch, and the request of each logits row."""
        chunks, owners = [], []
        adapters: dict[bytes, int] = {}        # this step's LoRA adapters (each version by its root), by index
        held: list[LoRAAdapter] = []
        for r, n in scheduled:
            start, table = r.num_computed_tokens, self.kv.block_table(r.request_id)
            a = -1
            if r.adapter is not None:
                a = adapters.setdefault(r.root_hash, len(adapters))
                if a == len(held):
                    held.append(r.adapter)
            if r.spec_token_ids:     # verification: the last token and each draft as a decode row of its own
                for i, token in enumerate([r.all_token_ids[start]] + r.spec_token_ids):
                    chunks.append(SeqChunk([token], start + i, table, True, a))
                    owners.append(r)
                continue
            chunks.append(SeqChunk(r.all_token_ids[start:start + n], start, table, start + n == r.num_tokens, a))
            owners.append(r)
        batch = build_batch(chunks, self.kv.block_size, self.device, self.runner.compiled_prefill)
        if batch.row_adapters is not None:
            assert self.lora is not None
            batch.lora = LoRARows(batch.row_adapters, held, self.device)
        return batch, [owners[i] for i in batch.sample_order]

    def _sample_and_update(self, scheduled: list[tuple[Request, int]], rows: list[Request], logits: torch.Tensor,
                           started: float) -> list[RequestOutput]:
        """Sample (or verify drafts) from the step's logits and append the tokens; the moved requests' outputs."""
        forward_seconds = self.runner.last_forward_seconds
        for req, n in scheduled:
            req.num_computed_tokens += n
        speculated = [r for r, _ in scheduled if r.spec_token_ids]
        plain = [i for i, r in enumerate(rows) if not r.spec_token_ids]
        to_sample = [rows[i] for i in plain]
        if to_sample:
            sampled = self._sample_isolated(logits[plain] if speculated else logits, to_sample)
            for req, token, lp in sampled:
                self._append_isolated(req, token, lp)
        if speculated:
            assert self.speculator is not None
            for req in speculated:
                self._verify_isolated(req, logits[[i for i, r in enumerate(rows) if r is req]])
            to_sample = to_sample + speculated
        if self.speculator is not None:
            self.speculator.step_done(bool(speculated), time.perf_counter() - started, forward_seconds)
        return [self._output(req) for req in to_sample]

    # ---- per-request failure isolation -----------------------------------
    # An exception raised while sampling or appending one request's token fails
    # that request alone (finish_reason "error", its blocks freed); the rest of
    # the batch goes on. Anything else in step() (scheduling, the forward pass)
    # cannot be pinned on one request and propagates: the engine is broken.
    def _sample_isolated(self, logits: torch.Tensor, reqs: list[Request]
                         ) -> list[tuple[Request, int, TokenLogprob | None]]:
        """(request, token, logprob) for each request that could be sampled; the others are failed."""
        try:
            tokens, logprobs = sample(logits, reqs)
            return list(zip(reqs, tokens, logprobs))
        except Exception:  # noqa: BLE001 - find the request(s) at fault: sample each row alone
            pass           # (sample() draws nothing before every row checks out, so no generator moved)
        out: list[tuple[Request, int, TokenLogprob | None]] = []
        for i, req in enumerate(reqs):
            try:
                tokens, logprobs = sample(logits[i:i + 1], [req])
                out.append((req, tokens[0], logprobs[0]))
            except Exception as e:  # noqa: BLE001 - this request alone is failed
                self._fail(req, e)
        return out

    def _verify_isolated(self, req: Request, logits: torch.Tensor) -> None:
        """Accept what the target's logits confirm of a request's drafts (one failure fails it alone)."""
        assert self.speculator is not None
        try:
            result = self.speculator.verify(req, logits)
            for i, token in enumerate(result.tokens):
                self._append(req, token, result.logprobs[i] if result.logprobs else None)
                if req.is_finished:
                    break
        except Exception as e:  # noqa: BLE001 - this request alone is failed
            self._fail(req, e)

    def _append_isolated(self, req: Request, token: int, lp: TokenLogprob | None) -> None:
        try:
            self._append(req, token, lp)
        except Exception as e:  # noqa: BLE001 - this request alone is failed
            self._fail(req, e)

    def _fail(self, req: Request, error: Exception) -> None:
        if req.grammar is not None and req.grammar.is_error():     # the client's grammar hit llguidance's limits
            log.warning("request %s stopped by its grammar: %s", req.request_id, req.grammar.get_error())
            req.error_param = req.params.structured.param if req.params.structured is not None else None
        else:
            log.error("request %s failed in the engine: %s: %s", req.request_id, type(error).__name__, error,
                      exc_info=error)
        req.error = f"{type(error).__name__}: {error}"
        if not req.is_finished:
            self.scheduler.finish(req, "error")
        req.finish_reason = "error"

    def _append(self, req: Request, token: int, lp) -> None:
        if req.grammar is not None and token not in req.eos_token_ids and not req.grammar.consume_token(token):
            raise ValueError(f"the grammar rejected token {token}: {req.grammar.get_error()}")
        req.append_token(token)
        self.generation_tokens += 1
        if req.lora is not None and self.lora is not None:
            self.lora.tokens[req.lora].generation += 1
        if lp is not None:
            req.pending_logprobs.append(lp)
        p = req.params
        reason = None
        may_stop = len(req.output_token_ids) > p.min_tokens      # min_tokens: nothing stops the output before
        if token in req.eos_token_ids:
            reason = "stop"
        elif token in p.stop_token_ids and may_stop:
            reason, req.stop_reason = "stop", token
        elif req.grammar is not None and req.grammar.is_stopped():     # complete: only EOS could follow
            reason = "stop"
        special = self.tokenizer.special_token_ids if self.tokenizer is not None else ()
        if req.detokenizer is not None and not (reason and token in special):
            before = len(req.output_text)
            req.output_text += req.detokenizer.push([token])
            if p.stop and reason is None and may_stop:
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
            stop_reason=req.stop_reason, error=req.error, error_param=req.error_param)
        req.pending_token_ids, req.pending_logprobs = [], []
        if finished:
            self.requests.pop(req.request_id, None)
            if req.lora is not None and self.lora is not None and self.lora.release(req.lora, req.num_prompt_tokens):
                for root in self.lora.take_stale_roots():   # the adapter is gone: its KV is stale
                    self._forget_chains(root)
            reason = req.finish_reason or "unknown"
            self.finished_counts[reason] = self.finished_counts.get(reason, 0) + 1
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
                generation_tokens=self.generation_tokens, finished=dict(self.finished_counts),
                spec_decode=self.speculator.stats.copy() if self.speculator is not None else None,
                lora=self._lora_stats(),
                kv_offload=self.offload.snapshot() if self.offload is not None else None)

    def _lora_stats(self) -> LoRAStats | None:
        if self.lora is None:
            return None
        running, waiting = self.lora_activity()
        return LoRAStats(running, waiting, self.lora.config.max_loras, self.lora.names, list(self.lora.loaded),
                         {n: (t.prompt, t.generation) for n, t in self.lora.tokens.items()},
                         {n: self.lora.root_of[n].hex() for n in self.lora.names if n in self.lora.root_of})

    # ---- LoRA adapters ----------------------------------------------------
    def load_lora_adapter(self, name: str, path: str | Path) -> float:
        """Load (or reload) adapter ``name`` from the PEFT directory ``path``; returns the seconds it took.
        Refused with ``lora_adapter.AdapterError`` (file and field named) or ValueError."""
        if self.lora is None:
            raise ValueError("LoRA adapters are off: start the engine with --enable-lora")
        adapter = self.lora.read(name, path)     # the files are read and checked before the lock is taken
        with self.lock:
            self.lora.install(adapter)
            return adapter.read_seconds

    def register_lora_adapter(self, name: str, path: str | Path) -> None:
        """Make adapter ``name`` servable from ``path``, read on its first request: its files are checked now
        (``lora_adapter.AdapterError``, ValueError) but not kept in memory."""
        if self.lora is None:
            raise ValueError("LoRA adapters are off: start the engine with --enable-lora")
        adapter = self.lora.read(name, path)
        with self.lock:
            self.lora.register_read(adapter)

    def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving ``name``: True when it is gone now, False when it goes as its running requests finish
        (new requests for it are refused from now on). ``UnknownAdapter`` if it is not served."""
        if self.lora is None:
            raise UnknownAdapter(name)
        with self.lock:
            gone = self.lora.unload(name)
            for root in self.lora.take_stale_roots():
                self._forget_chains(root)
            return gone

    def lora_adapters(self) -> list[str]:
        with self.lock:
            return self.lora.names if self.lora is not None else []

    def lora_activity(self) -> tuple[list[str], list[str]]:
        """Adapters of the running and of the waiting requests (vLLM's lora_requests_info)."""
        with self.lock:
            running = sorted({r.lora for r in self.scheduler.running if r.lora})
            waiting = sorted({r.lora for r in self.scheduler.waiting if r.lora})
            return running, waiting

    def _forget_chains(self, root: bytes) -> None:
        self.kv.pool.forget_chains(root)
        if self.offload is not None:
            self.offload.forget(self.offload.chains_from(root))

    def cached_block_hashes(self) -> list[str]:
        """Hex sha256 chain hashes of every cached full block (spec in block_pool.py)."""
        with self.lock:
            return self.kv.pool.cached_hashes()

    def cached_block_hashes_by_tier(self) -> dict[str, list[str]]:
        """Hex hashes per tier: ``accelerator`` (the pool), ``host`` and ``disk`` (empty without that tier)."""
        with self.lock:
            acc = self.kv.pool.cached_hashes()
            host = self.offload.host_hashes() if self.offload is not None else []
        disk = self.offload.disk_hashes() if self.offload is not None else []
        return {"accelerator": acc, "host": host, "disk": disk}

    def flush_kv_to_disk(self, max_blocks: int, timeout_s: float = 30.0) -> int:
        """Write the hottest cached blocks of the accelerator and host tiers (up to ``max_blocks``) to the disk
        tier, and wait for the writes: the store a replacement replica starts from. Returns the blocks written."""
        offload = self.offload
        if offload is None or offload.disk is None or not offload.disk.enabled:
            return 0
        with self.lock:
            pool = self.kv.pool
            chosen = [b for b in pool.hottest_cached() if pool.block_origin[b] is not None][:max_blocks]
            chosen = [b for b in chosen if pool.block_hash[b] not in offload.disk]
            records = []
            if chosen:
                data = offload.io.read(chosen)
                for i, b in enumerate(chosen):
                    origin = pool.block_origin[b]
                    assert origin is not None and pool.block_hash[b] is not None
                    records.append(BlockRecord(pool.block_hash[b], origin[0], origin[1], data[i]))  # type: ignore[arg-type]
            if offload.host is not None and len(records) < max_blocks:
                hot = [h for h in reversed(offload.host.entries) if h not in offload.disk][:max_blocks - len(records)]
                if hot:
                    recs, data = offload.host.get(hot)
                    records += [BlockRecord(r.hash, r.parent, r.tokens, data[i]) for i, r in enumerate(recs)]
            queued = offload.flush_to_disk(records)
        offload.disk.wait_written(timeout_s)
        return queued

    def load_from_disk_tier(self, max_blocks: int) -> int:
        """Copy the disk tier's most recently written blocks (up to ``max_blocks``, and as many as the pool has free)
        into the accelerator tier as free cached blocks, each after its parent: a replica that starts on its
        predecessor's disk tier hits at accelerator speed from its first request (warm restart). Blocks whose
        chain does not reach the root through loaded or cached blocks are left on disk. Refused (ValueError)
        while requests run; returns the blocks loaded."""
        from .block_pool import ROOT_HASH

        offload = self.offload
        if offload is None or offload.disk is None or not offload.disk.enabled:
            return 0
        with self.lock:
            if self.requests:
                raise ValueError("the disk tier is loaded into the accelerator only while the engine is idle")
            pool = self.kv.pool
            limit = min(max_blocks, pool.num_free)
            candidates = list(reversed(offload.disk.hashes()))[:max(limit, 0)]
            records = {}
            for h in candidates:
                r = offload.disk.load(h)
                if r is not None and r.data is not None:
                    records[h] = r
            order: list[BlockRecord] = []
            placed: set[bytes] = set()
            for h in candidates:                 # each block after its parents, which must reach the root
                chain: list[BlockRecord] = []
                cur, reaches = h, False
                while len(chain) <= len(records):
                    if cur in placed or cur in pool.cached:
                        reaches = True
                        break
                    r = records.get(cur)
                    if r is None:
                        break
                    chain.append(r)
                    if r.parent == ROOT_HASH:
                        reaches = True
                        break
                    cur = r.parent
                if reaches:
                    for r in reversed(chain):
                        placed.add(r.hash)
                        order.append(r)
            order = order[:limit]
            if not order:
                return 0
            blocks = pool.allocate(len(order))
            offload.io.write(blocks, torch.stack([r.data for r in order]))  # type: ignore[misc]
            for b, r in zip(blocks, order):
                pool.cache(b, r.hash, (r.parent, r.tokens))
            pool.release(blocks)
            return len(order)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (e.g. between benchmark runs, so none reuses the last one's prompts), the
        host tier's blocks with it and the disk tier's index (its files stay). Refused, returning False, while
        requests are unfinished, as their blocks are in use."""
        with self.lock:
            done = not self.requests and self.kv.pool.reset_cache()
            if done and self.offload is not None:
                self.offload.reset()
            return done

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
