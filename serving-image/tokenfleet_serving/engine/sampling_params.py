"""Per-request sampling parameters, validated on construction.

The bounds are those the sampler can compute (``sampler.py``): every float is
finite; the repetition penalty divides or multiplies a logit by at most
``1 / MIN_REPETITION_PENALTY`` or ``MAX_REPETITION_PENALTY``, which keeps every
penalized logit finite. Temperature needs no lower bound above 0: the sampler
scales distances from the maximum logit, which stay finite for any T > 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .structured.spec import StructuredOutputSpec

MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0           # OpenAI's bound: a bias is added to the logit, in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 means greedy
    top_k: int = 0                    # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0   # HF-style, over prompt and output tokens
    presence_penalty: float = 0.0     # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None       # top-N alternatives per token (0: only the sampled one)
    skip_special_tokens: bool = True
    # (token id, bias) pairs added to the logits before sampling (a dict is accepted and sorted into pairs);
    # ids are checked against the model's vocabulary when the engine takes the request
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0               # EOS, stop_token_ids and stop strings do not end the output before this
    structured: StructuredOutputSpec | None = None    # the output must match this (engine/structured/)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"sampling parameter '{name}' {why}, got {getattr(self, name)!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (off) or a positive integer")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in [0, 20]")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "must be an integer in [-2**63, 2**64)")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or not 0 <= self.min_tokens:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputSpec):
            raise bad("structured", "must be a StructuredOutputSpec")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_logits_processing(self) -> bool:
        """Whether the sampler adds to or masks this request's logits (logits_processors.py) at some step."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.structured is not None

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    pairs = list(value.items()) if isinstance(value, dict) else list(value)   # type: ignore[call-overload]
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"sampling parameter 'logit_bias' may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, "
                         f"got {len(pairs)}")
    out: dict[int, float] = {}
    for pair in pairs:
        token, bias = pair
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():
            token = int(token)      # JSON object keys are strings
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"sampling parameter 'logit_bias' keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"sampling parameter 'logit_bias' values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {bias!r} for token {token}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))
