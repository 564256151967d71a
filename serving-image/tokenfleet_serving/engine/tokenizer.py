"""Tokenizer, chat template and incremental detokenization.

Wraps a ``tokenizers.Tokenizer`` loaded from tokenizer.json plus the fields of
tokenizer_config.json the engine needs (special tokens, chat template).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import CheckpointError, read_json

# tokenizer_config.json's named special tokens (Hugging Face's special_tokens_map), given to chat templates
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass
class Tokenizer:
    backend: Any                      # tokenizers.Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    special_token_ids: frozenset[int] = field(default_factory=frozenset)
    # the special tokens by name (bos_token, eos_token, unk_token, ...), which chat templates see
    special_tokens_map: dict[str, str] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.token_id(self.bos_token)
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            **template_kwargs: Any) -> str:
        """Render ``messages`` with the checkpoint's chat template, in Hugging Face's environment
        (``chat_template.py``). Raises ChatTemplateError (a ValueError)."""
        from .chat_template import ChatTemplateError, render_chat_template

        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json 'chat_template')")
        tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token, **self.special_tokens_map}
        return render_chat_template(self.chat_template, messages, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt,
                                    special_tokens={k: v for k, v in tokens.items() if v is not None},
                                    **template_kwargs)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window (from ``prefix_offset``) so cost per token stays
    constant, and holds back text that ends in an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, token_ids: list[int]) -> str:
        delta = ""
        for tid in token_ids:
            if self.skip_special_tokens and tid in self.tokenizer.special_token_ids:
                continue
            self.ids.append(tid)
            skip = self.skip_special_tokens
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
            full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta += full[len(prefix):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        self.text += delta
        return delta


def load_tokenizer(directory: str | Path) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        backend = Backend.from_file(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot load tokenizer ({exc})") from exc
    cfg_path = directory / "tokenizer_config.json"
    cfg = read_json(cfg_path) if cfg_path.exists() else {}

    def token(name: str) -> str | None:
        value: Any = cfg.get(name)
        if isinstance(value, dict):      # AddedToken serialized as an object
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"{cfg_path}: field '{name}' must be a string")
        return value

    template = cfg.get("chat_template")
    if isinstance(template, list):       # named templates: pick "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = directory / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{cfg_path}: field 'chat_template' must be a string")
    special_ids = frozenset(k for k, t in backend.get_added_tokens_decoder().items() if t.special)
    tokens = {name: value for name in SPECIAL_TOKEN_NAMES if (value := token(name)) is not None}
    return Tokenizer(backend=backend, chat_template=template, bos_token=token("bos_token"),
                     eos_token=token("eos_token"), add_bos_token=bool(cfg.get("add_bos_token", False)),
                     special_token_ids=special_ids, special_tokens_map=tokens)
