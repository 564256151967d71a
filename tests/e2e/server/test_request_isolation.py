"""No request can kill the engine: the requests that did (issue 19) are answered, and a failure injected
into one request of a running batch fails that request alone while the others are served to the end."""
from __future__ import annotations

import json
import threading

import pytest

from tokenfleet_serving.engine import engine as engine_module
from tokenfleet_serving.engine.engine import LLMEngine

from harness.server import API_KEY, MODEL_NAME, ThreadServer, http, metric_values, server_config, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 3}
COMPLETION = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 3}


def _both(**fields):
    return [pytest.param(dict(COMPLETION, **fields), "/v1/completions", id=f"completions-{fields}"),
            pytest.param(dict(CHAT, **fields), "/v1/chat/completions", id=f"chat-{fields}")]


@pytest.mark.parametrize("body,path", [p for t in (1e-300, 5e-324, 1e-45) for p in _both(temperature=t)])
def test_tiny_temperatures_are_served(live_server, body, path):
    status, _, raw = http("POST", live_server.base_url + path, body, AUTH)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 3
    assert http("GET", live_server.base_url + "/health")[0] == 200


@pytest.mark.parametrize("body,path", [p for v in (1e-300, 1e-45) for p in _both(repetition_penalty=v)])
def test_repetition_penalties_that_cannot_be_computed_are_400_naming_it(live_server, body, path):
    status, _, raw = http("POST", live_server.base_url + path, body, AUTH)
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert err["param"] == "repetition_penalty" and err["code"] == 400 and err["type"] == "invalid_request_error"


RAW_400 = [
    ("surrogate in the prompt", "/v1/completions", b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("surrogate in a chat message", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}', "messages[0].content"),
    ("surrogate in a stop string", "/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}',
     "stop[0]"),
    ("nested 5,000 deep", "/v1/completions", b"[" * 5000 + b"]" * 5000, None),
    ("integer of 5,000 digits", "/v1/completions",
     b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", None),
]


@pytest.mark.parametrize("name,path,raw,param", RAW_400, ids=[c[0] for c in RAW_400])
def test_bodies_that_were_500s_are_400s(live_server, name, path, raw, param):
    status, _, body = http("POST", live_server.base_url + path, raw, AUTH)
    assert status == 400, body
    err = json.loads(body)["error"]
    assert err["code"] == 400 and err["param"] == param and err["message"]


def test_the_engine_lived_through_all_of_it(live_server):
    for body, path in [(dict(COMPLETION, temperature=1e-300), "/v1/completions"),
                       (dict(CHAT, repetition_penalty=1e-45), "/v1/chat/completions")]:
        http("POST", live_server.base_url + path, body, AUTH)
    assert http("GET", live_server.base_url + "/health")[0] == 200
    assert http("GET", live_server.base_url + "/ready")[0] == 200
    status, _, raw = http("POST", live_server.base_url + "/v1/completions", COMPLETION, AUTH)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3


# ---- a failure injected into one request of a running batch ---------------------------------------------

POISON_SEED = 424242          # greedy requests ignore their seed: it marks the victim and changes nothing else


class SteppedEngine(LLMEngine):
    """A real engine whose steps each wait for a permit from the test, until ``free`` is set."""
    permits, free, waiting = threading.Semaphore(0), threading.Event(), threading.Event()

    def step(self):
        if self.has_unfinished() and not self.free.is_set():
            self.waiting.set()
            assert self.permits.acquire(timeout=120), "the test never released a step"
            self.waiting.clear()
        return super().step()


def _stream(base_url: str, seed: int | None, results: dict, name: str) -> threading.Thread:
    body = {"model": MODEL_NAME, "prompt": f"request {name} of the batch", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed

    def run() -> None:
        status, _, raw = http("POST", f"{base_url}/v1/completions", body)
        events = [line[len("data: "):] for line in raw.decode().split("\n") if line.startswith("data: ")]
        results[name] = (status, events)
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_failure_injected_into_one_request_of_a_running_batch_fails_it_alone(tiny_model, monkeypatch):
    real_sample = engine_module.sample
    armed = threading.Event()

    def sample(logits, reqs):
        if armed.is_set() and any(r.params.seed == POISON_SEED for r in reqs):
            raise RuntimeError("injected fault in the victim's sampling")
        return real_sample(logits, reqs)

    monkeypatch.setattr(engine_module, "sample", sample)
    SteppedEngine.free.set()                                  # warm-up passes through
    srv = ThreadServer(server_config(tiny_model, api_key=None), engine_factory=SteppedEngine)
    threads: list[threading.Thread] = []
    try:
        SteppedEngine.free.clear()
        engine, loop = srv.server.engine, srv.server.engine_loop
        results: dict[str, tuple[int, list[str]]] = {}
        threads.append(_stream(srv.base_url, None, results, "a"))
        wait_until(lambda: SteppedEngine.waiting.is_set() and len(engine.requests) == 1, what="a held at a step")
        threads += [_stream(srv.base_url, POISON_SEED, results, "victim"), _stream(srv.base_url, None, results, "c")]
        wait_until(lambda: srv.call(lambda: loop.num_in_flight) == 3, what="two more in the inbox")
        steps = engine.stats().num_steps
        SteppedEngine.permits.release(4)                      # a's prefill, then three steps of all three
        wait_until(lambda: engine.stats().num_steps == steps + 4 and SteppedEngine.waiting.is_set(),
                   what="four steps")
        victim = next(r for r in engine.requests.values() if r.params.seed == POISON_SEED)
        assert engine.stats().num_running == 3 and len(victim.output_token_ids) >= 2, "the victim runs in the batch"
        armed.set()
        SteppedEngine.free.set()
        SteppedEngine.permits.release()
        for t in threads:
            t.join(120)

        status, events = results["victim"]
        assert status == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 500 and error["type"] == "server_error"
        assert "injected fault in the victim's sampling" in error["message"]
        for name in ("a", "c"):
            status, events = results[name]
            chunks = [json.loads(e) for e in events[:-1]]
            assert status == 200 and events[-1] == "[DONE]" and not any("error" in c for c in chunks)
            assert chunks[-1]["usage"]["completion_tokens"] == 40
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"

        # the engine serves on: probes, a plain request, and a non-streamed victim gets a 500 body
        assert http("GET", f"{srv.base_url}/health")[0] == 200 and http("GET", f"{srv.base_url}/ready")[0] == 200
        status, _, raw = http("POST", f"{srv.base_url}/v1/completions", dict(COMPLETION, seed=POISON_SEED))
        assert status == 500 and json.loads(raw)["error"]["code"] == 500
        assert http("POST", f"{srv.base_url}/v1/completions", COMPLETION)[0] == 200
        values = metric_values(srv.base_url)
        assert values["vllm:request_success_total{finished_reason=error}"] == 2
        assert values["vllm:num_requests_running"] == 0 and values["vllm:kv_cache_usage_perc"] == 0
    finally:
        SteppedEngine.free.set()
        SteppedEngine.permits.release(8)
        for t in threads:
            t.join(60)
        srv.stop()
