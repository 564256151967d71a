"""Tool-call parsers (vLLM's names): what each reads out of a model's text, that malformed calls stay content,
and that a stream cut anywhere yields the same content and calls as the whole answer."""
from __future__ import annotations

import json
import random

import pytest

from tokenfleet_serving.openai.tool_parsers import TOOL_PARSERS, ToolCallStream
from tokenfleet_serving.openai.tool_parsers.constrained import constrained_parser, constrained_stream
from tokenfleet_serving.openai.tools import parse_tools

W = {"city": "Zürich", "unit": "c"}
S = {"query": "a; b } {", "top_k": 3}

CASES = [
    # parser, text, expected content, expected [(name, arguments)]
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(W)}}}\n</tool_call>', None,
     [("get_weather", W)]),
    ("hermes", f'Let me look.\n<tool_call>{{"name": "get_weather", "arguments": {json.dumps(W)}}}</tool_call>\n'
               f'<tool_call>{{"name": "search", "arguments": {json.dumps(S)}}}</tool_call>', "Let me look.",
     [("get_weather", W), ("search", S)]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}', None, [("get_weather", {"city": "x"})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}', '<tool_call>{"name": "get_weather", '
               '"arguments": {"city": "x"}', []),
    ("hermes", "<tool_call>not json</tool_call> plain", "<tool_call>not json</tool_call> plain", []),
    ("hermes", "a < b and <tool_ca", "a < b and <tool_ca", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {json.dumps(W)}}}', None, [("get_weather", W)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {json.dumps(W)}}}; '
                    f'{{"name": "search", "arguments": {json.dumps(S)}}}', None, [("get_weather", W), ("search", S)]),
    ("llama3_json", "The weather is {fine}.", "The weather is {fine}.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city"', '{"name": "get_weather", "parameters": {"city"', []),
    ("llama3_json", '{"title": "no name"}', '{"title": "no name"}', []),
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {json.dumps(W)}}}, '
                f'{{"name": "search", "arguments": {json.dumps(S)}}}]', None, [("get_weather", W), ("search", S)]),
    ("mistral", f'Sure. [TOOL_CALLS][{{"name": "search", "arguments": {json.dumps(json.dumps(S))}}}]', "Sure.",
     [("search", S)]),
    ("mistral", "[TOOL_CALLS] [{broken", "[TOOL_CALLS] [{broken", []),
    ("mistral", "no calls at all [TOOL", "no calls at all [TOOL", []),
]


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_answers(name, text, content, calls):
    got_content, got_calls = TOOL_PARSERS[name]().parse(text)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    if name == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)


def replay(stream, text, cuts):
    deltas, last = [], 0
    for cut in sorted(cuts) + [len(text)]:
        deltas += stream.push(text[last:cut], final=cut == len(text))
        last = cut
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            entry["name"] += tc.get("function", {}).get("name", "")
            entry["arguments"] += tc.get("function", {}).get("arguments", "")
            if "id" in tc:
                assert tc["type"] == "function" and tc["id"]
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_a_stream_cut_anywhere_says_the_same(name, text, content, calls):
    rng = random.Random(7)
    for _ in range(30):
        cuts = rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))
        got_content, got_calls = replay(ToolCallStream(TOOL_PARSERS[name]()), text, cuts)
        assert got_calls == calls
        assert got_content.strip() == (content or "").strip()
    # one character at a time
    assert replay(ToolCallStream(TOOL_PARSERS[name]()), text, list(range(1, len(text))))[1] == calls


def test_hermes_streams_a_call_as_soon_as_its_block_closes():
    stream = ToolCallStream(TOOL_PARSERS["hermes"]())
    first = stream.push('Hi <tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert first[0] == {"content": "Hi "} and first[1]["tool_calls"][0]["function"] == {"name": "a", "arguments": "{}"}
    assert stream.push("<tool_call>{") == []


TOOLS = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
                   {"type": "function", "function": {"name": "search"}}]}


def test_required_output_is_a_list_of_calls():
    choice = parse_tools({**TOOLS, "tool_choice": "required"})
    text = json.dumps([{"name": "get_weather", "parameters": W}, {"name": "search", "parameters": {}}])
    content, calls = constrained_parser(choice).parse(text)
    assert content is None and calls_of(calls) == [("get_weather", W), ("search", {})]
    assert replay(constrained_stream(choice), text, [3, 20])[1] == [("get_weather", W), ("search", {})]
    assert constrained_parser(choice).parse('[{"name": "get_wea') == ('[{"name": "get_wea', [])   # cut by length


def test_a_named_call_streams_its_name_then_its_arguments():
    choice = parse_tools({**TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    stream = constrained_stream(choice)
    first = stream.push('{"ci')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert replay(constrained_stream(choice), json.dumps(W), [2, 9]) == ("", [("get_weather", W)])
    assert calls_of(constrained_parser(choice).parse(json.dumps(W))[1]) == [("get_weather", W)]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_a_stream_continued_by_another_stream_says_the_same(name, text, content, calls):
    """Stream migration: a second server takes in the text the first one streamed (silently) and streams the
    rest; what the client assembles from both is the whole answer."""
    for k in range(0, len(text) + 1, max(1, len(text) // 9)):
        first = ToolCallStream(TOOL_PARSERS[name]())
        deltas = first.push(text[:k])
        second = ToolCallStream(TOOL_PARSERS[name]())
        second.push(text[:k])
        deltas += second.push(text[k:], final=True)
        got_content = "".join(d.get("content", "") for d in deltas)
        got_calls = [(tc["function"]["name"], json.loads(tc["function"]["arguments"]))
                     for d in deltas for tc in d.get("tool_calls", [])]
        assert got_calls == calls and [tc["index"] for d in deltas for tc in d.get("tool_calls", [])] == \
            list(range(len(calls)))
        assert got_content.strip() == (content or "").strip()


def test_json_nested_past_the_stack_is_content_not_an_error():
    deep = "[" * 100_000 + "]" * 100_000
    for name in TOOL_PARSERS:
        assert TOOL_PARSERS[name]().parse(deep)[1] == []
    assert TOOL_PARSERS["hermes"]().parse(f"<tool_call>{deep}</tool_call>")[1] == []
    choice = parse_tools({**TOOLS, "tool_choice": "required"})
    assert constrained_parser(choice).parse(deep)[1] == []
