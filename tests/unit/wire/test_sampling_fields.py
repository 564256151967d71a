"""Parsing of response_format, structured_outputs, logit_bias, min_tokens, n and stream_options."""
from __future__ import annotations

import pytest

from tokenfleet_serving.engine.structured.spec import MAX_SPEC_BYTES
from tokenfleet_serving.openai import protocol as P
from tokenfleet_serving.openai.errors import ApiError

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields) -> P.GenerationRequest:
    return P.parse_chat(dict(BASE, **fields))


def test_response_format_kinds_become_specs():
    assert "structured" not in chat(response_format={"type": "text"}).sampling
    assert chat(response_format={"type": "json_object"}).sampling["structured"].kind == "json_object"
    spec = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"b": {}, "a": {}}}, "strict": True}}).sampling["structured"]
    assert spec.kind == "json_schema" and spec.strict and spec.value.index('"b"') < spec.value.index('"a"')
    for key, value in (("regex", "[0-9]+"), ("grammar", 'root ::= "x"'), ("choice", ["a", "b"]),
                       ("json", {"type": "integer"}), ("json_object", True)):
        spec = chat(structured_outputs={key: value}).sampling["structured"]
        assert spec.param == f"structured_outputs.{key}"


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": ["y" * 1024] * (MAX_SPEC_BYTES // 1024)}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": True}, "n"),
    ({"logit_bias": {"a": 1}}, "logit_bias"), ({"logit_bias": {"1": -100.5}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"min_tokens": -1}, "min_tokens"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": "true"}}, "stream_options.continuous_usage_stats"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
])
def test_bad_fields_name_themselves(fields, param):
    with pytest.raises(ApiError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.param == param


def test_sampling_fields_reach_sampling_params():
    req = chat(logit_bias={"5": 10, "7": -100}, min_tokens=2, n=3, stream=True,
               stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert req.n == 3 and req.continuous_usage_stats and req.include_usage
    params = P.sampling_params(req, 10)
    assert params.logit_bias == ((5, 10.0), (7, -100.0)) and params.min_tokens == 2
    with pytest.raises(ApiError) as e:
        P.sampling_params(chat(min_tokens=20), 10)
    assert e.value.param == "min_tokens"
