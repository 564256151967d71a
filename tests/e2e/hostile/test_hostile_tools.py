"""Hostile tool calls around streaming, against one ``tokenfleet serve`` process (a Qwen2.5-style template,
``--tool-call-parser hermes``): call text that is malformed, truncated, nested past any decoder, megabytes long,
or names a function the request does not have. It reaches the tool-call reader two ways:

- from the model: a regex (``structured_outputs``) makes the random-weight model write exactly that text;
- from the client: ``continuation.delivered_text`` (what a replica that died had streamed) is taken into the
  reader at once, up to 4 MiB of it.

Each gets a clear answer: a 200 whose stream is well formed to its ``[DONE]`` (every call delta has its index,
a call's first delta its id, type and a name of the request's tools; no error event; a finish_reason that says
what happened), or a 4xx naming the field. Never a 5xx, a killed stream, or an engine that stops serving.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from harness.router import http, stream_events
from harness.server import API_KEY, MODEL_NAME, ProcessServer

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[2] / "harness" / "chat_templates" / "qwen25.jinja"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
TOOLS = [SEARCH]
NAMES = {"search"}
MESSAGES = [{"role": "user", "content": "look it up"}]
LOG_ALARMS = ("Traceback", " ERROR ", "engine step loop stopped", "failed in the engine", "unhandled error")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tokenfleet_serving.testing_models import create_random_checkpoint

    model = create_random_checkpoint(tmp_path_factory.mktemp("models") / "tools", max_position_embeddings=4096)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    srv = ProcessServer(model, "--api-key", API_KEY, "--tool-call-parser", "hermes", "--kv-cache-mb", "32",
                        "--max-model-len", "4096", "--max-body-bytes", str(6 * 2**20))
    srv.model = model
    yield srv
    srv.close()
    alarms = [line for line in srv.log if any(a in line for a in LOG_ALARMS)]
    assert not alarms, "".join(alarms[:20])


def streamed(server, body: dict, timeout: float = 120) -> tuple[int, list]:
    status, _, events = stream_events(server.base_url, "/v1/chat/completions",
                                      {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "stream": True,
                                       **body}, headers=AUTH, timeout=timeout)
    return status, events


def well_formed(events: list, delivered_call: bool = False) -> tuple[str, dict[int, dict], str]:
    """Checks a 200 stream to its end; its content, calls by index and finish_reason. ``delivered_call``: the
    client already had the first call's opening delta (a continuation), so index 0 may go on without one."""
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasons += [choice["finish_reason"]] if choice["finish_reason"] else []
            for tc in delta.get("tool_calls", []):
                assert isinstance(tc["index"], int), tc
                if "id" in tc:
                    assert tc["index"] not in calls and tc["type"] == "function", tc
                    assert tc["function"]["name"] in NAMES, tc
                    calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
                elif not (delivered_call and tc["index"] == 0):
                    assert tc["index"] in calls, tc           # arguments only after the call's opening delta
                calls.setdefault(tc["index"], {"name": None, "arguments": ""})["arguments"] += \
                    tc["function"].get("arguments", "")
    assert len(reasons) == 1 and reasons[0] in ("stop", "length", "tool_calls"), reasons
    return content, calls, reasons[0]


def forced(text: str) -> dict:
    """A regex that leaves the model exactly ``text`` to write."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def complete_calls(calls: dict[int, dict]) -> list[tuple[str, dict]]:
    out = []
    for call in calls.values():
        try:
            out.append((call["name"], json.loads(call["arguments"])))
        except ValueError:
            pass
    return out


MODEL_WRITES = [
    # (what the model is made to write, the complete calls, what of it is content)
    ('<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>', [], "all"),
    ('<tool_call>{"name": "search", "arguments": {"query": nope}}</tool_call>', [], ""),
    ('<tool_call>{"name": "search", "arguments": ["query"]}</tool_call>', [], "all"),
    ('<tool_call>{"name": {"nested": "name"}, "arguments": {}}</tool_call>', [], "all"),
    ('<tool_call>not json at all</tool_call>', [], "all"),
    ('<tool_call>{"name": "search", "arguments": {"query": "' + "q" * 600 + '"}}</tool_call>',
     [("search", {"query": "q" * 600})], ""),
    ('<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call><tool_call>{"name": "search", "argu',
     [("search", {"query": "a"})], ""),
]


@pytest.mark.parametrize("text, calls, content", MODEL_WRITES)
def test_hostile_call_text_from_the_model(server, text, calls, content):
    status, events = streamed(server, {"max_tokens": 1000, "seed": 0, **forced(text)})
    assert status == 200, events
    got_content, got_calls, reason = well_formed(events)
    assert complete_calls(got_calls) == calls
    assert got_content.strip() == (text if content == "all" else content)
    assert reason == ("tool_calls" if calls else "stop")
    status, _, raw = http("POST", f"{server.base_url}/v1/chat/completions",
                          {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 1000, "seed": 0,
                           **forced(text)}, headers=AUTH)
    assert status == 200, raw
    message = json.loads(raw)["choices"][0]["message"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in
            message.get("tool_calls") or []] == calls
    assert (message["content"] or "") == (text if content == "all" else content)


DELIVERED = [
    '<tool_call>{"name": "search", "arguments": {"query": oops}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": "ab',
    '<tool_call>{"name": ',
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"q": ' + "[" * 3000,
    '<tool_call>{"name": "search", "arguments": {"q": [' + '"a",' * 700,
    '<tool_call>{"name": "search", "arguments": {}}</tool_call>' * 50,
    '<tool_call>{"name": "search", "arguments": {"query": "' + "x" * 3000,
    "</tool_call>" * 100 + "<tool_call>" * 100,
]


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model)


@pytest.mark.parametrize("delivered", DELIVERED, ids=lambda d: f"{d[:40]}...{len(d)}")
def test_hostile_call_text_handed_over_as_a_continuation(server, tokenizer, delivered):
    """What another replica streamed, taken into the reader at once (the output token ids it decodes from, up to
    the context), then the model goes on: the stream carries what it adds."""
    ids = tokenizer.encode(delivered, add_special_tokens=False)
    delivered = tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) < 3900, len(ids)
    body = {"max_tokens": len(ids) + 12, "seed": 1,
            "continuation": {"output_token_ids": ids, "delivered_text": delivered}}
    t0 = time.monotonic()
    status, events = streamed(server, body)
    assert status == 200, events
    well_formed(events, delivered_call=True)
    assert time.monotonic() - t0 < 120 and http("GET", f"{server.base_url}/health")[0] == 200


def test_megabytes_of_delivered_text_are_refused_before_they_are_read(server):
    """4 MiB of call text whose token ids are not there: a 400, before the reader sees any of it."""
    delivered = '<tool_call>{"name": "search", "arguments": {"query": "' + "x" * (4 * 2**20 - 100)
    t0 = time.monotonic()
    status, events = streamed(server, {"max_tokens": 8, "continuation": {"output_token_ids": [5, 6],
                                                                          "delivered_text": delivered}})
    assert status == 400 and events[0]["error"]["message"], events
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "rm_rf"}}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "tru'}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"continuation": {"output_token_ids": [5], "delivered_text": 7}}, "continuation.delivered_text"),
    ({"continuation": {"delivered_text": "<tool_call>"}}, "continuation.output_token_ids"),
])
def test_hostile_tool_input_to_a_stream_is_a_400_naming_the_field(server, body, param):
    status, events = streamed(server, {"max_tokens": 4, **body})
    assert status == 400 and events[0]["error"]["param"] == param, events


def test_huge_arguments_and_unknown_functions_in_the_conversation(server):
    """A history whose calls name functions the request does not have, or carry megabyte arguments: answered
    (the template shows them to the model) or refused with a 4xx naming what is too long, never a 5xx."""
    for arguments, name in [(json.dumps({"query": "y" * 2**20}), "search"), ("{}", "rm_rf")]:
        history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]
        status, events = streamed(server, {"messages": history, "max_tokens": 4})
        if status == 200:
            well_formed(events)
        else:
            assert 400 <= status < 500 and events[0]["error"]["message"], events
