"""Two real ``tokenfleet serve`` processes behind ``tokenfleet route``.

The tests run in file order on one module-scoped fleet; the last one kills the
backends.
"""
from __future__ import annotations

import json

import pytest

from harness.router import MODEL_NAME, ROUTER_KEY, http, metric_samples, start_backend, start_router, wait_until, write_endpoints

pytestmark = pytest.mark.slow

PRICE_PER_REPLICA_HOUR = 3.6
WORDS = "the cache of prefix block engine batch cluster node pod cost latency request stream model serve".split()


def shared_prefix(seed: int, words: int = 220) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(words))


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("router")
    backends = {}
    routers = []
    try:
        backends["tiny-0-0"] = start_backend(tiny_model, "--api-key", ROUTER_KEY)   # only the router may call
        backends["tiny-1-0"] = start_backend(tiny_model, "--api-key", ROUTER_KEY)
        config = {"service": "tiny", "namespace": "test", "models": [MODEL_NAME], "policy": "prefix-aware",
                  "sessionAffinity": {"enabled": True, "header": "X-Session-Id", "ttlSeconds": 600},
                  "kvBlockSize": 16, "modelPath": str(tiny_model),
                  "price": {"perReplicaHour": PRICE_PER_REPLICA_HOUR, "currency": "USD"},
                  "noReplicaHoldSeconds": 0}          # with no replica left: 503 at once (the hold: test_migration)
        (d / "router.json").write_text(json.dumps(config))
        rr = d / "rr"
        rr.mkdir()
        (rr / "router.json").write_text(json.dumps(config | {"policy": "round-robin"}))
        # the second backend starts out not ready (its pod's Ready condition is false)
        write_endpoints(d / "endpoints.json", {"tiny-0-0": backends["tiny-0-0"]})
        write_endpoints(rr / "endpoints.json", backends)
        router = start_router(d / "router.json", "--backend-api-key", ROUTER_KEY)
        routers.append(router)
        rr_router = start_router(rr / "router.json", "--backend-api-key", ROUTER_KEY)
        routers.append(rr_router)
        yield {"dir": d, "backends": backends, "router": router, "rr": rr_router}
    finally:
        for p in [*routers, *backends.values()]:
            p.kill()


def complete(base_url: str, prompt, *, max_tokens: int = 2, headers: dict | None = None, **extra):
    status, hdrs, body = http("POST", f"{base_url}/v1/completions",
                              {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               **extra}, headers=headers)
    return status, hdrs, json.loads(body)


def routable(base_url: str) -> float:
    return metric_samples(base_url).get("tokenfleet_router_backends{state=routable}", 0)


def test_ready_follows_the_endpoints_file(fleet):
    router, d, backends = fleet["router"], fleet["dir"], fleet["backends"]
    wait_until(lambda: http("GET", f"{router.base_url}/ready")[0] == 200, 30, what="router /ready")
    assert routable(router.base_url) == 1
    for i in range(4):  # only the ready pod gets traffic
        status, hdrs, _ = complete(router.base_url, shared_prefix(100 + i))
        assert status == 200 and hdrs["x-tokenfleet-backend"] == "tiny-0-0"
    write_endpoints(d / "endpoints.json", backends)  # the operator saw the second pod become Ready
    wait_until(lambda: routable(router.base_url) == 2, 30, what="two routable backends")


def test_a_shared_prefix_sticks_to_one_backend_and_hits_its_cache(fleet):
    router = fleet["router"]
    prefix = shared_prefix(1)
    served, cached = [], []
    for i in range(5):
        status, hdrs, body = complete(router.base_url, f"{prefix} request {i} of five")
        assert status == 200, body
        served.append(hdrs["x-tokenfleet-backend"])
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(set(served)) == 1, served
    assert cached[0] == 0 and min(cached[1:]) >= 160, cached  # 220 words: well over ten 16-token blocks
    reasons = [v for k, v in metric_samples(router.base_url).items()
               if k.startswith("tokenfleet_router_requests_total") and "reason=prefix-hit" in k]
    assert sum(reasons) >= 4
    assert metric_samples(router.base_url)["tokenfleet_router_prefix_hit_blocks_total"] >= 4 * 10


def test_round_robin_does_not_keep_the_prefix_together(fleet):
    rr = fleet["rr"]
    wait_until(lambda: routable(rr.base_url) == 2, 30, what="round-robin router sees both backends")
    prefix = shared_prefix(2)
    served, cached = [], []
    for i in range(4):
        status, hdrs, body = complete(rr.base_url, f"{prefix} question {i}")
        assert status == 200
        served.append(hdrs["x-tokenfleet-backend"])
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert served[0] != served[1] and served[0] == served[2] and served[1] == served[3]
    assert cached[0] == 0 and cached[1] == 0  # the second request landed on a cold replica


def test_different_prefixes_spread_over_both_backends(fleet):
    router = fleet["router"]
    served = {complete(router.base_url, shared_prefix(10 + i, words=40))[1]["x-tokenfleet-backend"] for i in range(8)}
    assert served == {"tiny-0-0", "tiny-1-0"}


def test_session_header_pins_a_session(fleet):
    router = fleet["router"]
    for session in ("alice", "bob", "carol"):
        served = {complete(router.base_url, shared_prefix(30 + i, words=30), headers={"X-Session-Id": session})[1]
                  ["x-tokenfleet-backend"] for i in range(4)}
        assert len(served) == 1, (session, served)


def test_streaming_through_the_router_with_the_openai_client(fleet):
    import openai

    client = openai.OpenAI(base_url=f"{fleet['router'].base_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello fleet, what does a token cost?"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # arrived in pieces
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    pieces = list(client.completions.create(model=MODEL_NAME, prompt="the cache", max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert len(pieces) >= 2 and pieces[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_backend_errors_pass_through_and_router_errors_are_openai_shaped(fleet):
    router = fleet["router"]
    status, _, body = complete(router.base_url, "hello", temperature=7)
    assert status == 400 and json.loads(json.dumps(body))["error"]["param"] == "temperature"
    status, _, raw = http("GET", f"{router.base_url}/v1/nothing")
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"


def test_cost_per_million_tokens_from_the_backends_generation_rate(fleet):
    router = fleet["router"]
    complete(router.base_url, "the cost of a token", max_tokens=16, ignore_eos=True)

    def sample():
        m = metric_samples(router.base_url)
        return m if m.get("tokenfleet_router_generation_tokens_per_second", 0) > 0 else None

    m = wait_until(sample, 30, what="a generation rate")
    dollars = m["tokenfleet_router_dollars_per_hour{currency=USD}"]
    assert dollars == pytest.approx(2 * PRICE_PER_REPLICA_HOUR)
    rate = m["tokenfleet_router_generation_tokens_per_second"]
    assert m["tokenfleet:cost_per_million_tokens_usd{currency=USD}"] == pytest.approx(dollars / (rate * 3600) * 1e6)


def test_the_router_exports_each_backends_waiting_and_running_requests_apart(fleet):
    import threading

    router = fleet["router"]
    stop = threading.Event()

    def load():
        while not stop.is_set():
            complete(router.base_url, "a long answer", max_tokens=400, ignore_eos=True)

    clients = [threading.Thread(target=load) for _ in range(6)]
    for c in clients:
        c.start()
    try:
        def running():
            m = metric_samples(router.base_url)
            total = sum(v for k, v in m.items() if k.startswith("tokenfleet_router_backend_requests_running{"))
            return m if total >= 1 else None

        m = wait_until(running, 30, what="a running request in a backend's gauge")
        backends = [k[k.index("{"):] for k in m if k.startswith("tokenfleet_router_backend_requests_running{")]
        assert backends and len(backends) == len([k for k in m if k.startswith("tokenfleet_router_backend_load{")])
        for labels in backends:            # the sum the router routes on is the two it now shows apart
            waiting, run = (m[f"tokenfleet_router_backend_requests_{w}{labels}"] for w in ("waiting", "running"))
            assert m[f"tokenfleet_router_backend_load{labels}"] >= waiting + run
    finally:
        stop.set()
        for c in clients:
            c.join(60)


def test_a_killed_backend_is_routed_around_and_none_left_is_503(fleet):
    import openai

    router, backends = fleet["router"], fleet["backends"]
    prefix = shared_prefix(1)
    _, hdrs, _ = complete(router.base_url, f"{prefix} before the failure")
    victim = hdrs["x-tokenfleet-backend"]
    survivor = next(n for n in backends if n != victim)
    backends[victim].kill()  # its pod is still listed as Ready: the router must notice by itself
    for i in range(5):
        status, hdrs, body = complete(router.base_url, f"{prefix} after the failure {i}")
        assert status == 200, body
        assert hdrs["x-tokenfleet-backend"] == survivor
    assert http("GET", f"{router.base_url}/ready")[0] == 200

    backends[survivor].kill()
    status, hdrs, body = complete(router.base_url, "anyone there?")
    assert status == 503 and hdrs["Retry-After"] == "1"
    assert body["error"]["type"] == "service_unavailable" and body["error"]["code"] == 503
    wait_until(lambda: http("GET", f"{router.base_url}/ready")[0] == 503, 10, what="router not ready")
    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 503
    assert metric_samples(router.base_url)["tokenfleet_router_responses_total{code=503}"] >= 2
