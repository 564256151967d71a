"""Stream migration: a stream whose backend fails after it started continues on another backend.

The router asks every streamed request's backend for the output token ids of each chunk
(``return_token_ids``, stripped again before the client sees them unless it asked too) and keeps, per stream,
what the client has received: the token ids and the text. When the backend fails mid-stream (the connection
is reset or closed before ``[DONE]``, or the backend ends the stream with a 502/503/504 error event: its
engine died or stalled, or its drain timed out), the router sends the same request to another routable
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

A request is continued at most ``migrationLimit`` times (router.json; default 3). A stream that cannot be
continued ends, after everything already relayed, with one OpenAI error event and ``[DONE]``:

| reason | when | error ``code`` |
|---|---|---|
| ``limit`` | it was migrated ``migrationLimit`` times already | 502 |
| ``no-backend`` | no other routable backend within ``noReplicaHoldSeconds`` (10 s at least) | 503 |
| ``not-migratable`` | the backend sent output without token ids (not a tokenfleet server), or several choices | 502 |
| ``target-error`` | the backend asked to continue answered an error (its body's error is passed on) | its status |

Pure bookkeeping here; the I/O is in ``app.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MIGRATION_LIMIT = 3
MIGRATION_WAIT_S = 10.0                  # at least this long a broken stream waits for a routable backend
                                         # (longer with router.json's noReplicaHoldSeconds)
MIGRATABLE_ERROR_CODES = frozenset({502, 503, 504})

# why a stream was migrated (tokenfleet_router_migrations_total{reason})
DISCONNECTED = "backend-disconnected"
BACKEND_ERROR = "backend-error"
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

    @property
    def delivered_text(self) -> str:
        return "".join(self.text)

    def accept(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Note what a chunk delivers; returns the chunk as the client gets it, or None to drop it."""
        if "error" in obj:
            self.errored = True
            return obj
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
        ids = choice.get("token_ids")
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else None
        text = choice.get("text") if delta is None else delta.get("content")
        # a tool-call answer's chunks also say the text their token ids decode to, apart from what the client
        # sees (the content and tool_calls parsed out of it): that text is what a continuation takes in again
        output_text = choice.get("output_text")
        delivered = output_text if isinstance(output_text, str) else text
        if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
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


def failure_message(reason: str, broken: str, state: StreamState, limit: int) -> str:
    """The error message a client gets when its broken stream cannot be continued."""
    head = f"the backend failed mid-stream ({broken})"
    if reason == LIMIT:
        return f"{head} and this request was moved {state.migrations} times already (migrationLimit {limit})"
    if reason == NO_BACKEND:
        return f"{head} and no other backend was ready to continue the stream"
    return f"{head} and the stream cannot be continued elsewhere: {state.unmigratable}"
