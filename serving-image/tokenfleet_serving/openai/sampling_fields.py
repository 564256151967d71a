"""The request fields that shape sampling beyond the basic knobs: ``response_format`` and vLLM's
``structured_outputs`` (what the output must match), ``logit_bias``, ``min_tokens``, ``n`` and
``stream_options``. Each parser returns what the engine takes, or raises a 400 naming the field.
"""
from __future__ import annotations

import json
from typing import Any

from tokenfleet_serving.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES
from tokenfleet_serving.engine.structured.bounds import MAX_SCHEMA_DEPTH, json_depth
from tokenfleet_serving.engine.structured.spec import StructuredOutputError, StructuredOutputSpec

from .errors import bad

MAX_N = 16          # choices per request; each is a sequence in the engine's batch
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _spec(make, param: str) -> StructuredOutputSpec:
    try:
        return make()
    except StructuredOutputError as e:
        raise bad(param, e.message) from None


def response_format(body: dict) -> StructuredOutputSpec | None:
    """OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad("response_format", "must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec(lambda: StructuredOutputSpec("json_object"), "response_format")
    if kind != "json_schema":
        raise bad("response_format.type", f"must be one of text, json_object, json_schema, got {kind!r}")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad("response_format.json_schema", "is required: {\"name\": ..., \"schema\": {...}, \"strict\": ...}")
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise bad("response_format.json_schema.name", "must be a string")
    schema = js.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise bad("response_format.json_schema.schema", "must be a JSON schema object")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", "must be a boolean")
    return _spec(lambda: StructuredOutputSpec.json_schema(schema, strict=bool(strict), param="response_format"),
                 "response_format")


def structured_outputs(body: dict) -> StructuredOutputSpec | None:
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``regex``, ``choice`` (strings),
    ``grammar`` (Lark or GBNF) or ``json_object: true``."""
    so = body.get("structured_outputs")
    if so is None:
        return None
    if not isinstance(so, dict):
        raise bad("structured_outputs", "must be an object")
    unknown = sorted(set(so) - set(STRUCTURED_OUTPUT_KEYS) - {"disable_any_whitespace", "disable_additional_properties"})
    if unknown:
        raise bad(f"structured_outputs.{unknown[0]}", "is not a supported parameter")
    given = [k for k in STRUCTURED_OUTPUT_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad("structured_outputs", f"must set exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}")
    key = given[0]
    param, value = f"structured_outputs.{key}", so[key]
    if key == "json":
        if isinstance(value, str):
            if json_depth(value) > MAX_SCHEMA_DEPTH:
                raise bad(param, f"nests {json_depth(value)} objects or arrays deep; at most {MAX_SCHEMA_DEPTH} "
                                 "levels are accepted")
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                raise bad(param, "must be a JSON schema (an object, or a string holding one)") from None
        if not isinstance(value, (dict, bool)):
            raise bad(param, "must be a JSON schema object")
        return _spec(lambda: StructuredOutputSpec.json_schema(value, strict=True, param=param), param)
    if key == "json_object":
        if value is not True:
            raise bad(param, "must be true")
        return _spec(lambda: StructuredOutputSpec("json_object", param=param), param)
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise bad(param, "must be a list of strings")
        return _spec(lambda: StructuredOutputSpec("choice", choices=tuple(value), param=param), param)
    if not isinstance(value, str):
        raise bad(param, "must be a string")
    return _spec(lambda: StructuredOutputSpec(key, value, param=param), param)    # type: ignore[arg-type]


def structured(body: dict) -> StructuredOutputSpec | None:
    a, b = response_format(body), structured_outputs(body)
    if a is not None and b is not None:
        raise bad("structured_outputs", "cannot be combined with a json response_format")
    return a or b


def logit_bias(body: dict) -> dict[int, float] | None:
    """``{"token id": bias}`` with bias in [-100, 100]; the ids are checked against the vocabulary by the
    engine (a 400 naming logit_bias)."""
    v = body.get("logit_bias")
    if v is None or v == {}:
        return None
    if not isinstance(v, dict):
        raise bad("logit_bias", "must be an object mapping token ids to biases")
    if len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(v)}")
    out: dict[int, float] = {}
    for key, bias in v.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad("logit_bias", f"keys must be token ids, got {key!r}") from None
        if token < 0:
            raise bad("logit_bias", f"keys must be token ids >= 0, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                    f"got {bias!r} for token {key}")
        out[token] = float(bias)
    return out


def min_tokens(body: dict) -> int | None:
    v = body.get("min_tokens")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise bad("min_tokens", f"must be an integer >= 0, got {v!r}")
    return v


def choices(body: dict) -> int:
    v = body.get("n", 1)
    if v is None:
        return 1
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_N:
        raise bad("n", f"must be an integer in [1, {MAX_N}], got {v!r}")
    return v


def continuous_usage_stats(body: dict, stream: bool) -> bool:
    opts: Any = body.get("stream_options")
    return bool(stream and isinstance(opts, dict) and opts.get("continuous_usage_stats") is True)
