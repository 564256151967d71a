"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list of strings, or a
grammar. The API layer builds a spec from ``response_format``, vLLM's ``structured_outputs`` or a
``tool_choice``; the engine compiles it (``compiler.py``) and masks the sampler with it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from . import bounds

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")

MAX_SPEC_BYTES = 64 * 1024      # a schema, regex, grammar or the choices together, as UTF-8
MAX_CHOICES = 1024


class StructuredOutputError(ValueError):
    """A spec the engine cannot serve (too large, invalid, not compilable in time). ``param`` names the
    request field it came from, so the API answers a 400 naming it (``status``)."""
    status = 400

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass(frozen=True)
class StructuredOutputSpec:
    """``value``: the JSON schema as JSON text (json_schema), the regex, the grammar (Lark, or GBNF/EBNF with
    ``::=`` rules), unused for json_object. ``choices``: the strings of kind choice. ``param``: the request
    field the spec came from (errors name it); not part of what is compiled."""
    kind: Kind
    value: str = ""
    choices: tuple[str, ...] = ()
    strict: bool = True
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(self.param, f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        size = len(self.value.encode("utf-8")) + sum(len(c.encode("utf-8")) for c in self.choices)
        if size > MAX_SPEC_BYTES:
            raise StructuredOutputError(self.param, f"is {size} bytes; at most {MAX_SPEC_BYTES} are accepted")
        if self.kind == "json_schema":
            _check_schema_depth(self.param, bounds.json_depth(self.value))
            try:
                schema = json.loads(self.value)
            except (ValueError, RecursionError) as e:
                raise StructuredOutputError(self.param, f"the schema is not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError(self.param, "the schema must be a JSON object")
            chain = bounds.schema_ref_depth(schema)
            if chain > bounds.MAX_SCHEMA_REF_DEPTH:
                raise StructuredOutputError(self.param, f"the schema's $ref chain is {chain} deep (each definition "
                                                        f"counting 1 plus its nesting); at most "
                                                        f"{bounds.MAX_SCHEMA_REF_DEPTH} is accepted")
        elif self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise StructuredOutputError(self.param, f"choice needs 1 to {MAX_CHOICES} strings")
            if any(not isinstance(c, str) or not c for c in self.choices):
                raise StructuredOutputError(self.param, "every choice must be a non-empty string")
        elif self.kind in ("regex", "grammar") and not self.value:
            raise StructuredOutputError(self.param, f"{self.kind} must not be empty")
        elif self.kind == "grammar":
            _check_grammar_shape(self.param, self.value)

    @classmethod
    def json_schema(cls, schema: dict | bool | str, strict: bool = True, param: str = "response_format"
                    ) -> StructuredOutputSpec:
        if not isinstance(schema, str):
            _check_schema_depth(param, bounds.value_depth(schema))
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))   # keys in order
        return cls("json_schema", text, strict=strict, param=param)

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (the cache key)."""
        return (self.kind, self.value, self.choices, self.strict)


def _check_schema_depth(param: str, depth: int) -> None:
    if depth > bounds.MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(param, f"the schema nests {depth} objects or arrays deep; at most "
                                           f"{bounds.MAX_SCHEMA_DEPTH} levels are accepted")


def _check_grammar_shape(param: str, text: str) -> None:
    """Bounded before compiling: llguidance recurses over the rules (bounds.py)."""
    rules = bounds.grammar_rules(text)
    if len(rules) > bounds.MAX_GRAMMAR_RULES:
        raise StructuredOutputError(param, f"the grammar defines {len(rules)} rules; at most "
                                           f"{bounds.MAX_GRAMMAR_RULES} are accepted")
    depth = bounds.grammar_depth(rules)
    if depth > bounds.MAX_GRAMMAR_DEPTH:
        raise StructuredOutputError(param, f"the grammar's rules chain {depth} deep (each rule counting 1 plus its "
                                           f"nesting of parentheses); at most {bounds.MAX_GRAMMAR_DEPTH} is accepted")
