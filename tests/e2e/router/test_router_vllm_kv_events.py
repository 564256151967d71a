"""The router following a real vLLM replica's KV events (router.json prefixSource kvEvents): one `vllm serve` of
vLLM's CPU build publishing on ZeroMQ (--kv-events-config), and `tokenfleet route --backend-runtime vllm`.

The router keys the blocks vLLM reports by its own hash of their tokens (router/kv_events.py); that the key is
right shows as prefix hits of a later request with the same prefix, counted once the router's short-lived note
of what it just routed has expired, so that only the events can account for them (once a replica's events
flow, the router no longer goes by its record of what it routed there)."""
from __future__ import annotations

import json
import time

import pytest

from tokenfleet_serving.router.state import RECENT_TTL_S

from harness.router import http, metric_samples, start_router, wait_until
from harness.vllm import BLOCK_SIZE, VllmServer, create_vllm_checkpoint, free_port, require_venv

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

KEY = "router-to-vllm-key"
NAME = "vk-0-0"
# 96 words: more than two 32-token blocks of shared prefix
SYSTEM = " ".join(("cache prefix block engine batch cluster node pod cost latency request stream " * 8).split())


@pytest.fixture(scope="module")
def events_fleet(tmp_path_factory):
    require_venv()
    d = tmp_path_factory.mktemp("vllm-kv-events")
    model = create_vllm_checkpoint(d / "model")
    port = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv"}
    server = VllmServer(model, d / "vllm.log", f"--kv-events-config={json.dumps(config)}", api_key=KEY)
    router = None
    try:
        server.wait_ready()
        (d / "router.json").write_text(json.dumps({
            "service": "vk", "namespace": "test", "models": ["tiny"], "policy": "prefix-aware",
            "kvBlockSize": BLOCK_SIZE, "modelPath": str(model), "prefixSource": "kvEvents", "kvEventsPort": port}))
        (d / "endpoints.json").write_text(json.dumps([{"pod": NAME, "slice": "vk-0", "ip": "127.0.0.1",
                                                       "port": server.port, "ready": True}]))
        router = start_router(d / "router.json", "--backend-api-key", KEY, "--backend-runtime", "vllm")
        wait_until(lambda: metric_samples(router.base_url).get("tokenfleet_router_backends{state=routable}") == 1,
                   60, what="a routable vLLM backend")
        yield {"server": server, "router": router}
    finally:
        if router is not None:
            router.kill()
        server.kill()


def test_the_blocks_vllm_reports_are_the_prompt_blocks_the_router_hashes(events_fleet):
    router = events_fleet["router"]

    def samples() -> dict:
        return metric_samples(router.base_url)

    status, _, data = http("POST", router.base_url + "/v1/completions",
                           {"model": "tiny", "prompt": f"{SYSTEM} question 0", "max_tokens": 2})
    assert status == 200, data
    # once a batch has arrived, the events are what the router counts (not its record of what it routed)
    wait_until(lambda: samples().get(f"tokenfleet_router_kv_event_batches_total{{backend={NAME}}}", 0) > 0, 30,
               what="the replica's KV events to reach the router")
    held = wait_until(lambda: (lambda n: n if n >= 2 else None)(
        samples().get(f"tokenfleet_router_backend_cached_blocks{{backend={NAME}}}", 0)), 30,
        what="the prompt's blocks in the router's record of the events")
    time.sleep(RECENT_TTL_S + 1)        # what the router itself noted as routed has expired by now
    before = samples().get("tokenfleet_router_prefix_hit_blocks_total", 0)
    status, _, data = http("POST", router.base_url + "/v1/completions",
                           {"model": "tiny", "prompt": f"{SYSTEM} question 1", "max_tokens": 2})
    assert status == 200, data
    hits = samples().get("tokenfleet_router_prefix_hit_blocks_total", 0) - before
    assert hits >= 2, (hits, held)
    # and vLLM agrees that it had them: its own prefix-cache hits
    vllm = metric_samples(events_fleet["server"].base_url)
    assert sum(v for k, v in vllm.items() if k.startswith("vllm:prefix_cache_hits_total")) >= hits * BLOCK_SIZE
