"""Stream migration: a stream whose backend fails after it started continues on another backend.

The router asks every streamed request's backend for the output token ids of each chunk
(``return_token_ids``, stripped again before the client sees them unless it asked too) and keeps, per stream,
what the client has received: the token ids and the text. When the backend fails mid-stream (the connection
is reset or closed before ``[DONE]``, or the backend ends the stream with a 502/503/504 error event: its
engine died or stalled, or its drain timed out), or the backend stalls (no byte of the stream and no answer
to the router's polls for ``--stall-timeout`` seconds, 15 by default: a frozen process or node), the router
sends the same request to another routable
backend with ``continuation: {"output_token_ids": [...], "delivered_text": "..."}``. That backend
(``engine/continuation.py``) takes those tokens as its own output, so ``max_tokens``, stop strings,
penalties and ``usage`` count them, and streams what follows. The router relays it into the same client
stream, with the first stream's ``id`` and ``created``, so the client sees one uninterrupted stream:

- greedy requests get exactly the tokens an uninterrupted run would have produced (float32: see
  docs/engine.md on token equality), and so do seeded ones (the continuing replica advances the seed's
  generator past the delivered tokens); an unseeded sampled request continues with a fresh sample that
  follows the delivered text;
- ``usage`` is the continuing backend's: the prompt, every output token (delivered ones included), and the
  cached prompt tokens of the backend that finished the request;
- ``logprobs`` continue too (each token's from the backend that produced it).
- constrained streams (``response_format``, ``structured_outputs``, ``tool_choice`` required or named)
  continue with the grammar state restored from the delivered tokens (the engine replays them through it);
- tool-call streams (``tools``) continue too: their chunks carry, next to the token ids, the text those ids
  decode to (``output_text``, stripped like the ids), which is what the continuation's ``delivered_text``
  holds; the continuing server takes that text into its tool-call parser again without sending anything,
  so the client gets the rest of the content and the calls, numbered on from where the first stream left.

**vLLM replicas** (``--backend-runtime vllm``) take no ``continuation``: the router asks them for the token ids
of the prompt and of each chunk (vLLM's ``return_token_ids``) and continues a broken stream with a
``/v1/completions`` request whose prompt is the prompt's token ids followed by the delivered ones, with the same
sampling parameters and the token budget less what was delivered (``vllm_continuation``). A chat stream's
continuation is relayed as chat chunks, and its ``usage`` counts the delivered tokens as output, not prompt.
Greedy streams continue with the tokens an uninterrupted run gives; sampled ones (seeded or not) with a fresh
sample after the delivered tokens. What a token-id prompt cannot carry is not migratable, and such a stream fails
cleanly (below): tools, ``response_format`` and other constraints, ``logprobs``, ``echo``, ``suffix``,
``n`` > 1.

A request is continued at most ``migrationLimit`` times (router.json; default 3). A stream that cannot be
continued ends, after everything already relayed, with one OpenAI error event and ``[DONE]``:

| reason | when | error ``code`` |
|---|---|---|
| ``limit`` | it was migrated ``migrationLimit`` times already | 502 |
| ``no-backend`` | no other routable backend within ``noReplicaHoldSeconds`` (10 s at least) | 503 |
| ``not-migratable`` | no token ids in the output, several choices, or (vLLM) what a token-id prompt cannot carry | 502 |
| ``target-error`` | the backend asked to continue answered an error (its body's error is passed on) | its status |

Pure bookkeeping here; the I/O is in ``app.py``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MIGRATION_LIMIT = 3
MIGRATION_WAIT_S = 10.0                  # at least this long a broken stream waits for a routable backend
                                         # (longer with router.json's noReplicaHoldSeconds)
MIGRATABLE_ERROR_CODES = frozenset({502, 503, 504})

# why a stream was migrated (tokenfleet_router_migrations_total{reason})
DISCONNECTED = "backend-disconnected"
BACKEND_ERROR = "backend-error"
STALLED = "backend-stalled"              # nothing from it, polls included, for the stall timeout (app.py)
# why one could not be (tokenfleet_router_migration_failures_total{reason})
LIMIT = "limit"
NO_BACKEND = "no-backend"
NOT_MIGRATABLE = "not-migratable"
TARGET_ERROR = "target-error"

def migratable_error(obj: dict[str, Any]) -> int | None:
    """The code of an error event that means the backend is going away (its engine died or stalled, its drain
    timed out), else None: such a stream can continue elsewhere; other errors are the request's own."""
    err = obj.get("error")
    if isinstance(err, dict) and err.get("code") in MIGRATABLE_ERROR_CODES:
        return int(err["code"])
    return None


@dataclass
class StreamState:
    """What the client has received of one stream, and what a continuation needs."""

    client_wants_token_ids: bool
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    opening: dict[str, Any] | None = None     # id and created of the first chunk: kept across backends
    finished: bool = False                    # a chunk with finish_reason was relayed
    done: bool = False                        # [DONE] was relayed
    errored: bool = False                     # the stream ended with an error event
    migrations: int = 0
    continuing: bool = False                  # the current backend continues the stream
    unmigratable: str | None = None           # why this stream can no longer be continued
    prompt_token_ids: list[int] | None = None  # the prompt's token ids, as the first backend reported them (vLLM)
    as_chat: bool = False                     # the current backend streams completion chunks for a chat (vLLM)
    usage_shift: int = 0                      # delivered tokens the current backend counts as prompt (vLLM)
    skip_ids: int = 0                         # output ids the current backend generates again, already delivered

    @property
    def delivered_text(self) -> str:
        return "".join(self.text)

    def accept(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Note what a chunk delivers; returns the chunk as the client gets it, or None to drop it."""
        if "error" in obj:
            self.errored = True
            return obj
        self._take_prompt_ids(obj, obj)
        if self.opening is None and isinstance(obj.get("id"), str):
            self.opening = {k: obj[k] for k in ("id", "created") if k in obj}
        elif self.continuing and self.opening:
            obj.update(self.opening)
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            return obj                                      # the usage event
        if len(choices) != 1 or not isinstance(choices[0], dict) or choices[0].get("index", 0) != 0:
            self.unmigratable = self.unmigratable or "the backend streams several choices"
            return obj
        choice = choices[0]
        self._take_prompt_ids(choice, obj)
        ids = choice.get("token_ids")
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else None
        text = choice.get("text") if delta is None else delta.get("content")
        # a tool-call answer's chunks also say the text their token ids decode to, apart from what the client
        # sees (the content and tool_calls parsed out of it): that text is what a continuation takes in again
        output_text = choice.get("output_text")
        delivered = output_text if isinstance(output_text, str) else text
        if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            if self.skip_ids and ids:        # generated again by the continuation: the client has them
                dropped = min(self.skip_ids, len(ids))
                self.skip_ids -= dropped
                ids = choice["token_ids"] = ids[dropped:]
            self.token_ids += ids
        elif delivered:
            self.unmigratable = self.unmigratable or "the backend does not report the token ids of its output"
        if isinstance(delivered, str):
            self.text.append(delivered)
        if choice.get("finish_reason") is not None:
            self.finished = True
        if self.continuing and delta is not None and delta.get("role") and not delta.get("content"):
            return None                                     # the client had the opening chunk already
        if ids is not None and not self.client_wants_token_ids:
            del choice["token_ids"]
            choice.pop("output_text", None)
            if (not text and choice.get("finish_reason") is None and not choice.get("logprobs")
                    and not (delta and (delta.get("role") or delta.get("tool_calls")))):
                return None                                 # it was there only for its token ids
        return obj

    def _take_prompt_ids(self, holder: dict[str, Any], chunk: dict[str, Any]) -> None:
        """Keep the prompt's token ids (vLLM puts them on a chat stream's first chunk, and on a completion
        stream's first choice); the client sees them only when it asked for token ids, and only the first
        backend's."""
        if "prompt_token_ids" not in holder:
            return
        ids = holder["prompt_token_ids"]
        if self.prompt_token_ids is None and not self.continuing and isinstance(ids, list) \
                and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            self.prompt_token_ids = list(ids)
        if self.continuing or not self.client_wants_token_ids or ids is None:
            del holder["prompt_token_ids"]

    def translate(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A chunk of a vLLM continuation as the client's stream has it: completion chunks of a chat as chat
        chunks, and usage with the delivered tokens counted as output (the continuation took them as prompt)."""
        if not self.continuing or (not self.as_chat and not self.usage_shift):
            return obj
        usage = obj.get("usage")
        if isinstance(usage, dict) and self.usage_shift:
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                usage["prompt_tokens"] = prompt - self.usage_shift
                usage["completion_tokens"] = completion + self.usage_shift
        choices = obj.get("choices")
        if self.as_chat and isinstance(choices, list):
            obj["object"] = "chat.completion.chunk"
            obj["choices"] = [_chat_choice(c) if isinstance(c, dict) else c for c in choices]
        return obj

    def why_not(self, limit: int) -> str | None:
        """The failure reason when this stream cannot be continued now, else None."""
        if self.unmigratable is not None:
            return NOT_MIGRATABLE
        if self.migrations >= limit:
            return LIMIT
        return None

    def continuation_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request to send to the next backend."""
        return {**body, "continuation": {"output_token_ids": list(self.token_ids),
                                         "delivered_text": self.delivered_text}}


def _chat_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """A completion stream's choice as a chat stream's."""
    text = choice.get("text")
    out: dict[str, Any] = {"index": choice.get("index", 0), "delta": {"content": text if isinstance(text, str) else ""},
                           "logprobs": None, "finish_reason": choice.get("finish_reason")}
    for key in ("stop_reason", "token_ids"):
        if key in choice:
            out[key] = choice[key]
    return out


# what a /v1/completions request with a token-id prompt carries over from the original request
VLLM_CARRIED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user",
                "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                "allowed_token_ids", "bad_words", "priority", "cache_salt")
# what it cannot: the stream is not migratable when the request sets one of these
VLLM_UNCARRIED = ("tools", "functions", "response_format", "structured_outputs", "guided_json", "guided_regex",
                  "guided_choice", "guided_grammar", "logprobs", "top_logprobs", "echo", "suffix", "best_of",
                  "use_beam_search", "prompt_logprobs")


def vllm_unmigratable(body: dict[str, Any]) -> str | None:
    """Why a stream of this request cannot continue on another vLLM replica, or None."""
    for key in VLLM_UNCARRIED:
        value = body.get(key)
        if value in (None, False, [], {}) or (key == "response_format" and isinstance(value, dict)
                                               and value.get("type") == "text"):
            continue
        return f"a vLLM replica cannot continue a stream that sets {key!r} from token ids"
    if body.get("tool_choice") not in (None, "none"):
        return "a vLLM replica cannot continue a stream that sets 'tool_choice' from token ids"
    return None


def vllm_continuation(body: dict[str, Any], state: StreamState, *, chat: bool, path: str,
                      max_model_len: int | None, held_back: int = 0) -> tuple[str, dict[str, Any]]:
    """(path, body) of the request that continues ``state`` on a vLLM replica: a completion whose prompt is the
    prompt's token ids and the delivered ones; sets ``state.as_chat``, ``state.usage_shift`` and
    ``state.skip_ids`` for ``accept`` and ``translate``. Broken before the prompt's ids arrived (nothing was
    delivered then): the original request again.

    ``held_back``: the last delivered tokens whose text is not whole yet (the bytes of one character split over
    tokens, which vLLM holds back). They are left out of the prompt and generated again: vLLM primes its
    detokenizer with the prompt, and a prompt that ends inside a character makes it emit the whole prompt's
    text with the first output. Their ids, generated again, are not sent twice."""
    held_back = max(0, min(held_back, len(state.token_ids)))
    delivered = len(state.token_ids) - held_back
    if state.prompt_token_ids is None:
        assert delivered == 0
        state.as_chat, state.usage_shift = False, 0
        return path, {**body, "return_token_ids": True}
    prompt = state.prompt_token_ids + state.token_ids[:delivered]
    out: dict[str, Any] = {k: body[k] for k in VLLM_CARRIED if k in body}
    limit = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens", 16)
    if isinstance(limit, int):
        out["max_tokens"] = max(1, limit - delivered)
    elif max_model_len is not None:        # a chat without a limit: the rest of the context
        out["max_tokens"] = max(1, max_model_len - len(prompt))
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - delivered)
    out.update(prompt=prompt, stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    state.as_chat, state.usage_shift, state.skip_ids = chat, delivered, held_back
    return "/v1/completions", out


def incomplete_tail(decode: Callable[[list[int]], str], token_ids: list[int], limit: int = 4) -> int:
    """How many of the last ``token_ids`` decode to an unfinished character (a byte-level tokenizer splits one
    over tokens): 0 when the text ends whole."""
    for n in range(min(limit, len(token_ids)) + 1):
        if not decode(token_ids[:len(token_ids) - n]).endswith("\ufffd"):
            return n
    return 0


def failure_message(reason: str, broken: str, state: StreamState, limit: int) -> str:
    """The error message a client gets when its broken stream cannot be continued."""
    head = f"the backend failed mid-stream ({broken})"
    if reason == LIMIT:
        return f"{head} and this request was moved {state.migrations} times already (migrationLimit {limit})"
    if reason == NO_BACKEND:
        return f"{head} and no other backend was ready to continue the stream"
    return f"{head} and the stream cannot be continued elsewhere: {state.unmigratable}"
