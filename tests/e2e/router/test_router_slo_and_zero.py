"""The router measures goodput where the requests pass, holds requests while no replica is up (scale from
zero), and stops sending new requests to a draining replica (scale-down)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from harness.router import MODEL_NAME, ROUTER_KEY, http, metric_samples, start_backend, start_router, wait_until, write_endpoints

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def backends(tiny_model):
    started = {}
    try:
        started["tiny-0-0"] = start_backend(tiny_model, "--api-key", ROUTER_KEY)
        started["tiny-1-0"] = start_backend(tiny_model, "--api-key", ROUTER_KEY)
        yield started
    finally:
        for p in started.values():
            p.kill()


def router_for(tmp_path, tiny_model, endpoints, **config):
    base = {"service": "tiny", "namespace": "t", "models": [MODEL_NAME], "policy": "least-load", "kvBlockSize": 16,
            "modelPath": str(tiny_model)}
    (tmp_path / "router.json").write_text(json.dumps(base | config))
    write_endpoints(tmp_path / "endpoints.json", endpoints)
    return start_router(tmp_path / "router.json", "--backend-api-key", ROUTER_KEY)


def stream(base_url, **extra):
    status, headers, raw = http("POST", f"{base_url}/v1/completions",
                                {"model": MODEL_NAME, "prompt": "count the tokens", "max_tokens": 6,
                                 "temperature": 0, "ignore_eos": True, "stream": True, **extra})
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return status, headers, events


def test_latencies_tokens_and_slo_outcomes_are_counted(tmp_path, tiny_model, backends):
    generous = router_for(tmp_path, tiny_model, backends, slo={"timeToFirstTokenMs": 600000, "timePerOutputTokenMs": 60000})
    strict_dir = tmp_path / "strict"
    strict_dir.mkdir()
    strict = router_for(strict_dir, tiny_model, backends, slo={"timeToFirstTokenMs": 1})   # 1 ms: nobody meets it
    try:
        for r in (generous, strict):
            wait_until(lambda r=r: http("GET", f"{r.base_url}/ready")[0] == 200, 60, what="router ready")
            status, _, events = stream(r.base_url)
            assert status == 200 and not any("usage" in e and not e.get("choices") for e in events)  # not asked
            status, _, events = stream(r.base_url, stream_options={"include_usage": True})
            assert status == 200 and events[-1]["usage"]["completion_tokens"] == 6                   # asked: kept
            status, _, raw = http("POST", f"{r.base_url}/v1/completions",
                                  {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4, "ignore_eos": True})
            assert status == 200
        g, s = metric_samples(generous.base_url), metric_samples(strict.base_url)
        assert g["tokenfleet_router_slo_requests_total{result=met}"] == 3
        assert s["tokenfleet_router_slo_requests_total{result=missed}"] == 3
        for m in (g, s):
            assert m["tokenfleet_router_output_tokens_total"] == 6 + 6 + 4
            assert m["tokenfleet_router_time_to_first_token_seconds_count"] == 2     # the streamed ones
            assert m["tokenfleet_router_time_per_output_token_seconds_count"] == 2
            assert m["tokenfleet_router_e2e_request_latency_seconds_count"] == 3
        assert g["tokenfleet_router_slo_output_tokens_total{result=met}"] == 16
    finally:
        generous.kill()
        strict.kill()


def test_scale_from_zero_holds_requests_until_a_replica_is_up(tmp_path, tiny_model, backends):
    router = router_for(tmp_path, tiny_model, {}, scaleFromZero={"maxPendingRequests": 2, "pendingTimeoutSeconds": 60})
    try:
        wait_until(lambda: http("GET", f"{router.base_url}/ready")[0] == 200, 60, what="ready with no replica")
        results = []
        threads = [threading.Thread(target=lambda: results.append(stream(router.base_url)[0])) for _ in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: metric_samples(router.base_url)["tokenfleet_router_pending_requests"] == 2, 30,
                   what="two held requests")
        status, headers, _ = http("POST", f"{router.base_url}/v1/completions", {"model": MODEL_NAME, "prompt": "x"})
        assert status == 503 and headers.get("Retry-After")                  # the hold queue is bounded
        time.sleep(1)
        write_endpoints(tmp_path / "endpoints.json", {"tiny-0-0": backends["tiny-0-0"]})   # the replica is up
        for t in threads:
            t.join(60)
        assert results == [200, 200]
        m = metric_samples(router.base_url)
        assert m["tokenfleet_router_cold_start_seconds_count"] == 2 and m["tokenfleet_router_cold_start_seconds_sum"] >= 2
        assert m["tokenfleet_router_pending_requests"] == 0
    finally:
        router.kill()


def test_a_held_request_times_out_with_503_and_retry_after(tmp_path, tiny_model):
    router = router_for(tmp_path, tiny_model, {}, scaleFromZero={"maxPendingRequests": 4, "pendingTimeoutSeconds": 1})
    try:
        wait_until(lambda: http("GET", f"{router.base_url}/ready")[0] == 200, 60, what="router ready")
        status, headers, body = http("POST", f"{router.base_url}/v1/completions", {"model": MODEL_NAME, "prompt": "x"})
        assert status == 503 and headers.get("Retry-After") and json.loads(body)["error"]["code"] == 503
        assert metric_samples(router.base_url)["tokenfleet_router_slo_requests_total{result=missed}"] == 1
    finally:
        router.kill()


def test_a_draining_replica_gets_no_new_requests(tmp_path, tiny_model, backends):
    router = router_for(tmp_path, tiny_model, backends)
    try:
        entries = [{"pod": n, "slice": n[:-2], "ip": "127.0.0.1", "port": p.port, "ready": True,
                    "draining": n == "tiny-1-0"} for n, p in backends.items()]
        (tmp_path / "endpoints.json").write_text(json.dumps(entries))
        wait_until(lambda: metric_samples(router.base_url).get("tokenfleet_router_backend_draining{backend=tiny-1-0}") == 1,
                   30, what="the draining flag read")
        served = {http("POST", f"{router.base_url}/v1/completions",
                       {"model": MODEL_NAME, "prompt": f"p{i}", "max_tokens": 1})[1]["x-tokenfleet-backend"]
                  for i in range(8)}
        assert served == {"tiny-0-0"}
    finally:
        router.kill()


def test_a_request_whose_replica_died_waits_for_it_and_counts_as_a_cold_start(tmp_path, tiny_model, backends):
    """The gang restart case: the replica dies while the router still routes to it; the request it refused waits
    (noReplicaHoldSeconds) until the replacement, a pod of the same name at a new address, is listed. It waited
    for a replica: a cold start, like a request that found none ready when it arrived."""
    doomed = start_backend(tiny_model, "--api-key", ROUTER_KEY, "--host", "0.0.0.0")   # reachable at 127.0.0.2
    router = router_for(tmp_path, tiny_model, {}, noReplicaHoldSeconds=60)
    try:
        (tmp_path / "endpoints.json").write_text(json.dumps(
            [{"pod": "tiny-0-0", "slice": "tiny-0", "ip": "127.0.0.2", "port": doomed.port, "ready": True}]))
        wait_until(lambda: stream(router.base_url)[0] == 200, 60, what="the replica serving through the router")
        before = metric_samples(router.base_url).get("tokenfleet_router_cold_start_seconds_count", 0)
        doomed.kill()
        results = []
        t = threading.Thread(target=lambda: results.append(stream(router.base_url)[0]))
        t.start()
        wait_until(lambda: metric_samples(router.base_url)["tokenfleet_router_pending_requests"] == 1, 30,
                   what="the request held")
        replacement = [{"pod": "tiny-0-0", "slice": "tiny-0", "ip": "127.0.0.1", "port": backends["tiny-0-0"].port,
                        "ready": True}]
        (tmp_path / "endpoints.json").write_text(json.dumps(replacement))
        t.join(60)
        assert results == [200]
        assert metric_samples(router.base_url)["tokenfleet_router_cold_start_seconds_count"] == before + 1
    finally:
        router.kill()
        doomed.kill()
