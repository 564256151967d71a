"""Chat templates rendered in the Jinja environment Hugging Face's ``apply_chat_template`` gives them.

A checkpoint's template is written against that environment, so a template that uses any part of it must
find it here too, or every chat request fails:

- a sandboxed, immutable environment with ``trim_blocks`` and ``lstrip_blocks``;
- the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and the ``{% generation %}`` block
  (HF marks assistant text with it for training masks; here it renders its body);
- ``tojson`` that does not HTML-escape and takes ``ensure_ascii``, ``indent``, ``separators`` and
  ``sort_keys`` (Jinja's own escapes ``<``, ``>``, ``&`` and ``'``, which changes tool schemas in the prompt);
- the globals ``raise_exception(message)``, ``strftime_now(format)``, a ``dict`` constructor and a
  ``namespace`` that refuses attribute names starting with ``_``;
- the variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the special tokens.

Compiled templates are kept in a small cache keyed by their source.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

TEMPLATE_CACHE_SIZE = 16


class ChatTemplateError(ValueError):
    """The template cannot be compiled, or refused the messages (``raise_exception``, a Jinja error)."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` in a template, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing underscore-prefixed names (no way to reach Python's internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a template may not set the namespace attribute {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=Namespace)
    return env


@lru_cache(maxsize=TEMPLATE_CACHE_SIZE)
def compile_chat_template(source: str) -> Any:
    """The compiled template; ChatTemplateError when it does not parse."""
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def render_chat_template(source: str, messages: list[dict], *, tools: list[dict] | None = None,
                         documents: list[dict] | None = None, add_generation_prompt: bool = True,
                         special_tokens: dict[str, str] | None = None, **template_kwargs: Any) -> str:
    """The prompt text, as ``apply_chat_template(..., tokenize=False)`` renders it."""
    import jinja2

    template = compile_chat_template(source)
    try:
        return template.render(messages=messages, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **(special_tokens or {}),
                               **template_kwargs)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e)) from e
    except (TypeError, AttributeError, KeyError, IndexError, ValueError, RecursionError) as e:
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from e
