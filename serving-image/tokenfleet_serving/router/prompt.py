"""What the router needs to know about a request's prompt: its token ids
(to hash prefix blocks), its length and its requested output length.

It parses and tokenizes exactly as the serving server does, with the same
code: the request parsing (``openai/protocol.py``), the prompt
tokenization (``openai/prompt.py``) and the engine's tokenizer, none of which
needs torch. A request the server would reject is left for the backend to
reject: the router then routes it without prefix information.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokenfleet_serving.engine.tokenizer import Tokenizer
from tokenfleet_serving.openai.errors import ApiError
from tokenfleet_serving.openai.prompt import prompt_token_ids
from tokenfleet_serving.openai.protocol import GenerationRequest, parse_chat, parse_completion

log = logging.getLogger("tokenfleet.router.prompt")


@dataclass(frozen=True)
class PromptInfo:
    """The prompt as the router sees it."""

    token_ids: tuple[int, ...] | None  # None: not tokenizable here (no tokenizer, or a malformed body)
    num_tokens: int                    # exact when token_ids is known, else an estimate (characters / 4)
    max_tokens: int | None             # requested output tokens; None: not given (chat: the rest of the context)
    model: str | None


def _estimate(req: GenerationRequest) -> int:
    if req.kind == "chat":
        return sum(len(m["content"]) for m in req.messages or []) // 4 + 1
    return len(req.prompt_text or "") // 4 + 1


def prompt_info(kind: str, body: Any, tokenizer: Tokenizer | None) -> PromptInfo:
    """Tokens and lengths of a decoded request body; ``kind`` is "completion" or "chat"."""
    try:
        req = parse_chat(body) if kind == "chat" else parse_completion(body)
    except ApiError:
        model = body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else None
        return PromptInfo(None, 0, None, model)
    if tokenizer is None and req.prompt_token_ids is None:
        return PromptInfo(None, _estimate(req), req.max_tokens, req.model)
    try:
        ids = prompt_token_ids(tokenizer, req, tokenizer.vocab_size if tokenizer else 2**32)
    except ApiError as exc:  # e.g. a template that rejects the messages: the backend will say why
        log.debug("cannot tokenize the prompt: %s", exc.message)
        return PromptInfo(None, _estimate(req), req.max_tokens, req.model)
    return PromptInfo(tuple(ids), len(ids), req.max_tokens, req.model)
