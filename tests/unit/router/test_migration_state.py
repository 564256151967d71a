"""What the router keeps of a stream to continue it elsewhere (``router/migration.py``), pure."""
from __future__ import annotations

import json

from tokenfleet_serving.openai.sse import error_event, is_done
from tokenfleet_serving.router.migration import LIMIT, NOT_MIGRATABLE, StreamState, failure_message, migratable_error


def chunk(text, ids, finish=None, rid="cmpl-1", created=100, **choice):
    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, **choice}
    if ids is not None:
        c["token_ids"] = ids
    return {"id": rid, "object": "text_completion", "created": created, "model": "m", "choices": [c]}


def chat_chunk(delta, ids, finish=None, rid="chatcmpl-1"):
    c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        c["token_ids"] = ids
    return {"id": rid, "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [c]}


def test_it_collects_tokens_and_text_and_hides_token_ids_the_client_did_not_ask_for():
    s = StreamState(client_wants_token_ids=False)
    out = s.accept(chunk("he", [5]))
    assert out is not None and "token_ids" not in out["choices"][0]
    assert s.accept(chunk("", [6])) is None          # there only for its token id
    out = s.accept(chunk("llo", [7], finish="length"))
    assert out["choices"][0]["text"] == "llo" and s.finished
    assert s.token_ids == [5, 6, 7] and s.delivered_text == "hello"
    assert s.continuation_body({"model": "m", "prompt": "p"})["continuation"] == {
        "output_token_ids": [5, 6, 7], "delivered_text": "hello"}


def test_a_client_that_asked_for_token_ids_keeps_them():
    s = StreamState(client_wants_token_ids=True)
    assert s.accept(chunk("", [6]))["choices"][0]["token_ids"] == [6]


def test_a_continued_stream_keeps_the_first_streams_id_and_drops_a_second_opening_chunk():
    s = StreamState(client_wants_token_ids=False)
    assert s.accept(chat_chunk({"role": "assistant", "content": ""}, None)) is not None
    s.accept(chat_chunk({"content": "a"}, [3]))
    s.continuing = True
    assert s.accept(chat_chunk({"role": "assistant", "content": ""}, None, rid="chatcmpl-2")) is None
    out = s.accept(chat_chunk({"content": "b"}, [4], rid="chatcmpl-2"))
    assert out["id"] == "chatcmpl-1" and out["created"] == 7
    usage = s.accept({"id": "chatcmpl-2", "created": 9, "choices": [], "usage": {"completion_tokens": 2}})
    assert usage["id"] == "chatcmpl-1" and usage["created"] == 7
    assert s.token_ids == [3, 4] and s.delivered_text == "ab"


def test_output_without_token_ids_or_with_several_choices_cannot_be_moved():
    s = StreamState(client_wants_token_ids=False)
    s.accept(chunk("x", None))
    assert s.why_not(3) == NOT_MIGRATABLE and "token ids" in s.unmigratable
    s = StreamState(client_wants_token_ids=False)
    two = chunk("x", [1])
    two["choices"].append({**two["choices"][0], "index": 1})
    s.accept(two)
    assert s.why_not(3) == NOT_MIGRATABLE and "several choices" in s.unmigratable


def test_the_limit_counts_migrations():
    s = StreamState(client_wants_token_ids=False)
    assert s.why_not(1) is None
    s.migrations = 1
    assert s.why_not(1) == LIMIT and s.why_not(0) == LIMIT
    assert "migrationLimit 1" in failure_message(LIMIT, "backend-disconnected", s, 1)


def test_which_error_events_mean_the_backend_is_going_away():
    assert migratable_error({"error": {"code": 503, "message": "draining"}}) == 503
    assert migratable_error({"error": {"code": 500, "message": "this request failed"}}) is None
    assert migratable_error({"choices": []}) is None
    s = StreamState(client_wants_token_ids=False)
    assert s.accept({"error": {"code": 500}}) == {"error": {"code": 500}} and s.errored


def test_events_on_the_wire():
    event = error_event(502, "gone")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {"error": {"message": "gone", "type": "bad_gateway", "param": None, "code": 502}}
    assert is_done(b"data: [DONE]\n\n") and not is_done(b"data: {}\n\n")


def test_a_tool_call_stream_keeps_the_generated_text_and_relays_the_calls():
    """A tool-call chunk's visible delta is parsed output; its output_text is what the token ids decode to: the
    continuation needs the latter, the client sees neither output_text nor token ids (unless it asked)."""
    state = StreamState(client_wants_token_ids=False)
    held = {"id": "c", "created": 1, "choices": [{"index": 0, "delta": {}, "finish_reason": None,
                                                  "token_ids": [5, 6], "output_text": "<tool_call>{"}]}
    assert state.accept(held) is None                       # nothing visible yet: dropped
    call = {"index": 0, "id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chunk = {"id": "c", "created": 1, "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None,
                                                   "token_ids": [7], "output_text": "}</tool_call>"}]}
    relayed = state.accept(chunk)
    assert relayed["choices"][0] == {"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}
    assert state.token_ids == [5, 6, 7] and state.delivered_text == "<tool_call>{}</tool_call>"
    assert state.continuation_body({"model": "m"})["continuation"] == {
        "output_token_ids": [5, 6, 7], "delivered_text": "<tool_call>{}</tool_call>"}
