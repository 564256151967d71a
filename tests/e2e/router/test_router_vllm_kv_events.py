"""The router following a real vLLM replica's KV events (router.json prefixSource kvEvents): one `vllm serve` of
vLLM's CPU build publishing on ZeroMQ (--kv-events-config), and `tokenfleet route --backend-runtime vllm`.

The router keys the blocks vLLM reports by its own hash of their tokens (router/kv_events.py); that the key is
right shows as prefix hits, through the router, of a prompt whose prefix reached the replica past the router.
A router started after the replica stored a prefix learns it from vLLM's replay socket (replay_endpoint)."""
from __future__ import annotations

import json

import pytest

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
    port, replay_port = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv",
              "replay_endpoint": f"tcp://*:{replay_port}"}
    server = VllmServer(model, d / "vllm.log", f"--kv-events-config={json.dumps(config)}", api_key=KEY)
    router = None
    try:
        server.wait_ready()
        (d / "router.json").write_text(json.dumps({
            "service": "vk", "namespace": "test", "models": ["tiny"], "policy": "prefix-aware",
            "kvBlockSize": BLOCK_SIZE, "modelPath": str(model), "prefixSource": "kvEvents", "kvEventsPort": port,
            "kvEventsReplayPort": replay_port}))
        (d / "endpoints.json").write_text(json.dumps([{"pod": NAME, "slice": "vk-0", "ip": "127.0.0.1",
                                                       "port": server.port, "ready": True}]))
        router = start_router(d / "router.json", "--backend-api-key", KEY, "--backend-runtime", "vllm")
        wait_until(lambda: metric_samples(router.base_url).get("tokenfleet_router_backends{state=routable}") == 1,
                   60, what="a routable vLLM backend")
        yield {"server": server, "router": router, "dir": d}
    finally:
        if router is not None:
            router.kill()
        server.kill()


def past_the_router(server, prompt: str) -> None:
    """The replica serves ``prompt`` for another client of it, not through the router."""
    status, _, data = http("POST", server.base_url + "/v1/completions",
                           {"model": "tiny", "prompt": prompt, "max_tokens": 2},
                           headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, data


def prefix_hits_through(router_url: str, prompt: str) -> float:
    """The prompt blocks the router found cached when it routed ``prompt``."""
    before = metric_samples(router_url).get("tokenfleet_router_prefix_hit_blocks_total", 0)
    status, _, data = http("POST", router_url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert status == 200, data
    return metric_samples(router_url).get("tokenfleet_router_prefix_hit_blocks_total", 0) - before


def test_the_blocks_vllm_reports_are_the_prompt_blocks_the_router_hashes(events_fleet):
    """The first request goes to the replica past the router (another client of it): only the replica's
    events can tell the router that it now holds the prefix."""
    router, server = events_fleet["router"], events_fleet["server"]

    def samples() -> dict:
        return metric_samples(router.base_url)

    past_the_router(server, f"{SYSTEM} question 0")
    wait_until(lambda: samples().get(f"tokenfleet_router_kv_event_batches_total{{backend={NAME}}}", 0) > 0, 30,
               what="the replica's KV events to reach the router")
    held = wait_until(lambda: (lambda n: n if n >= 2 else None)(
        samples().get(f"tokenfleet_router_backend_cached_blocks{{backend={NAME}}}", 0)), 30,
        what="the prompt's blocks in the router's record of the events")
    hits = prefix_hits_through(router.base_url, f"{SYSTEM} question 1")
    assert hits >= 2, (hits, held)
    # and vLLM agrees that it had them: its own prefix-cache hits
    vllm = metric_samples(server.base_url)
    assert sum(v for k, v in vllm.items() if k.startswith("vllm:prefix_cache_hits_total")) >= hits * BLOCK_SIZE


def test_a_router_started_after_the_replica_stored_a_prefix_learns_it_by_replay(events_fleet):
    """vLLM reports a block once, when it stores it: a router that was not following then (a new router pod)
    hears of it only by asking the replica's replay socket, which it does when it starts following."""
    server, d = events_fleet["server"], events_fleet["dir"]
    past_the_router(server, f"late {SYSTEM} question 0")
    late = start_router(d / "router.json", "--backend-api-key", KEY, "--backend-runtime", "vllm")
    try:
        def samples() -> dict:
            return metric_samples(late.base_url)

        replayed = wait_until(lambda: samples().get(f"tokenfleet_router_kv_event_batches_replayed_total"
                                                    f"{{backend={NAME}}}", 0) or None, 60,
                              what="the late router to replay the replica's KV events")
        wait_until(lambda: samples().get(f"tokenfleet_router_backend_cached_blocks{{backend={NAME}}}", 0) >= 2, 30,
                   what="the replayed blocks in the late router's record")
        hits = prefix_hits_through(late.base_url, f"late {SYSTEM} question 1")
        assert hits >= 2, (hits, replayed)
    finally:
        late.kill()
