"""A client that goes away aborts its request in the engine and frees its KV blocks."""
from __future__ import annotations

import json
import socket
import time

import pytest

from harness.server import API_KEY, MODEL_NAME, metric_values, wait_until


def _post(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + API_KEY.encode() + b"\r\n" +
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _aborts(url: str) -> float:
    return metric_values(url).get("vllm:request_success_total{finished_reason=abort}", 0.0)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_disconnect_aborts_and_frees_blocks(live_server, stream):
    url = live_server.base_url
    wait_until(lambda: metric_values(url)["vllm:num_requests_running"] == 0, what="idle server")
    baseline_kv = metric_values(url)["vllm:kv_cache_usage_perc"]
    aborts_before = _aborts(url)
    # ~450 decode steps: far longer than this test waits for the abort
    sock = _post(live_server.port, {"model": MODEL_NAME, "prompt": list(range(5, 45)), "max_tokens": 450,
                                    "ignore_eos": True, "stream": stream})
    wait_until(lambda: metric_values(url)["vllm:num_requests_running"] == 1, what="request running")
    if stream:
        assert b"data: " in sock.recv(4096)            # tokens are flowing
    assert metric_values(url)["vllm:kv_cache_usage_perc"] > baseline_kv
    sock.close()
    t0 = time.monotonic()
    wait_until(lambda: metric_values(url)["vllm:num_requests_running"] == 0, 10, what="abort")
    values = metric_values(url)
    assert values["vllm:kv_cache_usage_perc"] == baseline_kv
    assert _aborts(url) == aborts_before + 1
    assert time.monotonic() - t0 < 10
