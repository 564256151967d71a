"""The router's vLLM backend runtime, without a network: vLLM's metrics, the record of routed blocks, a backend
that speaks neither runtime's metrics, and the token-id continuation of a broken stream (against the chunk
shapes vLLM 0.32 streams; tests/e2e/router/test_router_vllm.py runs the real thing)."""
from __future__ import annotations

import logging

from tokenfleet_serving.contract.router_files import Endpoint, parse_router_config
from tokenfleet_serving.router.backend_runtime import RUNTIME, VLLM, RoutedBlocks
from tokenfleet_serving.router.main import build_parser
from tokenfleet_serving.router.migration import StreamState, vllm_continuation, vllm_unmigratable
from tokenfleet_serving.router.policy import PolicyParams, RouteRequest, choose
from tokenfleet_serving.router.state import LOAD_SIGNALS, EngineSample, Fleet, parse_engine_metrics

# as vLLM 0.32's CPU build serves it (abridged)
VLLM_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 77.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0",num_gpu_blocks="40"} 1.0
"""


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def vllm_fleet(*endpoints: Endpoint) -> Fleet:
    f = Fleet(parse_router_config({"kvBlockSize": 32}), clock=Clock(), runtime=RUNTIME[VLLM])
    f.set_endpoints(endpoints)
    return f


def test_vllm_metrics_give_load_kv_usage_and_the_cache_size():
    s = parse_engine_metrics(VLLM_METRICS)
    assert (s.load, s.kv_usage, s.generation_tokens, s.ready) == (3, 0.5, 77, None)
    assert (s.cache_blocks, s.block_size, s.signals) == (40, 32, frozenset(LOAD_SIGNALS))


def test_routed_blocks_are_an_lru_of_the_cache_size():
    r = RoutedBlocks(3)
    r.add(["a", "b", "c"])
    r.add(["a"])              # used again: now the most recent
    r.add(["d"])              # evicts b, the least recently used
    assert list(r) == ["c", "a", "d"] and "b" not in r and len(r) == 3
    r.resize(1)
    assert list(r) == ["d"]


def test_a_vllm_replica_is_ready_by_its_metrics_and_cached_by_the_routers_record():
    f = vllm_fleet(Endpoint("a", "127.0.0.1", 1, False), Endpoint("b", "127.0.0.1", 2, True))
    for name in "ab":
        f.record_poll(name, parse_engine_metrics(VLLM_METRICS), None, None)
    # a pod the endpoints file has not called ready yet: vLLM serves /metrics only with its model loaded
    assert sorted(b.name for b in f.routable()) == ["a", "b"]
    assert f.backends["a"].routed.capacity == 40              # the replica's KV cache, from cache_config_info
    f.note_routed("b", ["h1", "h2", "h3"])
    params = PolicyParams("prefix-aware", 1.25, 0.9, 4)
    decision = choose(RouteRequest(("h1", "h2", "h9")), f.views(None), params)
    assert (decision.backend, decision.matched_blocks, decision.reason) == ("b", 2, "prefix-hit")
    # the record outlives the polls: vLLM has no /cache/blocks to replace it
    f.clock.t += 60
    f.record_poll("b", parse_engine_metrics(VLLM_METRICS), None, None)
    assert "h1" in f.backends["b"].routed


def test_a_backend_without_either_runtimes_metrics_is_routed_by_own_counts_and_logged_once(caplog):
    f = vllm_fleet(Endpoint("a", "127.0.0.1", 1, True), Endpoint("b", "127.0.0.1", 2, True))
    with caplog.at_level(logging.WARNING, logger="tokenfleet.router.state"):
        for _ in range(3):
            f.record_poll("a", EngineSample(signals=frozenset()), None, None)   # /metrics 404 or not Prometheus
            f.record_poll("b", parse_engine_metrics('other_metric 1\n'), None, None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines                                            # once per backend
    assert all("vllm:num_requests_running" in m and "own open requests" in m for m in lines)
    assert all("speaks neither runtime's metrics" in m for m in lines)
    assert sorted(b.name for b in f.routable()) == ["a", "b"]
    f.backends["a"].inflight = 3
    decision = choose(RouteRequest(()), f.views(None), PolicyParams("least-load", 1.25, 0.9, 4))
    assert decision.backend == "b"


def test_the_backend_runtime_flag():
    assert build_parser().parse_args(["--config", "c"]).backend_runtime == "tokenfleet"
    assert build_parser().parse_args(["--config", "c", "--backend-runtime", "vllm"]).backend_runtime == "vllm"


def chat_stream_state(client_ids: bool = False) -> StreamState:
    """A chat stream as vLLM sends it with return_token_ids, three tokens delivered."""
    s = StreamState(client_wants_token_ids=client_ids)
    first = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "tiny",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
             "prompt_token_ids": [3, 89, 87]}
    out = s.accept(first)
    assert out is not None and ("prompt_token_ids" in out) == client_ids
    for tid, text in ((10, "a"), (11, "b"), (12, "")):
        s.accept({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "tiny",
                  "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None, "token_ids": [tid]}]})
    return s


def test_a_chat_stream_continues_as_a_token_id_completion_relayed_as_chat_chunks():
    s = chat_stream_state()
    assert s.prompt_token_ids == [3, 89, 87] and s.token_ids == [10, 11, 12]
    original = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10, "temperature": 0,
                "seed": 7, "stop": ["zz"], "stream": True, "return_token_ids": True}
    path, body = vllm_continuation(original, s, chat=True, path="/v1/chat/completions", max_model_len=1024)
    assert path == "/v1/completions"
    assert body == {"model": "tiny", "temperature": 0, "seed": 7, "stop": ["zz"], "prompt": [3, 89, 87, 10, 11, 12],
                    "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": True}
    s.continuing = True
    s.migrations = 1
    chunk = {"id": "cmpl-9", "object": "text_completion", "created": 9, "model": "tiny",
             "choices": [{"index": 0, "text": "c", "finish_reason": None, "stop_reason": None,
                          "prompt_token_ids": [3, 89, 87, 10, 11, 12], "token_ids": [13]}]}
    out = s.accept(s.translate(chunk))
    assert out == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "tiny",
                   "choices": [{"index": 0, "delta": {"content": "c"}, "logprobs": None, "finish_reason": None,
                                "stop_reason": None}]}
    assert s.token_ids == [10, 11, 12, 13] and s.prompt_token_ids == [3, 89, 87]
    usage = s.translate({"id": "cmpl-9", "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 7,
                                                                  "total_tokens": 13}})
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}


def test_a_chat_without_a_limit_continues_to_the_end_of_the_context_and_nothing_delivered_resends():
    s = chat_stream_state(client_ids=True)
    _, body = vllm_continuation({"model": "tiny", "messages": []}, s, chat=True, path="/v1/chat/completions",
                                max_model_len=100)
    assert body["max_tokens"] == 100 - 6
    fresh = StreamState(client_wants_token_ids=False)      # broken before the first chunk
    original = {"model": "tiny", "prompt": "hello", "stream": True}
    assert vllm_continuation(original, fresh, chat=False, path="/v1/completions", max_model_len=None) == (
        "/v1/completions", original | {"return_token_ids": True})
    # a completion without max_tokens had vLLM's default of 16
    s2 = StreamState(client_wants_token_ids=False)
    s2.accept({"id": "c", "choices": [{"index": 0, "text": "a", "prompt_token_ids": [1, 2], "token_ids": [5, 6]}]})
    assert vllm_continuation({"model": "tiny", "prompt": "x"}, s2, chat=False, path="/v1/completions",
                             max_model_len=None)[1]["max_tokens"] == 14


def test_what_a_token_id_prompt_cannot_carry_is_not_migratable():
    assert vllm_unmigratable({"model": "m", "prompt": "x", "temperature": 0.5, "seed": 1}) is None
    assert vllm_unmigratable({"response_format": {"type": "text"}, "tool_choice": "none", "logprobs": False}) is None
    for extra in ({"logprobs": 2}, {"tools": [{"type": "function"}]}, {"response_format": {"type": "json_object"}},
                  {"echo": True}, {"tool_choice": "required"}):
        assert vllm_unmigratable(extra) is not None, extra


def test_a_character_split_over_the_last_tokens_is_generated_again_not_sent_twice():
    from tokenfleet_serving.router.migration import incomplete_tail
    from tokenfleet_serving.testing_models import build_tokenizer

    tok = build_tokenizer(512)
    euro = tok.encode("€").ids                      # byte-level: three tokens, one per byte
    assert len(euro) == 3
    decode = tok.decode
    assert incomplete_tail(decode, [*tok.encode("a b").ids, *euro[:2]]) == 2
    assert incomplete_tail(decode, [*tok.encode("a b").ids, *euro]) == 0
    s = chat_stream_state()                         # delivered 10, 11, 12
    _, body = vllm_continuation({"model": "tiny", "max_tokens": 10}, s, chat=True, path="/v1/chat/completions",
                                max_model_len=None, held_back=2)
    assert body["prompt"] == [3, 89, 87, 10] and body["max_tokens"] == 9 and s.skip_ids == 2
    s.continuing = True
    out = s.accept(s.translate({"id": "c", "choices": [{"index": 0, "text": "bc", "token_ids": [11, 12, 13]}]}))
    assert s.token_ids == [10, 11, 12, 13] and s.skip_ids == 0
    assert out["choices"][0]["delta"] == {"content": "bc"}
    usage = s.translate({"id": "c", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9}})["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 10)
