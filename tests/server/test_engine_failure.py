"""When the engine breaks, probes say so and clients get errors instead of hanging."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

from tokenfleet_serving.engine.engine import LLMEngine

from server_harness import MODEL_NAME, ThreadServer, http, server_config, wait_until

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
