"""Speculative decoding: cheap proposals, verified by the target in the step's one forward pass.

Per step, before scheduling, the ``Speculator`` picks which decoding requests speculate (the rule below),
and asks the proposer for up to k draft tokens each: prompt lookup (``ngram.py``) or a small draft model
(``draft_model.py``). The scheduler gives such a request 1 + drafts tokens of the step's budget and KV
slots. The engine feeds its last token and the drafts as that many one-token decode rows of the same
sequence, each attending its own prefix: the same kernels and operands as decoding them one by one, so
every row's logits are bitwise those of plain decoding (token for token equal greedy output, fp32). After
the forward pass ``verify`` accepts a prefix of the drafts and adds the target's own token
(``rejection_sampler.py``: exact for greedy and sampled requests), and the request's computed tokens are
rolled back past the rejected drafts: their keys and values stay in the cache until those positions are
written again, and no prefix-cache hash ever covers them.

The rule: speculation pays when it raises tokens per second. With B requests decoding, a forward pass over
T tokens costing ``c(T)`` (measured on the model at start, 1 to 128 rows, ``StepCost``), and request r expected to
emit ``E_r = (1 - a_r^(k_r + 1)) / (1 - a_r)`` tokens when it verifies k_r drafts accepted at rate a_r
(its own acceptance so far, shrunk towards the engine's recent rate), k_r being the number of drafts (at
most k) that would pay best were r alone to speculate (``draft_count``: a request whose drafts hold less
often verifies one or two rather than none), the step speculates for the requests S (best
``(E_r - 1) / k_r`` first) that maximize

    (B + sum over S of (E_r - 1)) / (c(B + sum over S of k_r) + draft(S))

where draft(S) is max k_r draft-model forwards over |S| rows (0 for prompt lookup), and not at all when S empty
wins. ``base`` also counts the engine's running time per step outside the forward pass (scheduling,
sampling, proposing: a fixed cost per step that dominates for small models). Small batches are bound by
reading the weights, so extra rows are nearly free and even middling acceptance pays; as B grows each
extra row costs what a request's token costs, and only requests whose drafts are nearly always accepted
still pay. A step where no request pays runs without proposals (prompt
lookup is not even searched). Every ``PROBE_EVERY`` such steps one request speculates anyway, so the
acceptance estimates follow the workload.

Not speculated: requests with repetition, presence or frequency penalties (their logits depend on the
accepted drafts before them), requests still in prefill, and the last token of a request.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..contract.levers import MAX_SPECULATIVE_TOKENS
from . import ngram
from .batch import SeqChunk, build_batch
from .rejection_sampler import Verified, verify
from .request import Request

if TYPE_CHECKING:
    from .draft_model import DraftModel
    from .model_runner import ModelRunner

log = logging.getLogger("tokenfleet.engine")

METHODS = ("ngram", "draft")
PRIOR_ACCEPTANCE = 0.6      # the engine's acceptance rate before it has verified anything
PRIOR_WEIGHT = 4.0          # a request's own rate counts as this many draft tokens of the engine's rate
ENGINE_RATE_DECAY = 0.05    # weight of one verification in the engine's running acceptance rate
PROBE_EVERY = 32
OVERHEAD_DECAY = 0.1        # weight of one step in the running time per step outside the forward pass


class SpeculativeConfigError(ValueError):
    """A speculative-decoding setting out of range; the message names the setting (``field``)."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str                          # "ngram" (prompt lookup) or "draft" (draft_model)
    num_speculative_tokens: int = 4      # k: drafts proposed per request and step, at most
    draft_model: str | None = None       # checkpoint directory of the draft model (method "draft")
    prompt_lookup_min: int = 2           # n-gram sizes prompt lookup matches (method "ngram")
    prompt_lookup_max: int = 4
    adaptive: bool = True                # False: speculate whenever there are drafts (no cost rule)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> SpeculativeConfigError:
            return SpeculativeConfigError(f"{name} {why}, got {getattr(self, name)!r}", name)
        if self.method not in METHODS:
            raise bad("method", f"must be one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise bad("num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.method == "draft" and not self.draft_model:
            raise bad("draft_model", "is required by method draft")
        if self.method == "ngram" and self.draft_model:
            raise bad("draft_model", "is only used by method draft")
        if not (isinstance(self.prompt_lookup_min, int) and 1 <= self.prompt_lookup_min <= 64):
            raise bad("prompt_lookup_min", "must be an integer in [1, 64]")
        if not (isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_min <= self.prompt_lookup_max <= 64):
            raise bad("prompt_lookup_max", "must be an integer in [prompt_lookup_min, 64]")


@dataclass
class SpecDecodeStats:
    """Cumulative counters (vLLM's spec_decode metrics, plus the rule's decisions)."""
    num_speculative_tokens: int
    num_drafts: int = 0                  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)    # [k]: drafts accepted at position i
    num_steps_speculated: int = 0        # steps that verified drafts
    num_steps_declined: int = 0          # steps with requests able to speculate where the rule found no gain

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_speculative_tokens, self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.accepted_per_position),
                               self.num_steps_speculated, self.num_steps_declined)


@dataclass(frozen=True)
class StepCost:
    """Seconds of a step whose forward pass covers T decode rows: ``points``, where measured, interpolated
    linearly between the measured row counts (and beyond the last with the last segment's slope), else
    ``base + per_token * T``; plus ``overhead``, the step's time outside the forward pass. The draft model's
    forward is ``draft_base + draft_per_token * rows``.

    A straight line fits a forward pass badly where the kernels change with the row count: the int8 GEMM reads
    its weights once for up to 15 rows and widens them for more (measured on the reference model, int8: 1 to 4
    rows cost nearly the same, 20 rows three times that), so a line through 1 and 32 rows put a verification of
    4 requests x 5 rows far too cheap, and the rule speculated where it lost."""
    base: float
    per_token: float
    draft_base: float = 0.0
    draft_per_token: float = 0.0
    points: tuple[tuple[int, float], ...] = ()      # (rows, forward seconds), rows ascending
    overhead: float = 0.0

    def seconds(self, rows: int) -> float:
        p = self.points
        if not p:
            return self.base + self.per_token * rows + self.overhead
        if rows <= p[0][0]:
            return p[0][1] + self.overhead
        i = bisect.bisect_left(p, rows, key=lambda point: point[0])     # called per candidate, per step
        if i < len(p):
            (r0, s0), (r1, s1) = p[i - 1], p[i]
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0) + self.overhead
        slope = (p[-1][1] - p[-2][1]) / (p[-1][0] - p[-2][0]) if len(p) > 1 else self.per_token
        return p[-1][1] + slope * (rows - p[-1][0]) + self.overhead


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification emits on average with k drafts each accepted with this probability (the
    accepted ones and the target's own): 1 + a + a^2 + ... + a^k."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def draft_count(acceptance: float, room: int, batch: int, cost: StepCost, draft_rounds: bool) -> int:
    """How many drafts (0 to ``room``) one request accepted at this rate should verify in a step of ``batch``
    decoding requests, were it the only one to speculate: the k that maximizes tokens per second. Verifying
    fewer drafts costs fewer rows, so a request whose drafts hold less often still gains from one or two
    where four would not pay, and its acceptance estimate keeps learning."""
    best_k, best_rate = 0, batch / cost.seconds(batch)
    for k in range(1, room + 1):
        seconds = cost.seconds(batch + k)
        if draft_rounds:
            seconds += k * (cost.draft_base + cost.draft_per_token)
        rate = (batch + expected_tokens(acceptance, k) - 1.0) / seconds
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


def choose(gains: list[tuple[float, int]], batch: int, cost: StepCost, draft_rounds: int) -> int:
    """How many of the candidates to speculate for, each ``(expected extra tokens, draft rows)`` and sorted
    best first, in a step of ``batch`` decoding requests: the prefix that maximizes tokens per second
    (0: none; ties keep fewer)."""
    best_s, best_rate = 0, batch / cost.seconds(batch)
    tokens, rows = float(batch), batch
    for s, (gain, k) in enumerate(gains, start=1):
        tokens += gain
        rows += k
        seconds = cost.seconds(rows)
        if draft_rounds:
            seconds += draft_rounds * (cost.draft_base + cost.draft_per_token * s)
        if tokens / seconds > best_rate * (1 + 1e-9):
            best_s, best_rate = s, tokens / seconds
    return best_s


def forward_seconds(model: ModelRunner, rows: int, context: int, rounds: int = 3) -> float:
    """Best time of ``rounds`` forward passes over ``rows`` one-token decodes, each the last of ``context``
    tokens (in blocks 0.. of a pool nothing uses yet, whatever they hold)."""
    bs = model.block_size
    per_seq = -(-context // bs)
    chunks = [SeqChunk([(7 * i + 3) % model.config.vocab_size], context - 1,
                       list(range(i * per_seq, (i + 1) * per_seq)), True) for i in range(rows)]
    batch = build_batch(chunks, bs, model.device, model.compiled_prefill)
    best = float("inf")
    for _ in range(rounds + 1):                   # the first warms up (oneDNN primitives, page faults)
        started = time.perf_counter()
        model.forward(batch)
        best = min(best, time.perf_counter() - started)
    return best


COST_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)   # rows the target step cost is measured at


def measure_cost(model: ModelRunner, num_blocks: int, max_model_len: int, draft: ModelRunner | None = None,
                 draft_blocks: int = 0) -> StepCost:
    """``StepCost`` from forward passes of the model over COST_ROWS decode rows (as many as the pool holds;
    made non-decreasing, against timing noise), with a line through the first and last for the log; the
    draft's from 1 and up to 32 rows."""
    context = min(32, max_model_len)

    def most_rows(m: ModelRunner, blocks: int) -> int:
        return max(2, blocks // -(-context // m.block_size))

    def line(m: ModelRunner, blocks: int) -> tuple[float, float]:
        high = min(32, most_rows(m, blocks))
        one, many = forward_seconds(m, 1, context), forward_seconds(m, high, context)
        per_token = max((many - one) / (high - 1), 1e-7)
        return max(one - per_token, 0.0), per_token

    points: list[tuple[int, float]] = []
    for rows in (r for r in COST_ROWS if r <= most_rows(model, num_blocks)):
        seconds = forward_seconds(model, rows, context)
        points.append((rows, max(seconds, points[-1][1] if points else 0.0)))
    (r0, s0), (r1, s1) = points[0], points[-1]
    per_token = max((s1 - s0) / max(r1 - r0, 1), 1e-7)
    draft_base, draft_per_token = line(draft, draft_blocks) if draft is not None else (0.0, 0.0)
    return StepCost(max(s0 - per_token * r0, 0.0), per_token, draft_base, draft_per_token, tuple(points))


class Speculator:
    """Proposes drafts before a step and verifies them after it (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, model: ModelRunner, model_dir: str | Path, num_blocks: int,
                 block_size: int, max_model_len: int, use_kernels: bool = True):
        self.config = config
        self.k = config.num_speculative_tokens
        if self.k >= max_model_len:
            raise SpeculativeConfigError(f"num_speculative_tokens {self.k} must be below the context of "
                                         f"{max_model_len} tokens", "num_speculative_tokens")
        self.max_model_len = max_model_len
        self.draft: DraftModel | None = None
        if config.method == "draft":
            from .draft_model import DraftModel

            assert config.draft_model is not None
            self.draft = DraftModel(config.draft_model, model_dir, model.dtype, model.device, num_blocks,
                                    block_size, max_model_len, use_kernels, model.quantization)
        self.histories: dict[str, ngram.TokenHistory] = {}
        self.acceptance: dict[str, list[int]] = {}         # request id -> [accepted, drafted]
        self.engine_rate = PRIOR_ACCEPTANCE
        self.stats = SpecDecodeStats(self.k)
        self.declined_in_a_row = 0
        self.draft_probs: dict[str, torch.Tensor | None] = {}
        self.cost: StepCost | None = None
        self.overhead = 0.0          # seconds of a step outside the forward pass (scheduling, sampling), running
        if config.adaptive:
            self.cost = measure_cost(model, num_blocks, max_model_len, self.draft.runner if self.draft else None,
                                     num_blocks)
            log.info("speculative decoding (%s, k=%d): step cost %.2f ms + %.3f ms/token%s", config.method, self.k,
                     self.cost.base * 1e3, self.cost.per_token * 1e3,
                     f"; draft {self.cost.draft_base * 1e3:.2f} ms + {self.cost.draft_per_token * 1e3:.3f} ms/token"
                     if self.draft else "")

    # ---- before the step ---------------------------------------------------------------------------------
    def _room(self, req: Request) -> int:
        """Drafts ``req`` can take now: 0 unless it is decoding without penalties, logit_bias, min_tokens or a
        structured output (drafts are not checked against those: such requests do not speculate); fewer near
        its end."""
        p = req.params
        if req.num_tokens - req.num_computed_tokens != 1 or p.needs_penalties or p.needs_logits_processing:
            return 0
        return max(0, min(self.k, p.max_tokens - len(req.output_token_ids) - 1,
                          self.max_model_len - req.num_tokens))

    def _rate(self, rid: str) -> float:
        accepted, drafted = self.acceptance.get(rid, (0, 0))
        return (accepted + PRIOR_WEIGHT * self.engine_rate) / (drafted + PRIOR_WEIGHT)

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of the running requests that speculate this step (and clear the others')."""
        live = {r.request_id for r in running}
        for rid in [r for r in self.histories if r not in live]:
            del self.histories[rid]
        for rid in [r for r in self.acceptance if r not in live]:
            del self.acceptance[rid]
        if self.draft is not None:
            self.draft.keep_only(live)
        self.draft_probs.clear()
        for r in running:
            r.spec_token_ids = []
        rooms = [(r, self._room(r)) for r in running]
        candidates = [(r, k) for r, k in rooms if k > 0]
        if not candidates:
            return
        chosen = candidates
        if self.cost is not None:
            decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
            cost = dataclasses.replace(self.cost, overhead=self.overhead)
            rated = [(r, room, self._rate(r.request_id)) for r, room in candidates]
            sized = [(r, draft_count(a, room, decoding, cost, self.draft is not None), a) for r, room, a in rated]
            scored = sorted(((expected_tokens(a, k) - 1.0, k, r) for r, k, a in sized if k),
                            key=lambda g: -g[0] / g[1])
            rounds = max((k for _, k, _ in scored), default=0) if self.draft else 0
            take = choose([(g, k) for g, k, _ in scored], decoding, cost, rounds)
            if take == 0:
                self.stats.num_steps_declined += 1
                self.declined_in_a_row += 1
                if self.declined_in_a_row < PROBE_EVERY:
                    return
                least_known = min(candidates, key=lambda c: self.acceptance.get(c[0].request_id, (0, 0))[1])
                chosen, self.declined_in_a_row = [least_known], 0
            else:
                chosen, self.declined_in_a_row = [(r, k) for _, k, r in scored[:take]], 0
        if self.draft is not None:
            proposals = self.draft.propose([r for r, _ in chosen], [k for _, k in chosen])
            for (r, _), (tokens, probs) in zip(chosen, proposals):
                r.spec_token_ids = tokens
                self.draft_probs[r.request_id] = probs
            return
        c = self.config
        for r, k in chosen:
            history = self.histories.setdefault(r.request_id, ngram.TokenHistory())
            r.spec_token_ids = ngram.propose(history.sync(r.all_token_ids), k, c.prompt_lookup_min,
                                             c.prompt_lookup_max)

    # ---- after the step ----------------------------------------------------------------------------------
    def verify(self, req: Request, logits: torch.Tensor) -> Verified:
        """Check ``req``'s drafts against the target's ``logits`` [drafts + 1, vocab] (the rows of its last
        token and drafts); roll its computed tokens back past the rejected ones; count."""
        drafts = req.spec_token_ids
        result = verify(logits, drafts, req, self.draft_probs.pop(req.request_id, None))
        req.num_computed_tokens -= len(drafts) - result.num_accepted       # rejected drafts' KV is stale
        req.spec_token_ids = []
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(drafts)
        s.num_accepted_tokens += result.num_accepted
        for i in range(result.num_accepted):
            s.accepted_per_position[i] += 1
        mine = self.acceptance.setdefault(req.request_id, [0, 0])
        mine[0] += result.num_accepted
        mine[1] += len(drafts)
        self.engine_rate += ENGINE_RATE_DECAY * (result.num_accepted / len(drafts) - self.engine_rate)
        return result

    def step_done(self, speculated: bool, step_seconds: float, forward_seconds: float) -> None:
        """Count the step, and follow the engine's own cost per step outside the forward pass: a fixed cost
        like the forward's base, which one more row does not raise (it matters for small models)."""
        if speculated:
            self.stats.num_steps_speculated += 1
        outside = max(step_seconds - forward_seconds, 0.0)
        self.overhead += OVERHEAD_DECAY * (outside - self.overhead)
