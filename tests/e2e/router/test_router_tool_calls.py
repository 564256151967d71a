"""Tool calls through ``tokenfleet route``: two ``tokenfleet serve`` processes (a Qwen2.5-style template,
``--tool-call-parser hermes``), each behind a fault proxy, behind a prefix-aware router.

- the router passes tools, tool_choice, tool messages and response_format through unchanged: the answers are
  the backend's own, for the official openai client;
- an agent's calls share the tool definitions as the start of their prompts: they stick to one backend and
  hit its prefix cache;
- a streamed tool-call answer whose backend breaks continues on the other backend as one stream, with the
  calls an uninterrupted run makes (seeded sampling, constrained decoding: the grammar state is restored).
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from harness.fault_proxy import FaultProxy
from harness.router import MODEL_NAME, ROUTER_KEY, metric_samples, start_backend, start_router, stream_events, wait_until

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[2] / "harness" / "chat_templates" / "qwen25.jinja"
BACKENDS = ("tools-0-0", "tools-1-0")
AUTH = {"Authorization": f"Bearer {ROUTER_KEY}"}
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "look up a pod by name", "parameters": {
        "type": "object", "properties": {"pod": {"type": "string", "maxLength": 10},
                                         "namespace": {"type": "string", "enum": ["default", "prod"]}},
        "required": ["pod", "namespace"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "scale", "description": "scale a deployment", "parameters": {
        "type": "object", "properties": {"replicas": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["replicas"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from tokenfleet_serving.testing_models import create_random_checkpoint

    d = tmp_path_factory.mktemp("tools")
    model = create_random_checkpoint(d / "model", max_position_embeddings=4096)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    backends, proxies, router = {}, {}, None
    try:
        for name in BACKENDS:
            backends[name] = start_backend(model, "--api-key", ROUTER_KEY, "--tool-call-parser", "hermes",
                                           "--kv-cache-mb", "32", "--max-model-len", "4096")
            proxies[name] = FaultProxy(backends[name].base_url)
        endpoints = [{"pod": n, "slice": n.rsplit("-", 1)[0], "ip": "127.0.0.1", "port": proxies[n].port,
                      "ready": True} for n in BACKENDS]
        (d / "router.json").write_text(json.dumps({"service": "tools", "namespace": "test", "models": [MODEL_NAME],
                                                   "policy": "prefix-aware", "kvBlockSize": 16,
                                                   "modelPath": str(model)}))
        (d / "endpoints.json").write_text(json.dumps(endpoints))
        router = start_router(d / "router.json", "--backend-api-key", ROUTER_KEY)
        wait_until(lambda: metric_samples(router.base_url).get("tokenfleet_router_backends{state=routable}") == 2,
                   60, what="two routable backends")
        yield {"backends": backends, "proxies": proxies, "router": router}
    finally:
        for p in proxies.values():
            p.close()
        for p in [router, *backends.values()]:
            if p is not None:
                p.kill()


@pytest.fixture(autouse=True)
def no_leftover_faults(fleet):
    yield
    for p in fleet["proxies"].values():
        p.clear()
        p.applied.clear()


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=ROUTER_KEY, max_retries=0, timeout=120)


def messages(question: str, system: str = "You operate the fleet.") -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def calls_of(message) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_the_router_passes_tool_calls_through_unchanged(fleet):
    direct = client(fleet["backends"]["tools-0-0"].base_url)
    routed = client(fleet["router"].base_url)
    args = dict(model=MODEL_NAME, messages=messages("scale the web pods"), tools=TOOLS, max_tokens=200, seed=11,
                tool_choice="required")
    want = calls_of(direct.chat.completions.create(**args).choices[0].message)
    got = routed.chat.completions.create(**args)
    assert want and calls_of(got.choices[0].message) == want and got.choices[0].finish_reason == "tool_calls"
    # named, streamed, through the router
    with routed.chat.completions.stream(**(args | {"tool_choice": {"type": "function", "function": {"name": "scale"}}})
                                        ) as stream:
        for _ in stream:
            pass
        [(name, _)] = calls_of(stream.get_final_completion().choices[0].message)
    assert name == "scale"
    # a tool round trip and a structured output, both through the router
    first = routed.chat.completions.create(**args).choices[0].message
    follow = messages("scale the web pods") + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "done"} for c in first.tool_calls]
    assert routed.chat.completions.create(model=MODEL_NAME, messages=follow, tools=TOOLS, max_tokens=4).choices
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    answer = routed.chat.completions.create(model=MODEL_NAME, messages=messages("ok?"), max_tokens=20, response_format={
        "type": "json_schema", "json_schema": {"name": "ok", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    # refusals come back as the backend's 400, naming the field
    with pytest.raises(openai.BadRequestError) as err:
        routed.chat.completions.create(model=MODEL_NAME, messages=messages("x"), tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "delete_everything"}})
    assert err.value.body["param"] == "tool_choice"


def test_an_agents_calls_share_the_tool_definitions_and_stick_to_one_backend(fleet):
    router = fleet["router"]
    served, cached = [], []
    for i, question in enumerate(("look up pod api", "scale web to 3", "look up db in prod", "scale api down")):
        status, headers, events = stream_events(router.base_url, "/v1/chat/completions", {
            "model": MODEL_NAME, "messages": messages(question, "An agent of its own."), "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 120, "seed": i, "stream": True, "stream_options": {"include_usage": True}}, headers=AUTH)
        assert status == 200 and events[-1] == "[DONE]"
        served.append(headers["x-tokenfleet-backend"])
        [usage] = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert len(set(served)) == 1, served
    # the system prompt and the tool definitions (hundreds of tokens) are the shared prefix
    assert cached[0] == 0 and min(cached[1:]) >= 10 * 16, cached


def assembled(events: list) -> tuple[str, list[tuple[str, dict]], str | None]:
    content, calls, finish = "", {}, None
    for e in events:
        if not isinstance(e, dict) or not e.get("choices"):
            continue
        choice = e["choices"][0]
        delta = choice.get("delta") or {}
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            entry = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            entry["name"] += (tc.get("function") or {}).get("name") or ""
            entry["arguments"] += (tc.get("function") or {}).get("arguments") or ""
        finish = choice.get("finish_reason") or finish
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


JSON_ANSWER = {"type": "object", "properties": {"pods": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                    "maxItems": 3}, "ok": {"type": "boolean"}},
               "required": ["pods", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("extra, after", [
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, 4),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}}, 6),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": JSON_ANSWER, "strict": True}}}, 5),
])
def test_a_broken_constrained_stream_continues_elsewhere_with_the_same_answer(fleet, extra, after):
    body = {"model": MODEL_NAME, "messages": messages("find the api pod"), "max_tokens": 120, "seed": 5,
            "temperature": 1.0, "stream": True, **extra}
    status, _, ref = stream_events(fleet["backends"]["tools-0-0"].base_url, "/v1/chat/completions", body, headers=AUTH)
    assert status == 200
    want = assembled(ref)
    if "tools" in extra:
        assert want[1], want
    else:
        jsonschema.validate(json.loads(want[0]), JSON_ANSWER)
    for p in fleet["proxies"].values():
        p.plan("cut", after=after)
    before = metric_samples(fleet["router"].base_url)
    status, _, events = stream_events(fleet["router"].base_url, "/v1/chat/completions", body)
    assert status == 200 and events[-1] == "[DONE]"
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    assert sum(len(p.applied) for p in fleet["proxies"].values()) == 1       # it did break, once
    assert assembled(events) == want
    assert not any("token_ids" in c["choices"][0] or "output_text" in c["choices"][0]
                   for c in events if isinstance(c, dict) and c.get("choices"))
    after_ = metric_samples(fleet["router"].base_url)
    key = "tokenfleet_router_migrations_total{reason=backend-disconnected}"
    assert after_.get(key, 0) - before.get(key, 0) == 1
