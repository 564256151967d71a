"""Tool calls against a live server, driven by clients no one here wrote: the official ``openai`` client, the
OpenAI Agents SDK (a real agent loop with two function tools) and ``langchain-openai`` (``bind_tools``,
``with_structured_output``).

The model is a tiny random-weight checkpoint whose chat template is written in the Qwen2.5 style
(tests/harness/chat_templates/qwen25.jinja), served with ``--tool-call-parser hermes``. Its words are noise,
but the structure must hold: every required or named tool call parses, names a tool of the request, and
its arguments validate against that tool's schema (checked with ``jsonschema``)."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from harness.server import API_KEY, MODEL_NAME, ThreadServer, http, server_config

TEMPLATE = Path(__file__).resolve().parents[2] / "harness" / "chat_templates" / "qwen25.jinja"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "search the web",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["news", "maps"]}, "maxItems": 2}},
        "required": ["query"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "what is the weather in the fleet cluster"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from tokenfleet_serving.testing_models import create_random_checkpoint

    model = create_random_checkpoint(tmp_path_factory.mktemp("models") / "tools", max_position_embeddings=4096)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def tool_server(tool_model):
    srv = ThreadServer(server_config(tool_model, kv_cache_bytes=32 * 2**20, max_model_len=4096,
                                     tool_call_parser="hermes"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def check_call(name: str, arguments: str, allowed=SCHEMAS) -> dict:
    assert name in allowed, name
    args = json.loads(arguments)
    jsonschema.validate(args, allowed[name])
    return args


def test_required_tool_calls_always_parse_and_validate(client):
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=256, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id
            check_call(call.function.name, call.function.arguments)


def test_a_named_function_is_the_one_called(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=256, seed=1,
                                       tool_choice={"type": "function", "function": {"name": "search"}})
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "search" and r.choices[0].finish_reason == "stop"
    check_call("search", call.function.arguments)


def test_without_parallel_calls_there_is_one(client):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=256, seed=seed)
        [call] = r.choices[0].message.tool_calls
        check_call(call.function.name, call.function.arguments)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_assemble_with_the_clients_own_accumulator(client, tool_choice):
    """The openai client's stream helper accumulates tool_calls deltas by index; it only works on OpenAI's shape."""
    with client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                        max_tokens=256, seed=3) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and "tool_calls.function.arguments.done" in events
    for call in calls:
        check_call(call.function.name, call.function.arguments)
    # the same request, not streamed, gives the same calls (same seed, same sampling)
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                          max_tokens=256, seed=3)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in full.choices[0].message.tool_calls] == \
           [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_auto_returns_noise_as_content_never_an_error(client):
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=24,
                                           seed=5, stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        else:
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
        assert isinstance(text, str)


def test_a_tool_round_trip_reaches_the_template(client):
    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=256, seed=0)
    calls = first.choices[0].message.tool_calls
    follow = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True, "n": i})} for i, c in enumerate(calls)]
    second = client.chat.completions.create(model=MODEL_NAME, messages=follow, tools=TOOLS, max_tokens=4, seed=0)
    # the calls and their results are part of the prompt now
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + sum(len(c.function.arguments) for c in calls) // 4


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"minimum": "x"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_bad_tool_input_is_a_400_naming_the_field(tool_server, body, param):
    status, _, raw = http("POST", f"{tool_server.base_url}/v1/chat/completions",
                          {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **body},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    error = json.loads(raw)["error"]
    assert (status, error["param"]) == (400, param), error
    # and the engine keeps serving
    ok = http("POST", f"{tool_server.base_url}/v1/chat/completions",
              {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok[0] == 200


def test_auto_on_a_server_without_a_parser_is_a_400_naming_tool_choice(live_server):
    status, _, raw = http("POST", f"{live_server.base_url}/v1/chat/completions",
                          {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "tool_choice" and "--tool-call-parser" in error["message"]


def test_openai_agents_sdk_runs_an_agent_loop_with_two_function_tools(tool_server):
    """A real agent loop: the first turn must call a tool (tool_choice required); the SDK runs the Python
    function with the arguments the server returned, sends the result back as a tool message, and (the SDK
    resets tool_choice after a call) the model answers in words."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    called: list[tuple[str, dict]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """Weather for the next days in a city."""
        called.append(("get_weather", {"city": city, "days": days}))
        return f"sunny in {city} for {days} days"

    @function_tool
    def convert(celsius: Annotated[int, Field(ge=-50, le=50)]) -> str:
        """Celsius to Fahrenheit."""
        called.append(("convert", {"celsius": celsius}))
        return str(celsius * 9 // 5 + 32)

    client = openai.AsyncOpenAI(base_url=f"{tool_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    agent = Agent(name="forecaster", instructions="Use the tools.", tools=[get_weather, convert],
                  model=OpenAIChatCompletionsModel(model=MODEL_NAME, openai_client=client),
                  # one call per turn: random weights would otherwise go on listing calls until max_tokens
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=128,
                                               seed=2))
    result = asyncio.run(Runner.run(agent, "weather in Oslo for 3 days, in fahrenheit", max_turns=4))
    assert called, [o.content[0].text for r in result.raw_responses for o in r.output if o.type == "message"]
    for name, args in called:
        assert name in ("get_weather", "convert")
        schema = {t.name: t.params_json_schema for t in (get_weather, convert)}[name]
        jsonschema.validate(args, schema)
    tool_outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(tool_outputs) == len(called)
    assert isinstance(result.final_output, str)


def test_langchain_bind_tools_and_structured_output(tool_server):
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL_NAME, base_url=f"{tool_server.base_url}/v1", api_key=API_KEY, max_retries=0,
                     timeout=120, max_tokens=256, seed=4)
    message = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False).invoke("weather in Lima?")
    assert isinstance(message, AIMessage) and message.tool_calls and not message.invalid_tool_calls
    for call in message.tool_calls:
        assert call["name"] in SCHEMAS
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    named = llm.bind_tools(TOOLS, tool_choice="search").invoke("find maps")
    assert [c["name"] for c in named.tool_calls] == ["search"]

    class Forecast(BaseModel):
        city: str = Field(max_length=10)
        days: int = Field(ge=1, le=7)
        windy: bool

    forecast = llm.with_structured_output(Forecast).invoke("forecast for Oslo")
    assert isinstance(forecast, Forecast)
    jsonschema.validate(forecast.model_dump(), Forecast.model_json_schema())


PING = {"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
    "additionalProperties": False}}}


def raw_stream(tool_server, body: dict) -> list[dict]:
    """The server's own chunks of a streamed answer, with the text each token decodes to (``return_token_ids``
    makes a tool-call stream say it next to the parsed deltas)."""
    from harness.router import stream_events

    status, _, events = stream_events(tool_server.base_url, "/v1/chat/completions",
                                      {"model": MODEL_NAME, "messages": MESSAGES, "stream": True,
                                       "return_token_ids": True, **body}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200, events
    return [e for e in events if isinstance(e, dict) and e.get("choices")]


def tokens_to_reach(chunks: list[dict], text: str, at: int) -> int:
    """How many output tokens the answer takes until its text is longer than ``at`` characters."""
    seen, tokens = "", 0
    for c in chunks:
        seen += c["choices"][0].get("output_text", "")
        tokens += len(c["choices"][0].get("token_ids", []))
        if len(seen) > at:
            return tokens
    raise AssertionError(f"the answer never got past {at} characters: {seen!r}")


def assemble(chunks) -> tuple[str, list[dict], str | None]:
    """The openai client's chunks as an agent assembles them: content, calls by index, finish_reason."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name, tc      # the first delta of a call
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and (tc.function.name is None), tc
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], reason


def test_a_required_stream_sends_each_call_as_it_is_written(client, tool_server):
    """Each call's name first (with its id and type), then its arguments in pieces as they are generated."""
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[PING], tool_choice="required",
                                          max_tokens=256, seed=0, stream=True)
    order = []
    for chunk in full:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            order.append((tc.index, "name" if tc.function.name else "arguments"))
    firsts = [order.index((i, "name")) for i in sorted({i for i, _ in order})]
    assert len(firsts) >= 2, order                                  # this seed writes several calls
    first_call = [kind for i, kind in order if i == 0]
    assert first_call[0] == "name" and first_call.count("arguments") > 1, first_call     # pieces, not one delta
    assert order.index((0, "arguments")) < firsts[1]        # the first call streamed before the second began


@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_cut_inside_its_second_call_keeps_the_first(client, tool_server, stream):
    """tool_choice required, max_tokens ending the output inside the second call: the first call is whole, as
    tool_calls; nothing of the array is content; finish_reason stays length."""
    body = {"tools": [PING], "tool_choice": "required", "seed": 0}
    chunks = raw_stream(tool_server, {**body, "max_tokens": 256})
    text = "".join(c["choices"][0].get("output_text", "") for c in chunks)
    calls = json.loads(text)
    assert len(calls) >= 2, text
    second = text.index("{", text.index('"parameters"', text.index('"name"', text.index("}}") + 2)))
    cut = tokens_to_reach(chunks, text, second + 1)      # the second call's arguments have begun
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=[PING], tool_choice="required", max_tokens=cut,
                   seed=0)
    if stream:
        content, got, reason = assemble(client.chat.completions.create(**request, stream=True))
        assert not content and reason == "length"
        assert (got[0]["name"], json.loads(got[0]["arguments"])) == ("ping", calls[0]["parameters"])
        assert got[1]["name"] == "ping" and len(got) == 2       # the cut call: its name, and its arguments so far
        assert got[1]["arguments"] and text[second:].startswith(got[1]["arguments"])
    else:
        r = client.chat.completions.create(**request)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
               [("ping", calls[0]["parameters"])]


def test_an_auto_stream_cut_inside_its_second_call_keeps_the_first(client, tool_server):
    """tool_choice auto, read by the hermes parser: the model is made to write two calls (a regex constrains its
    output) and max_tokens ends it inside the second one's arguments."""
    first = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>'
    second = '<tool_call>{"name": "search", "arguments": {"query": "fleet cluster"}}</tool_call>'
    body = {"tools": TOOLS, "seed": 0, "structured_outputs": {"regex": re.escape(first + second)}}
    chunks = raw_stream(tool_server, {**body, "max_tokens": 256})
    text = "".join(c["choices"][0].get("output_text", "") for c in chunks)
    assert text == first + second
    cut = tokens_to_reach(chunks, text, text.index('"query"'))
    for stream in (True, False):
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=cut, seed=0,
                                           stream=stream, extra_body={"structured_outputs": body["structured_outputs"]})
        if stream:
            content, got, reason = assemble(r)
            assert not content.strip() and reason == "length", content
            assert (got[0]["name"], json.loads(got[0]["arguments"])) == ("get_weather", {"city": "Oslo", "days": 3})
            assert [c["name"] for c in got] == ["get_weather", "search"]
            assert got[1]["arguments"] and '{"query": "fleet cluster"}'.startswith(got[1]["arguments"])
        else:
            choice = r.choices[0]
            assert choice.finish_reason == "length" and not choice.message.content
            assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
                   [("get_weather", {"city": "Oslo", "days": 3})]
