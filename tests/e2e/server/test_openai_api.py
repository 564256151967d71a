"""The official openai client against a live server on loopback: streaming and not."""
from __future__ import annotations

import json

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet_serving.engine.block_pool import hash_prefix_blocks

from harness.server import API_KEY, MODEL_NAME, http, metric_values


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_non_streaming_and_streaming_agree(client):
    args = dict(model=MODEL_NAME, prompt="the fleet serves a token", max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_streaming_with_usage(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.completion_tokens == 8 and usage.prompt_tokens == full.usage.prompt_tokens
    # the chat template wrapped the messages: more prompt tokens than the raw text alone
    raw = client.completions.create(model=MODEL_NAME, prompt="be brief hello world", max_tokens=1)
    assert usage.prompt_tokens > raw.usage.prompt_tokens


def test_raw_sse_ends_with_done(live_server):
    status, headers, body = http("POST", f"{live_server.base_url}/v1/completions",
                                 {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "stream": True},
                                 {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_usage_reports_cached_prompt_tokens(client):
    prompt = list(range(10, 10 + 40))                       # 40 ids: two full 16-token blocks
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 40
    assert second.usage.prompt_tokens_details.cached_tokens >= 32


def test_cache_blocks_endpoint_lists_prompt_block_hashes(live_server, client):
    prompt = list(range(100, 148))                          # three full blocks
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    status, _, body = http("GET", f"{live_server.base_url}/cache/blocks",
                           headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200
    data = json.loads(body)
    expected = {h.hex() for h in hash_prefix_blocks(prompt, data["block_size"])}
    assert len(expected) == 3 and expected <= set(data["block_hashes"])
    assert data["host_block_hashes"] == [] and data["disk_block_hashes"] == []     # no KV offload tiers here


def test_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == 2


def test_client_sees_openai_errors(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x")
    assert err.value.status_code == 404 and err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=100000)
    bad_key = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_metrics_parse_and_carry_vllm_names(live_server, client):
    client.completions.create(model=MODEL_NAME, prompt="metrics please", max_tokens=4)
    status, headers, body = http("GET", f"{live_server.base_url}/metrics")   # no API key needed
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    families = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    expected = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter", "vllm:num_preemptions": "counter",
        "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram", "vllm:cache_config_info": "gauge",
        "tokenfleet:output_tokens_per_second": "gauge", "tokenfleet:ready": "gauge",
        "tokenfleet:startup_seconds": "gauge", "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram", "tokenfleet:requests_rejected": "counter",
    }
    assert {name: families.get(name) for name in expected} == expected
    text = body.decode()
    for exposed in ("vllm:prompt_tokens_total{", "vllm:generation_tokens_total{",
                    "vllm:request_success_total{", "vllm:time_to_first_token_seconds_bucket{"):
        assert exposed in text
    values = metric_values(live_server.base_url)
    assert values["vllm:generation_tokens_total"] >= 4
    assert values["vllm:time_to_first_token_seconds_count"] >= 1
    assert values["tokenfleet:ready"] == 1.0


def test_probes(live_server):
    assert http("GET", f"{live_server.base_url}/health")[0] == 200
    status, _, body = http("GET", f"{live_server.base_url}/ready")
    assert status == 200 and b"true" in body
