"""When the engine breaks, probes say so and clients get errors instead of hanging."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from tokenfleet_serving.engine.engine import LLMEngine

from harness.server import MODEL_NAME, ThreadServer, http, server_config, wait_until

OK = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}


class FaultyEngine(LLMEngine):
    """A real engine whose next step fails once ``fault`` is set (a device fault, say)."""
    fault = threading.Event()

    def step(self):
        if self.fault.is_set():
            raise RuntimeError("simulated device fault")
        return super().step()


def test_engine_death_fails_requests_and_probes(tiny_model):
    FaultyEngine.fault.clear()
    srv = ThreadServer(server_config(tiny_model, api_key=None), engine_factory=FaultyEngine)
    try:
        assert http("POST", f"{srv.base_url}/v1/completions", OK)[0] == 200
        FaultyEngine.fault.set()
        status, _, body = http("POST", f"{srv.base_url}/v1/completions", OK)
        assert status == 503 and "simulated device fault" in json.loads(body)["error"]["message"]
        wait_until(lambda: http("GET", f"{srv.base_url}/health")[0] == 503, what="/health 503")
        assert http("GET", f"{srv.base_url}/ready")[0] == 503
        assert http("POST", f"{srv.base_url}/v1/completions", OK)[0] == 503
    finally:
        srv.stop()


def test_model_that_fails_to_load_exits_1(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    proc = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "serve", "--model", str(tmp_path),
                           "--host", "127.0.0.1", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "architectures" in proc.stderr


class HeldEngine(LLMEngine):
    """A real engine whose steps with work wait at ``gate``; ``fault`` makes the held step raise."""
    gate, stepping = threading.Event(), threading.Event()
    fault: BaseException | None = None

    def step(self):
        if self.has_unfinished():
            self.stepping.set()
            assert self.gate.wait(120), "the test never opened the gate"
            if self.fault is not None:
                raise self.fault
        return super().step()


def _fire(base_url: str, n: int, results: list) -> list[threading.Thread]:
    def one() -> None:
        results.append(http("POST", f"{base_url}/v1/completions", dict(OK, max_tokens=50), timeout=60))
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _held_server(tiny_model, **overrides) -> ThreadServer:
    HeldEngine.gate.set()                       # warm-up passes through
    HeldEngine.fault = None
    srv = ThreadServer(server_config(tiny_model, api_key=None, **overrides), engine_factory=HeldEngine)
    HeldEngine.gate.clear()
    HeldEngine.stepping.clear()
    return srv


def test_requests_waiting_in_the_inbox_are_answered_when_the_engine_dies(tiny_model):
    """One request is held in a step, three more wait in the engine's inbox; the step then fails. All four
    get a 503 (before: the three in the inbox waited forever)."""
    srv = _held_server(tiny_model)
    results: list = []
    try:
        threads = _fire(srv.base_url, 1, results)
        assert HeldEngine.stepping.wait(60)
        threads += _fire(srv.base_url, 3, results)
        loop = srv.server.engine_loop
        wait_until(lambda: srv.call(lambda: len(loop._inbox)) == 3, what="three requests in the inbox")
        HeldEngine.fault = RuntimeError("simulated device fault")
        HeldEngine.gate.set()
        for t in threads:
            t.join(60)
        assert len(results) == 4 and all(status == 503 for status, _, _ in results), results
        assert all(json.loads(body)["error"]["type"] == "service_unavailable" for _, _, body in results)
        assert http("GET", f"{srv.base_url}/health")[0] == 503
    finally:
        HeldEngine.gate.set()
        srv.stop()


def test_a_stalled_engine_answers_everyone_and_fails_liveness(tiny_model):
    """A step that never returns: the watchdog (driven here with the clock it would see a while later)
    answers the waiting requests with 503 and turns /health to 503 so the pod is restarted."""
    srv = _held_server(tiny_model, engine_stall_timeout_s=60)
    results: list = []
    try:
        server = srv.server
        assert server._watchdog is not None and not server._watchdog.done(), "the watchdog runs"
        threads = _fire(srv.base_url, 1, results)
        assert HeldEngine.stepping.wait(60)
        threads += _fire(srv.base_url, 2, results)
        loop = server.engine_loop
        wait_until(lambda: srv.call(lambda: loop.num_in_flight) == 3, what="three requests in flight")
        assert http("GET", f"{srv.base_url}/health")[0] == 200
        assert srv.call(loop.check_stalled, time.monotonic() + 61) is True
        for t in threads:
            t.join(60)
        assert [status for status, _, _ in results] == [503] * 3, results
        assert all("stall" in json.loads(body)["error"]["message"] for _, _, body in results)
        status, _, body = http("GET", f"{srv.base_url}/health")
        assert status == 503 and "stall" in json.loads(body)["error"]
        assert http("POST", f"{srv.base_url}/v1/completions", OK)[0] == 503
    finally:
        HeldEngine.gate.set()
        srv.stop()
