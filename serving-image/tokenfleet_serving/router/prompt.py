"""What the router needs to know about a request's prompt: its token ids
(to hash prefix blocks), its length and its requested output length.

The serving server turns a request into tokens with the checkpoint's
tokenizer (``server/chat.py``): a text prompt is encoded with special tokens
(plus BOS when ``add_bos_token``), token-id prompts are used as they are, and
chat messages are normalised, rendered with the Jinja chat template and
encoded without special tokens. This module does the same without importing
the engine (which pulls in torch); the tests compare it with the server's own
functions. Anything the router cannot understand is left for the backend to
reject: the router then simply routes without prefix information.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("tokenfleet.router.prompt")

MAX_TOKEN_ID = 2**32 - 1


class TokenizerError(Exception):
    """The model directory has no usable tokenizer (the message names the file)."""


@dataclass(frozen=True)
class PromptInfo:
    """The prompt as the router sees it."""

    token_ids: tuple[int, ...] | None  # None: not tokenizable here (no tokenizer, or a malformed body)
    num_tokens: int                    # exact when token_ids is known, else an estimate (characters / 4)
    max_tokens: int | None             # requested output tokens; None: not given (chat: the rest of the context)
    model: str | None


class PromptTokenizer:
    """tokenizer.json plus the tokenizer_config.json fields the server uses."""

    def __init__(self, backend: Any, *, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, add_bos_token: bool):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos_token = add_bos_token
        self._template = None

    @classmethod
    def from_directory(cls, directory: str | Path) -> "PromptTokenizer":
        from tokenizers import Tokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: file not found")
        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise TokenizerError(f"{path}: cannot load tokenizer ({exc})") from exc
        cfg_path = directory / "tokenizer_config.json"
        cfg: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{cfg_path}: not valid JSON ({exc})") from exc
            if not isinstance(cfg, dict):
                raise TokenizerError(f"{cfg_path}: must be a JSON object")

        def token(name: str) -> str | None:
            value = cfg.get(name)
            if isinstance(value, dict):  # an AddedToken serialised as an object
                value = value.get("content")
            if value is not None and not isinstance(value, str):
                raise TokenizerError(f"{cfg_path}: field '{name}' must be a string")
            return value

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the server uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{cfg_path}: field 'chat_template' must be a string")
        return cls(backend, chat_template=template, bos_token=token("bos_token"), eos_token=token("eos_token"),
                   add_bos_token=bool(cfg.get("add_bos_token", False)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = None if self.bos_token is None else self.backend.token_to_id(self.bos_token)
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def render_chat(self, messages: list[dict]) -> str:
        if not self.chat_template:
            raise ValueError("the model has no chat template")
        if self._template is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise jinja2.TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_messages(messages: Any) -> list[dict] | None:
    """Chat messages as the server hands them to the template, or None if the server would reject them."""
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            return None
        content = m.get("content")
        if content is None and m["role"] == "assistant":
            content = ""
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                return None
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            return None
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _token_list(value: Any) -> list[int] | None:
    if (isinstance(value, list) and value
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value)):
        return value
    return None


def prompt_info(kind: str, body: Any, tokenizer: PromptTokenizer | None) -> PromptInfo:
    """Tokens and lengths of a decoded request body; ``kind`` is "completion" or "chat"."""
    if not isinstance(body, dict):
        return PromptInfo(None, 0, None, None)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    if kind == "chat":
        max_tokens = _positive_int(body.get("max_completion_tokens")) or _positive_int(body.get("max_tokens"))
        messages = normalize_messages(body.get("messages"))
        if messages is None:
            return PromptInfo(None, 0, max_tokens, model)
        estimate = sum(len(m["content"]) for m in messages) // 4 + 1
        if tokenizer is None or not tokenizer.chat_template:
            return PromptInfo(None, estimate, max_tokens, model)
        try:
            ids = tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
        except Exception as exc:  # a template that rejects the messages: the backend will say why
            log.debug("chat template failed: %s", exc)
            return PromptInfo(None, estimate, max_tokens, model)
        return PromptInfo(tuple(ids), len(ids), max_tokens, model)

    raw = body.get("max_tokens")
    max_tokens = 16 if raw is None else _positive_int(raw)  # OpenAI's (and the server's) default is 16
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ids = _token_list(prompt)
    if ids is not None:
        return PromptInfo(tuple(ids), len(ids), max_tokens, model)
    if not isinstance(prompt, str) or not prompt:
        return PromptInfo(None, 0, max_tokens, model)
    if tokenizer is None:
        return PromptInfo(None, len(prompt) // 4 + 1, max_tokens, model)
    ids = tokenizer.encode(prompt)
    return PromptInfo(tuple(ids), len(ids), max_tokens, model)
