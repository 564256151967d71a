"""Continuous batching under a per-step token budget.

Each step: running requests first (in admission order), each asks for the
tokens it still lacks (1 when decoding, a chunk when its prefill is
unfinished); when the KV pool cannot supply the blocks, the newest running
request is preempted (its blocks freed, to be recomputed later). Waiting
requests are admitted in arrival order (FCFS) only in steps without a
preemption, while the budget and ``max_num_seqs`` allow, each reusing its
longest cached prefix; a prompt longer than the remaining budget is chunked.
With ``max_loras``, a waiting request whose LoRA adapter would be one adapter
too many among the running requests waits, and those behind it may go first.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_loras: int = 0                 # distinct LoRA adapters among running requests (0: no bound)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    num_chunked_prefills: int = 0     # prefill chunks shorter than the remaining prompt
    num_steps: int = 0
    num_prompt_tokens: int = 0        # prompt tokens computed (not taken from cache)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished and free its blocks now (used for stops and aborts)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def _preempt(self) -> Request:
        victim = self.running.pop()
        self.kv.free(victim)
        victim.status = RequestStatus.WAITING
        victim.num_computed_tokens = 0
        victim.spec_token_ids.clear()
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.counters.num_preemptions += 1
        return victim

    def _count_prompt(self, req: Request, n: int) -> None:
        prompt_left = req.num_prompt_tokens - req.num_computed_tokens
        self.counters.num_prompt_tokens += max(0, min(n, prompt_left))
        if n < req.num_tokens - req.num_computed_tokens:
            self.counters.num_chunked_prefills += 1

    def schedule(self) -> list[tuple[Request, int]]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens + len(req.spec_token_ids), budget)
            del req.spec_token_ids[max(n - 1, 0):]          # draft tokens (speculative.py) fit the budget
            while not self.kv.allocate_slots(req, n):
                if req.spec_token_ids:                       # short of blocks: drop the drafts before preempting
                    n -= len(req.spec_token_ids)
                    req.spec_token_ids.clear()
                    continue
                victim = self._preempt()
                preempted = True
                if victim is req:
                    break
            else:
                self._count_prompt(req, n)
                scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            break          # req itself was preempted: it was the last running request
        if not preempted:
            adapters = {r.lora for r in self.running if r.lora}
            held_back: list[Request] = []       # waiting for a place among max_loras adapters
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                if req.waits_for_prompt:         # n > 1: a sibling computes the shared prompt first
                    break
                if (self.config.max_loras and req.lora and req.lora not in adapters
                        and len(adapters) >= self.config.max_loras):
                    held_back.append(self.waiting.popleft())
                    continue
                cached = self.kv.get_computed_blocks(req)
                num_cached = len(cached) * self.kv.block_size
                n = req.num_tokens - num_cached
                if not self.config.enable_chunked_prefill and n > budget:
                    break
                n = min(n, budget)
                if not self.kv.allocate_slots(req, n, cached):
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:    # prompt tokens only (a continued request's output may hit too)
                    req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
                    self.kv.count_admission(req)
                req.num_computed_tokens = num_cached
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                self._count_prompt(req, n)
                scheduled.append((req, n))
                budget -= n
                if req.lora:
                    adapters.add(req.lora)
            self.waiting.extendleft(reversed(held_back))
        if scheduled:
            self.counters.num_steps += 1
        return scheduled
