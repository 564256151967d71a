"""Structured outputs, n, logit_bias, min_tokens and stream_options through the official openai client.

On the random-weight model the words are noise; every constrained output must parse and validate against
its schema (checked with ``jsonschema``), and every bad input is a 400 naming its field.
"""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from harness.server import API_KEY, MODEL_NAME, http, metric_values

SCHEMA = {
    "type": "object",
    "properties": {
        "service": {"type": "string", "maxLength": 16},
        "tier": {"type": "string", "enum": ["gold", "silver", "bronze"]},
        "replicas": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"zone": {"type": "string", "enum": ["a", "b"]},
                                             "ready": {"type": "boolean"}},
            "required": ["zone", "ready"], "additionalProperties": False}},
    },
    "required": ["service", "tier", "replicas"],
    "additionalProperties": False,
}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "describe the fleet as JSON"}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def json_schema_format(strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "fleet", "schema": SCHEMA, "strict": strict}}


def test_json_schema_strict_with_n_3(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=1.0,
                                          seed=7, n=3, response_format=json_schema_format())
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({c.message.content for c in resp.choices}) > 1        # three draws, not one repeated
    assert resp.usage.completion_tokens > 3 and resp.usage.total_tokens == resp.usage.prompt_tokens + \
        resp.usage.completion_tokens


def test_streamed_json_schema_n_2_with_continuous_usage(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=1.0,
                                            seed=3, n=2, response_format=json_schema_format(), stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    text = {0: "", 1: ""}
    chunks = list(stream)
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.delta.content or ""
    for t in text.values():
        jsonschema.validate(json.loads(t), SCHEMA)
    assert all(c.usage is not None for c in chunks)                   # usage in every chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 2


def test_json_object_and_vllm_structured_outputs(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=1.0,
                                          seed=1, response_format={"type": "json_object"})
    assert isinstance(json.loads(resp.choices[0].message.content), dict)
    out = client.completions.create(model=MODEL_NAME, prompt="pick", max_tokens=20, temperature=1.0, seed=2,
                                    extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert out.choices[0].text in ("alpha", "beta")
    out = client.completions.create(model=MODEL_NAME, prompt="id", max_tokens=20, temperature=1.0, seed=2,
                                    extra_body={"structured_outputs": {"regex": "[a-f0-9]{6}"}})
    assert re.fullmatch("[a-f0-9]{6}", out.choices[0].text)


def test_n_shares_the_prompt_kv(client, live_server):
    prompt = "the same long prompt for every choice " * 8
    hits = lambda: metric_values(live_server.base_url)["vllm:prefix_cache_hits_total"]
    before = hits()
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, n=3, temperature=1.0, seed=5,
                                     extra_body={"ignore_eos": True})
    assert len(resp.choices) == 3
    assert hits() - before >= 2 * (resp.usage.prompt_tokens - 16)     # the two later choices hit the first's blocks


def test_logit_bias_and_min_tokens(client):
    forced = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5, temperature=0,
                                       logit_bias={"77": 100}, extra_body={"ignore_eos": True,
                                                                            "return_token_ids": True})
    raw = forced.choices[0].model_extra["token_ids"]
    assert raw == [77] * 5
    held = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=30, temperature=0, logit_bias={"4": 100},
                                     extra_body={"min_tokens": 6, "return_token_ids": True})
    ids = held.choices[0].model_extra["token_ids"]
    assert len(ids) == 7 and ids[-1] == 4 and held.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(open"}}, "structured_outputs.regex"),
    ({"n": 17}, "n"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
])
def test_bad_input_is_a_400_naming_the_field(live_server, body, param):
    payload = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 10, **body}
    status, _, raw = http("POST", f"{live_server.base_url}/v1/chat/completions", payload, AUTH)
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"] == param


def test_completion_only_fields_keep_their_400(live_server):
    for field, value in (("best_of", 2), ("echo", True), ("suffix", "x")):
        status, _, raw = http("POST", f"{live_server.base_url}/v1/completions",
                              {"model": MODEL_NAME, "prompt": "x", field: value}, AUTH)
        assert status == 400 and json.loads(raw)["error"]["param"] == field


def test_a_grammar_past_its_time_bound_is_a_400_and_the_engine_serves_on(tiny_model):
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    from harness.server import ThreadServer, server_config

    cfg = server_config(tiny_model)
    srv = ThreadServer(replace(cfg, engine=replace(cfg.engine, structured_output_timeout_s=1e-4)))
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        big = {"type": "object", "properties": {f"k{i}": {"type": "array", "items": SCHEMA} for i in range(30)}}
        with ThreadPoolExecutor(1) as pool:
            free = pool.submit(client.completions.create, model=MODEL_NAME, prompt="the fleet", max_tokens=8,
                               temperature=0, extra_body={"ignore_eos": True})
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20,
                                               response_format={"type": "json_schema", "json_schema": {
                                                   "name": "big", "schema": big}})
            assert e.value.param == "response_format" and "did not compile within" in e.value.message
            assert free.result().usage.completion_tokens == 8
        assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3).usage.completion_tokens >= 1
    finally:
        srv.stop()
