"""Tokenizer, chat template and incremental detokenization.

Wraps a ``tokenizers.Tokenizer`` loaded from tokenizer.json plus the fields of
tokenizer_config.json the engine needs (special tokens, chat template).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Tokenizer:
    backend: Any                      # tokenizers.Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    special_token_ids: frozenset[int] = field(default_factory=frozenset)

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render ``messages`` with the checkpoint's Jinja chat template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json 'chat_template')")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window (from ``prefix_offset``) so cost per token stays
    constant, and holds back text that ends in an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, token_ids: list[int]) -> str:
        delta = ""
        for tid in token_ids:
            if tid in self.tokenizer.special_token_ids:
                continue
            self.ids.append(tid)
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
            full = self.tokenizer.decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta += full[len(prefix):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        self.text += delta
        return delta
