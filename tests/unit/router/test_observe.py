"""What the router observes of a request: events split from a byte stream, first token, usage, and the SLO
verdict under vLLM's definitions."""
from tokenfleet_serving.contract.router_files import Slo
from tokenfleet_serving.openai.sse import SseEvents, event_json
from tokenfleet_serving.router.observe import (
    Timing,
    ask_for_usage,
    carries_output,
    completion_tokens,
    is_client_error,
    is_usage_only,
    meets_slo,
)


def test_events_are_split_across_arbitrary_chunk_boundaries():
    stream = (b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
              b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
              b'data: {"choices":[],"usage":{"completion_tokens":7}}\n\ndata: [DONE]\n\n')
    for size in (1, 3, 17, len(stream)):
        parser, events = SseEvents(), []
        for i in range(0, len(stream), size):
            events += parser.feed(stream[i:i + size])
        assert b"".join(events) == stream and parser.rest() == b""
        objs = [event_json(e) for e in events]
        assert [carries_output(o) if o else None for o in objs] == [False, True, False, None]
        assert is_usage_only(objs[2]) and completion_tokens(objs[2]) == 7


def test_a_token_that_decodes_to_no_text_yet_is_the_first_token():
    # the server holds back text that is not whole yet (a partial UTF-8 sequence, a possible stop string); the
    # token is out all the same, and its id is in the chunk the router asked for
    assert carries_output({"choices": [{"index": 0, "text": "", "token_ids": [317]}]})
    assert not carries_output({"choices": [{"index": 0, "text": "", "token_ids": []}]})


def test_the_router_asks_for_usage_and_remembers_whether_the_client_did():
    body = {"stream": True}
    assert not ask_for_usage(body) and body["stream_options"] == {"include_usage": True}
    body = {"stream": True, "stream_options": {"include_usage": True}}
    assert ask_for_usage(body)


def timing(ttft, e2e, tokens, stream=True, ok=True):
    return Timing(100.0, stream, first_token=100.0 + ttft if ttft is not None else None, finished=100.0 + e2e,
                  output_tokens=tokens, ok=ok)


def test_slo_verdicts():
    slo = Slo(ttft_ms=500, tpot_ms=50)
    assert meets_slo(slo, timing(0.4, 0.4 + 9 * 0.05, 10))
    assert not meets_slo(slo, timing(0.6, 1.0, 10))                 # first token too late
    assert not meets_slo(slo, timing(0.2, 0.2 + 9 * 0.06, 10))      # tokens too slow after it
    assert meets_slo(slo, timing(0.2, 0.2, 1))                      # one token: no TPOT to judge
    assert not meets_slo(slo, timing(0.1, 0.2, 3, ok=False))        # a failed request misses
    # non-streamed: finished by the time a stream within both targets would have
    assert meets_slo(slo, timing(None, 0.5 + 9 * 0.05, 10, stream=False))
    assert not meets_slo(slo, timing(None, 0.5 + 9 * 0.05 + 0.01, 10, stream=False))
    assert meets_slo(Slo(), timing(5.0, 50.0, 10))                  # no targets: every success meets it


def test_client_errors_are_4xx_but_a_replica_at_capacity_is_the_fleets_fault():
    """Issue 37, defect 3: requests refused for the client's fault stay out of the SLO signal; a 429 (a replica
    at capacity), a 5xx and a timeout are the fleet's and count as misses."""
    assert all(is_client_error(s) for s in (400, 401, 404, 408, 413, 415, 422, 431))
    assert not any(is_client_error(s) for s in (200, 429, 500, 502, 503, 504))
