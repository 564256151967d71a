"""What ``tokenfleet bench routing`` plays and computes: the mixed trace with its difficulty labels, and the
figures of each pass. Pure functions, no cluster.

**The trace.** Chat requests of the reference family's tokenizer, each with a label the router never sees:

- ``hard`` when the small model cannot serve it or the trace assigns it to the large model:
  - ``long-context``: a prompt of 300-600 tokens: prompt + max_tokens beyond the small service's
    ``maxModelLen`` (``SMALL_CONTEXT``), so the small model answers it 400;
  - ``long-output``: max_tokens 192-224: likewise beyond the small model's context;
  - ``deep``: a conversation of 6-8 user turns (an agent's long session; the trace gives it to the large model);
  - ``tools``: tool definitions offered (tool use; likewise);
- ``easy`` otherwise: one or two turns, a prompt of at most ``EASY_MAX_PROMPT`` tokens, max_tokens 16-48, all of
  it within the small model's context; ``VERBOSE_SHARE`` of the easy requests ask for 72-96 tokens (still within
  the small model's context, so easy, but past the route's output threshold: the rules' false positives).

Every request sets ``ignore_eos``, so its output tokens are its max_tokens, and the easy requests are drawn until
their output tokens equal the hard ones' (half of the trace's output tokens come from easy requests).

**The figures** of one pass (a list of ``Record``): $/Mtok of the traffic (each delivered output token at its
target's cost per million tokens), SLO attainment (requests that got a complete answer within the TTFT and TPOT
objectives, over all requests), requests lost (anything short of a complete 200 stream), and for the route the
decisions against the labels: precision and recall of "hard" (routed to the large target).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

SMALL_CONTEXT = 256            # the small service's engine.maxModelLen
EASY_MAX_PROMPT = 140          # easy prompts stay under the route's maxPromptTokens (160)
VERBOSE_SHARE = 0.04
HARD_PER_CATEGORY = 10
HARD_CATEGORIES = ("long-context", "long-output", "deep", "tools")
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                           "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]
WORDS = ("the cache of prefix block engine batch cluster node pod cost latency request stream model serve token "
         "route small large price hour replica queue shard weight").split()

# The route's difficulty thresholds in the benchmark (its TokenRoute's spec.difficulty).
DIFFICULTY = {"maxPromptTokens": 160, "maxOutputTokens": 64, "maxTurns": 4, "tools": True, "responseSchema": True}


@dataclass(frozen=True)
class TraceRequest:
    index: int
    label: str                   # easy | hard
    category: str                # easy | verbose | long-context | long-output | deep | tools
    body: dict[str, Any]
    prompt_tokens: int
    max_tokens: int


@dataclass
class Record:
    """One request as the client saw it."""

    index: int
    label: str
    category: str
    status: int = 0
    ok: bool = False               # a complete 200 stream
    target: str | None = None      # x-tokenfleet-route-target
    reason: str | None = None      # x-tokenfleet-route-reason
    ttft_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _messages(rng: random.Random, turns: int, words_per_turn: int) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for i in range(turns):
        out.append({"role": "user", "content": _text(rng, words_per_turn)})
        if i < turns - 1:
            out.append({"role": "assistant", "content": _text(rng, max(2, words_per_turn // 2))})
    return out


def make_trace(count_tokens: Callable[[dict[str, Any]], int], seed: int = 7, model: str = "chat",
               hard_per_category: int = HARD_PER_CATEGORY) -> list[TraceRequest]:
    """The mixed trace; ``count_tokens(body)``: the prompt tokens of a chat body (the small target's tokenizer
    and chat template)."""
    rng = random.Random(seed)
    drafts: list[tuple[str, str, dict[str, Any], int]] = []

    def draft(label: str, category: str, messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> None:
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, **extra}
        drafts.append((label, category, body, max_tokens))

    for _ in range(hard_per_category):
        draft("hard", "long-context", _messages(rng, 1, rng.randint(150, 300)), rng.randint(24, 40))
        draft("hard", "long-output", _messages(rng, 1, rng.randint(20, 50)), rng.randint(192, 224))
        draft("hard", "deep", _messages(rng, rng.randint(6, 8), rng.randint(6, 12)), rng.randint(24, 40))
        draft("hard", "tools", _messages(rng, 1, rng.randint(20, 60)), rng.randint(24, 40), tools=TOOLS,
              tool_choice="none")
    hard_tokens = sum(d[3] for d in drafts)
    easy_tokens = 0
    while easy_tokens < hard_tokens:
        verbose = rng.random() < VERBOSE_SHARE
        max_tokens = rng.randint(72, 96) if verbose else rng.randint(16, 48)
        remaining = hard_tokens - easy_tokens
        if 16 <= remaining < max_tokens:          # the last one: exactly half the output tokens
            max_tokens, verbose = remaining, False
        messages = _messages(rng, rng.randint(1, 2), rng.randint(5, 20))
        while count_tokens({"model": model, "messages": messages}) > min(EASY_MAX_PROMPT, SMALL_CONTEXT - max_tokens):
            messages = _messages(rng, 1, rng.randint(3, 12))        # too long for an easy request: draw again
        draft("easy", "verbose" if verbose else "easy", messages, max_tokens)
        easy_tokens += max_tokens
    rng.shuffle(drafts)
    out = []
    for i, (label, category, body, max_tokens) in enumerate(drafts):
        prompt = count_tokens(body)
        if label == "easy":
            assert prompt <= EASY_MAX_PROMPT and prompt + max_tokens <= SMALL_CONTEXT, (prompt, max_tokens)
        elif category in ("long-context", "long-output"):
            assert prompt + max_tokens > SMALL_CONTEXT, (category, prompt, max_tokens)
        out.append(TraceRequest(i, label, category, body, prompt, max_tokens))
    return out


def output_token_share(trace: Sequence[TraceRequest], label: str) -> float:
    total = sum(r.max_tokens for r in trace)
    return sum(r.max_tokens for r in trace if r.label == label) / total if total else 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


@dataclass(frozen=True)
class SloSpec:
    ttft_s: float
    tpot_s: float


def meets(r: Record, slo: SloSpec) -> bool:
    return r.ok and r.ttft_s is not None and r.ttft_s <= slo.ttft_s and (r.tpot_s is None or r.tpot_s <= slo.tpot_s)


def slo_attainment(records: Sequence[Record], slo: SloSpec) -> float:
    return sum(1 for r in records if meets(r, slo)) / len(records) if records else 0.0


def dollars_per_mtok(records: Sequence[Record], cost_per_mtok: dict[str, float]) -> float | None:
    """Each delivered output token at its target's $/Mtok; None when nothing was delivered."""
    tokens = sum(r.output_tokens for r in records if r.ok)
    if not tokens:
        return None
    return sum(r.output_tokens * cost_per_mtok[r.target] for r in records if r.ok and r.target) / tokens


def hard_precision_recall(records: Sequence[Record], large: str) -> tuple[float, float]:
    """Precision and recall of "hard" = routed to ``large``, against the labels."""
    routed_hard = [r for r in records if r.target == large]
    labelled_hard = [r for r in records if r.label == "hard"]
    both = sum(1 for r in routed_hard if r.label == "hard")
    precision = both / len(routed_hard) if routed_hard else 1.0
    recall = both / len(labelled_hard) if labelled_hard else 1.0
    return precision, recall


def lost(records: Sequence[Record]) -> int:
    return sum(1 for r in records if not r.ok)


def summary(records: Sequence[Record], slo: SloSpec, cost_per_mtok: dict[str, float]) -> dict[str, Any]:
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    tpots = [r.tpot_s for r in records if r.ok and r.tpot_s is not None]
    targets: dict[str, int] = {}
    for r in records:
        if r.target:
            targets[r.target] = targets.get(r.target, 0) + 1
    return {"requests": len(records), "dollars_per_mtok": dollars_per_mtok(records, cost_per_mtok),
            "slo_attainment": slo_attainment(records, slo), "requests_lost": lost(records),
            "output_tokens": sum(r.output_tokens for r in records if r.ok),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
            "tpot_p50_s": percentile(tpots, 50), "tpot_p95_s": percentile(tpots, 95), "by_target": targets}
