"""What the router observes of one request as it relays it: when the first token came, how many tokens were
delivered, and whether the request met the service's SLO.

Definitions (vLLM's and inference-perf's), measured where the client's request passes:

- TTFT: arrival at the router to the first output token (for a stream: the first event that carries one, as
  text or as its id);
- TPOT: (end-to-end - TTFT) / (output tokens - 1), for requests of two or more output tokens;
- end-to-end: arrival to the last byte.

A streamed request meets the SLO when its TTFT and its TPOT are within the targets (a target that is not set
always holds). A non-streamed request has no observable first token: it meets the SLO when it finished by the
time a stream within both targets would have, ``e2e <= ttft_target + tpot_target * (tokens - 1)``. A request
that failed misses it.

Output tokens come from the response's ``usage``. For a stream the router asks the backend for a final usage
event (``stream_options.include_usage``) and drops that event again when the client did not ask for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet_serving.contract.router_files import Slo

EPSILON = 1e-9          # clock arithmetic's rounding is no miss


def carries_output(obj: dict[str, Any]) -> bool:
    """A streamed chunk with output: text, or token ids (the router asks every backend for them, and a token can
    decode to no text yet); a chat chunk that only says the role carries none."""
    for choice in obj.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") or {}
        if (choice.get("text") or delta.get("content") or delta.get("tool_calls") or choice.get("token_ids")
                or choice.get("finish_reason")):
            return True
    return False


def is_usage_only(obj: dict[str, Any]) -> bool:
    return not obj.get("choices") and isinstance(obj.get("usage"), dict)


def completion_tokens(obj: dict[str, Any]) -> int | None:
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"]
    return None


@dataclass
class Timing:
    arrived: float
    stream: bool
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    ok: bool = False
    client_error: bool = False     # the backend refused the request as invalid (4xx)
    held: bool = False             # it waited for a replica before its first token (a cold start)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrived

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrived

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.finished is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)


def meets_slo(slo: Slo, t: Timing) -> bool:
    if not t.ok or t.e2e is None:
        return False
    ttft_s = None if slo.ttft_ms is None else slo.ttft_ms / 1000
    tpot_s = None if slo.tpot_ms is None else slo.tpot_ms / 1000
    if not t.stream:
        budget = (ttft_s or 0.0) + (tpot_s or 0.0) * max(t.output_tokens - 1, 0)
        return (ttft_s is None and tpot_s is None) or t.e2e <= budget + EPSILON
    if ttft_s is not None and (t.ttft is None or t.ttft > ttft_s + EPSILON):
        return False
    tpot = t.tpot
    return tpot_s is None or tpot is None or tpot <= tpot_s + EPSILON


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Make a streamed request end with a usage event; returns whether the client had asked for it itself."""
    options = body.get("stream_options")
    asked = isinstance(options, dict) and bool(options.get("include_usage"))
    if not asked:
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return asked
