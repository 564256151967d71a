"""Bad input over real HTTP: an OpenAI-shaped error with the right status, and the server keeps serving."""
from __future__ import annotations

import json
import socket
import threading

import pytest

from tokenfleet_serving.engine.engine import LLMEngine

from harness.server import API_KEY, MODEL_NAME, ThreadServer, http, metric_values, server_config, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OK = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}

CASES = [
    # (name, method, path, body, headers, status, param)
    ("malformed json", "POST", "/v1/completions", b"{not json", AUTH, 400, None),
    ("not utf-8", "POST", "/v1/completions", b"\xff\xfe\x00", AUTH, 400, None),
    ("json array", "POST", "/v1/completions", b"[1,2]", AUTH, 400, None),
    ("wrong type", "POST", "/v1/completions", dict(OK, max_tokens="2"), AUTH, 400, "max_tokens"),
    ("unknown parameter", "POST", "/v1/completions", dict(OK, wibble=1), AUTH, 400, "wibble"),
    ("absurd max_tokens", "POST", "/v1/completions", dict(OK, max_tokens=10**9), AUTH, 400, "max_tokens"),
    ("absurd temperature", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "temperature": 99}, AUTH, 400,
     "temperature"),
    ("prompt over context", "POST", "/v1/completions", dict(OK, prompt=[7] * 600), AUTH, 400, "prompt"),
    ("token id outside vocab", "POST", "/v1/completions", dict(OK, prompt=[1, 10**6]), AUTH, 400, "prompt"),
    ("unknown model", "POST", "/v1/completions", dict(OK, model="gpt-9"), AUTH, 404, "model"),
    ("unknown model chat", "POST", "/v1/chat/completions",
     {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, AUTH, 404, "model"),
    ("oversized body", "POST", "/v1/completions", dict(OK, prompt="x " * 40000), AUTH, 413, None),
    ("no api key", "POST", "/v1/completions", OK, {}, 401, None),
    ("wrong api key", "GET", "/v1/models", None, {"Authorization": "Bearer nope"}, 401, None),
    ("unknown route", "GET", "/v1/nothing", None, AUTH, 404, None),
    ("wrong method", "GET", "/v1/completions", None, AUTH, 405, None),
]


@pytest.mark.parametrize("name,method,path,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_error(live_server, name, method, path, body, headers, status, param):
    got, _, raw = http(method, f"{live_server.base_url}{path}", body, headers)
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert err["code"] == status and err["message"] and err["type"]
    assert err["param"] == param


def test_server_keeps_serving_after_bad_input(live_server):
    for _, method, path, body, headers, _, _ in CASES:
        http(method, f"{live_server.base_url}{path}", body, headers)
    status, _, raw = http("POST", f"{live_server.base_url}/v1/completions", OK, AUTH)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2
    values = metric_values(live_server.base_url)
    assert values["tokenfleet:requests_rejected_total{code=400}"] >= 9
    assert values["vllm:num_requests_running"] == 0


def test_oversized_chunked_body_is_413(live_server):
    """No Content-Length: the limit still holds while the body streams in."""
    host, port = "127.0.0.1", live_server.port
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 8192
        try:
            for _ in range(20):
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass          # the server may close once it has refused the body
        reply = s.recv(65536).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413"), reply[:200]


class GatedEngine(LLMEngine):
    """A real engine whose steps wait for the test's ``gate``; ``stepping`` is set once a step waits."""
    gate, stepping = threading.Event(), threading.Event()

    def step(self):
        if self.has_unfinished():
            self.stepping.set()
            assert self.gate.wait(120), "the test never opened the gate"
        return super().step()


def test_full_queue_gets_429_with_retry_after(tiny_model):
    """The queue is filled while the engine is held at a step, so the outcome never depends on the host's speed."""
    GatedEngine.gate.set()                      # warm-up passes through
    srv = ThreadServer(server_config(tiny_model, max_queue=2, max_num_seqs=1, api_key=None),
                       engine_factory=GatedEngine)
    try:
        GatedEngine.gate.clear()
        GatedEngine.stepping.clear()
        results: dict[str, tuple[int, dict]] = {}

        def fire(name: str) -> threading.Thread:
            def run() -> None:
                status, headers, _ = http("POST", f"{srv.base_url}/v1/completions", dict(OK, max_tokens=4))
                results[name] = (status, headers)
            t = threading.Thread(target=run)
            t.start()
            return t

        loop = srv.server.engine_loop
        first = fire("first")                   # taken into the engine; its step waits at the gate
        assert GatedEngine.stepping.wait(60)
        second = fire("second")                 # waits in the queue: the queue is now full (2)
        wait_until(lambda: srv.call(lambda: loop.num_in_flight) == 2, what="the second request queued")
        third = fire("third")
        third.join(60)
        assert results["third"][0] == 429 and results["third"][1].get("Retry-After") == "1", results
        GatedEngine.gate.set()
        first.join(60)
        second.join(60)
        assert results["first"][0] == 200 and results["second"][0] == 200, results
        # once the queue empties the server admits again
        wait_until(lambda: srv.call(lambda: loop.queue_depth()) == 0, what="an empty queue")
        assert http("POST", f"{srv.base_url}/v1/completions", OK)[0] == 200
    finally:
        GatedEngine.gate.set()
        srv.stop()
