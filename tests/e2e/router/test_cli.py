"""``tokenfleet route`` as a process: bad input and shutdown."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.router import http, start_router, wait_until

pytestmark = pytest.mark.slow


def run_main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenfleet_serving.router.main", *args],
                          capture_output=True, text=True, timeout=60)


def test_bad_router_json_exits_2_naming_the_field(tmp_path):
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"policy": "fastest"}))
    r = run_main("--config", str(cfg))
    assert r.returncode == 2
    assert f"{cfg}: field 'policy' must be one of round-robin, least-load, prefix-aware, kv-aware" in r.stderr
    r = run_main("--config", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "missing.json: file not found" in r.stderr


def test_router_without_endpoints_or_tokenizer_is_alive_but_not_ready_and_stops_cleanly(tmp_path):
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"modelPath": str(tmp_path / "no-model")}))
    router = start_router(cfg)
    try:
        assert http("GET", f"{router.base_url}/health")[0] == 200
        status, _, body = http("GET", f"{router.base_url}/ready")
        assert status == 503 and "endpoints.json" in json.loads(body)["reason"]
        status, headers, body = http("POST", f"{router.base_url}/v1/completions", {"model": "m", "prompt": "hi"})
        assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable"
        (tmp_path / "endpoints.json").write_text("[{\"pod\": 1}]")  # a broken file is reported, not adopted
        wait_until(lambda: "field '[0].pod' must be str" in "".join(router.log), 10, what="the error in the log")
        assert "cannot load the tokenizer" in "".join(router.log)
        metrics = http("GET", f"{router.base_url}/metrics")[2].decode()
        assert "tokenfleet_router_tokenizer_loaded 0.0" in metrics
        assert router.terminate() == 0
    finally:
        router.kill()


def test_oversized_body_gets_an_openai_413(tmp_path):
    cfg = tmp_path / "router.json"
    cfg.write_text("{}")
    (tmp_path / "endpoints.json").write_text("[]")
    router = start_router(cfg, "--max-body-bytes", "1000")
    try:
        status, _, body = http("POST", f"{router.base_url}/v1/completions", {"model": "m", "prompt": "x" * 2000})
        assert status == 413
        assert json.loads(body)["error"] == {"message": "request body exceeds 1000 bytes", "type": "request_too_large",
                                             "param": None, "code": 413}
    finally:
        router.kill()
