"""Tool-call parsers (vLLM's names): what each reads out of a model's text, that malformed calls stay content,
that a stream cut anywhere yields the same content and calls as the whole answer, and that a stream sends each
call's name as soon as it is written and its arguments as they come, so an answer cut short keeps its complete
calls."""
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
    # the arguments are complete, the call object is not: a call
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}', None, [("get_weather", {"city": "x"})]),
    # cut inside a call's arguments: no call, and no content either
    ("hermes", 'Hm. <tool_call>{"name": "get_weather", "arguments": {"city": "x', "Hm. ", []),
    ("hermes", '<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "argu',
     None, [("search", {})]),
    # a function the request does not have is no call
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm_rf", '
               '"arguments": {}}</tool_call>', []),
    ("hermes", "<tool_call>not json</tool_call> plain", "<tool_call>not json</tool_call> plain", []),
    ("hermes", "a < b and <tool_ca", "a < b and <tool_ca", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {json.dumps(W)}}}', None, [("get_weather", W)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {json.dumps(W)}}}; '
                    f'{{"name": "search", "arguments": {json.dumps(S)}}}', None, [("get_weather", W), ("search", S)]),
    ("llama3_json", "The weather is {fine}.", "The weather is {fine}.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city"', None, []),
    ("llama3_json", '{"name": "get_weather" "parameters": {}}', '{"name": "get_weather" "parameters": {}}', []),
    ("llama3_json", '{"title": "no name"}', '{"title": "no name"}', []),
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {json.dumps(W)}}}, '
                f'{{"name": "search", "arguments": {json.dumps(S)}}}]', None, [("get_weather", W), ("search", S)]),
    ("mistral", f'Sure. [TOOL_CALLS][{{"name": "search", "arguments": {json.dumps(json.dumps(S))}}}]', "Sure.",
     [("search", S)]),
    ("mistral", "[TOOL_CALLS] [{broken", "[TOOL_CALLS] [{broken", []),
    ("mistral", f'[TOOL_CALLS] [{{"name": "search", "arguments": {json.dumps(S)}}}, {{"name": "get_weather", "argu',
     None, [("search", S)]),
    ("mistral", "no calls at all [TOOL", "no calls at all [TOOL", []),
]


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


NAMES = frozenset({"get_weather", "search"})


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_answers(name, text, content, calls):
    got_content, got_calls = TOOL_PARSERS[name]().parse(text, NAMES)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    if name == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)


def assemble(deltas):
    """What a client makes of the deltas, as the openai client accumulates them: content, and the calls by
    index (the first delta of each has its id, type and name; the others add to its arguments)."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if tc["index"] not in calls:
                assert tc["type"] == "function" and tc["id"] and tc["function"]["name"], tc
                assert tc["index"] == len(calls)
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
            entry = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            entry["name"] += tc.get("function", {}).get("name", "")
            entry["arguments"] += tc.get("function", {}).get("arguments", "")
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def complete(calls):
    """The calls whose arguments are whole (a prefix of a JSON object that parses is all of it)."""
    out = []
    for name, arguments in calls:
        try:
            out.append((name, json.loads(arguments)))
        except ValueError:
            pass
    return out


def replay(stream, text, cuts):
    deltas, last = [], 0
    for cut in sorted(cuts) + [len(text)]:
        deltas += stream.push(text[last:cut], final=cut == len(text))
        last = cut
    content, calls = assemble(deltas)
    return content, complete(calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_a_stream_cut_anywhere_says_the_same(name, text, content, calls):
    rng = random.Random(7)
    for _ in range(30):
        cuts = rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))
        got_content, got_calls = replay(ToolCallStream(TOOL_PARSERS[name](), NAMES), text, cuts)
        assert got_calls == calls
        assert got_content.strip() == (content or "").strip()
    # one character at a time
    assert replay(ToolCallStream(TOOL_PARSERS[name](), NAMES), text, list(range(1, len(text))))[1] == calls


def test_hermes_streams_a_call_as_soon_as_its_block_closes():
    stream = ToolCallStream(TOOL_PARSERS["hermes"](), {"a"})
    first = stream.push('Hi <tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert first[0] == {"content": "Hi "} and first[1]["tool_calls"][0]["function"] == {"name": "a", "arguments": ""}
    assert first[2] == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
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
    assert constrained_parser(choice).parse('[{"name": "get_wea') == (None, [])   # cut by length: no call, no content


def test_a_named_call_streams_its_name_then_its_arguments():
    choice = parse_tools({**TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    stream = constrained_stream(choice)
    first = stream.push('{"ci')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert replay(constrained_stream(choice), json.dumps(W), [2, 9]) == ("", [("get_weather", W)])
    assert constrained_parser(choice).parse(json.dumps(W)[:-3]) == (None, [])     # cut by length
    assert calls_of(constrained_parser(choice).parse(json.dumps(W))[1]) == [("get_weather", W)]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_a_stream_continued_by_another_stream_says_the_same(name, text, content, calls):
    """Stream migration: a second server takes in the text the first one streamed (silently) and streams the
    rest; what the client assembles from both is the whole answer."""
    for k in range(0, len(text) + 1, max(1, len(text) // 9)):
        first = ToolCallStream(TOOL_PARSERS[name](), NAMES)
        deltas = first.push(text[:k])
        second = ToolCallStream(TOOL_PARSERS[name](), NAMES)
        second.push(text[:k])
        deltas += second.push(text[k:], final=True)
        got_content, got_calls = assemble(deltas)
        assert complete(got_calls) == calls
        assert got_content.strip() == (content or "").strip()


def test_json_nested_past_the_stack_is_content_not_an_error():
    deep = "[" * 100_000 + "]" * 100_000
    for name in TOOL_PARSERS:
        assert TOOL_PARSERS[name]().parse(deep)[1] == []
    assert TOOL_PARSERS["hermes"]().parse(f"<tool_call>{deep}</tool_call>")[1] == []
    choice = parse_tools({**TOOLS, "tool_choice": "required"})
    assert constrained_parser(choice).parse(deep)[1] == []


REQUIRED = json.dumps([{"name": "get_weather", "parameters": W}, {"name": "search", "parameters": S}])
STREAMS = [
    # a stream, the whole answer, where the first call's arguments begin, where the second's do
    (lambda: ToolCallStream(TOOL_PARSERS["hermes"](), NAMES),
     f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps(W)}}}</tool_call>\n'
     f'<tool_call>{{"name": "search", "arguments": {json.dumps(S)}}}</tool_call>'),
    (lambda: ToolCallStream(TOOL_PARSERS["mistral"](), NAMES),
     f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(W)}}}, '
     f'{{"name": "search", "arguments": {json.dumps(S)}}}]'),
    (lambda: ToolCallStream(TOOL_PARSERS["llama3_json"](), NAMES),
     f'{{"name": "get_weather", "parameters": {json.dumps(W)}}}; {{"name": "search", "parameters": {json.dumps(S)}}}'),
    (lambda: constrained_stream(parse_tools({**TOOLS, "tool_choice": "required"})), REQUIRED),
]


@pytest.mark.parametrize("make, text", STREAMS)
def test_each_call_streams_its_name_then_its_arguments_as_they_come(make, text):
    """One character at a time: a call's id, type and name come once its name is written and its arguments have
    begun, before they end; then each character of the arguments is sent as it comes."""
    stream = make()
    deltas_at: list[tuple[int, dict]] = []
    for i, ch in enumerate(text):
        deltas_at += [(i, d) for d in stream.push(ch, final=i == len(text) - 1)]
    heads = [(i, d["tool_calls"][0]) for i, d in deltas_at if "id" in d.get("tool_calls", [{}])[0]]
    assert [h["function"]["name"] for _, h in heads] == ["get_weather", "search"]
    first_args = text.index("{", text.index('"get_weather"') + 14)
    assert heads[0][0] == first_args                       # as soon as the arguments begin
    pieces = [d["tool_calls"][0]["function"]["arguments"] for i, d in deltas_at
              if d.get("tool_calls") and "id" not in d["tool_calls"][0] and d["tool_calls"][0]["index"] == 0]
    raw = json.dumps(W)       # a piece per character; an escape's backslash waits for the character it escapes
    assert len(pieces) == len(raw) - raw.count("\\") and json.loads("".join(pieces)) == W
    assert calls_of(stream.calls) == [("get_weather", W), ("search", S)]


@pytest.mark.parametrize("make, text", STREAMS)
def test_an_answer_cut_inside_its_second_call_keeps_the_first(make, text):
    """finish_reason length inside the second call's arguments: streamed, the client has the whole first call
    and the second's name and arguments so far; whole, the answer is the first call; neither is content."""
    cut = text.index('"query"') + 4
    for cuts in ([], [5, 40], list(range(1, cut))):
        content, streamed = assemble(replay_deltas(make(), text[:cut], cuts))
        assert content.strip() == ""
        assert [(n, json.loads(a)) for n, a in streamed[:1]] == [("get_weather", W)]
        assert streamed[1][0] == "search" and json.dumps(S).startswith(streamed[1][1]) and streamed[1][1]
    whole = make().parser.parse(text[:cut], NAMES)
    assert (whole[0], calls_of(whole[1])) == (None, [("get_weather", W)])


def replay_deltas(stream, text, cuts):
    deltas, last = [], 0
    for cut in [c for c in sorted(cuts) if c < len(text)] + [len(text)]:
        deltas += stream.push(text[last:cut], final=cut == len(text))
        last = cut
    return deltas


def test_a_function_the_request_does_not_have_is_no_call():
    for name, text in [("hermes", '<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>'),
                       ("mistral", '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]'),
                       ("llama3_json", '{"name": "rm_rf", "parameters": {}}')]:
        assert TOOL_PARSERS[name]().parse(text, NAMES) == (text, [])
        content, calls = assemble(replay_deltas(ToolCallStream(TOOL_PARSERS[name](), NAMES), text, range(1, len(text))))
        assert (content, calls) == (text, [])
        # a name longer than any function's is given up on before it ends
        long = text.replace("rm_rf", "x" * 100_000)
        assert TOOL_PARSERS[name]().parse(long, NAMES) == (long, [])


def test_arguments_written_as_an_encoded_string_are_sent_decoded_in_one_piece():
    text = f'<tool_call>{{"name": "search", "arguments": {json.dumps(json.dumps(S))}}}</tool_call>'
    deltas = replay_deltas(ToolCallStream(TOOL_PARSERS["hermes"](), NAMES), text, range(1, len(text)))
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas][1:] == [json.dumps(S, ensure_ascii=False)]


def test_huge_and_hostile_call_text_is_read_in_bounded_time():
    """A continuation can hand a stream megabytes of text at once: a huge argument string, arguments nested past
    what any decoder takes, thousands of calls. Each is read in one pass; calls past MAX_CALLS are dropped."""
    import time

    from tokenfleet_serving.openai.tool_parsers.call_sequence import MAX_CALLS

    big = "x" * 2**22
    one = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    for text, calls in [
        (f'<tool_call>{{"name": "search", "arguments": {{"query": "{big}"}}}}</tool_call>', 1),
        ('<tool_call>{"name": "search", "arguments": {"q": ' + "[" * 2**22, 0),
        (one * 100_000, MAX_CALLS),
        (json.dumps([{"name": "search", "parameters": {}}] * 100_000), MAX_CALLS),
    ]:
        parser = TOOL_PARSERS["hermes"]() if text.startswith("<") else constrained_parser(
            parse_tools({**TOOLS, "tool_choice": "required"}))
        t0 = time.monotonic()
        stream = ToolCallStream(parser, NAMES)
        stream.push(text)
        stream.push("", final=True)
        assert len(stream.calls) == calls and time.monotonic() - t0 < 5
    # and a long argument string streamed in small pieces is read once, not again per piece
    text = f'<tool_call>{{"name": "search", "arguments": {{"query": "{big[:2**20]}"}}}}</tool_call>'
    stream, t0 = ToolCallStream(TOOL_PARSERS["hermes"](), NAMES), time.monotonic()
    sent = "".join(d["tool_calls"][0]["function"].get("arguments", "")
                   for i in range(0, len(text), 64) for d in stream.push(text[i:i + 64]))
    assert json.loads(sent) == {"query": big[:2**20]} and time.monotonic() - t0 < 10
