"""Stream migration: three real ``tokenfleet serve`` processes, each behind a fault proxy
(``harness/fault_proxy.py``), behind ``tokenfleet route``.

A proxy breaks the stream of the next request on the test's command, after a given number of events; the
router must continue it on another backend so that the client sees the stream an uninterrupted run gives
(float32 greedy and seeded requests: token for token), or end it with one OpenAI error event after what
was already relayed. The last test SIGKILLs a backend in the middle of a stream.
"""
from __future__ import annotations

import json
import threading
from http.client import HTTPConnection

import pytest

from harness.fault_proxy import FaultProxy
from harness.router import MODEL_NAME, ROUTER_KEY, http, metric_samples, start_backend, start_router, stream_events, wait_until

pytestmark = pytest.mark.slow

BACKENDS = ("tiny-0-0", "tiny-1-0", "tiny-2-0")
PROMPT = "the fleet serves a stream of tokens from one replica to the next when a pod dies"
AUTH = {"Authorization": f"Bearer {ROUTER_KEY}"}


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("migration")
    backends, proxies, routers = {}, {}, {}
    try:
        for name in BACKENDS:
            backends[name] = start_backend(tiny_model, "--api-key", ROUTER_KEY)
            proxies[name] = FaultProxy(backends[name].base_url)
        endpoints = [{"pod": n, "slice": n.rsplit("-", 1)[0], "ip": "127.0.0.1", "port": proxies[n].port,
                      "ready": True} for n in BACKENDS]
        config = {"service": "tiny", "namespace": "test", "models": [MODEL_NAME], "policy": "least-load",
                  "kvBlockSize": 16, "modelPath": str(tiny_model)}
        for name, limit in (("main", 3), ("limited", 1)):
            (d / name).mkdir()
            (d / name / "router.json").write_text(json.dumps(config | {"migrationLimit": limit}))
            (d / name / "endpoints.json").write_text(json.dumps(endpoints))
            routers[name] = start_router(d / name / "router.json", "--backend-api-key", ROUTER_KEY)
        for r in routers.values():
            wait_until(lambda r=r: metric_samples(r.base_url).get("tokenfleet_router_backends{state=routable}") == 3,
                       60, what="three routable backends")
        yield {"backends": backends, "proxies": proxies, "routers": routers, "dir": d, "endpoints": endpoints}
    finally:
        for p in proxies.values():
            p.close()
        for p in [*routers.values(), *backends.values()]:
            p.kill()


@pytest.fixture(autouse=True)
def no_leftover_faults(fleet):
    yield
    for p in fleet["proxies"].values():
        p.clear()


def body(kind: str, **extra) -> dict:
    common = {"model": MODEL_NAME, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if kind == "chat":
        return common | {"messages": [{"role": "user", "content": PROMPT}]} | extra
    return common | {"prompt": PROMPT} | extra


def path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def reference(fleet, kind: str, **extra) -> list:
    """The uninterrupted stream, straight from a backend."""
    status, _, events = stream_events(fleet["backends"]["tiny-0-0"].base_url, path(kind),
                                      body(kind, return_token_ids=True, **extra), headers=AUTH)
    assert status == 200 and events[-1] == "[DONE]"
    return events


def chunks(events: list) -> list[dict]:
    return [e for e in events if isinstance(e, dict) and e.get("choices")]


def text_of(events: list) -> str:
    return "".join((c["choices"][0].get("delta") or {}).get("content") or c["choices"][0].get("text") or ""
                   for c in chunks(events))


def ids_of(events: list) -> list[int]:
    return [t for c in chunks(events) for t in c["choices"][0].get("token_ids", [])]


def usage_of(events: list) -> dict:
    [u] = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    return u


def plan_everywhere(fleet, *args, **kwargs) -> None:
    for p in fleet["proxies"].values():
        p.plan(*args, **kwargs)


def applied(fleet) -> dict:
    return {n: list(p.applied) for n, p in fleet["proxies"].items() if p.applied}


def counters(router) -> dict:
    m = metric_samples(router.base_url)
    return {k: v for k, v in m.items() if k.startswith(("tokenfleet_router_migration", "tokenfleet_router_slo_requests",
                                                          "tokenfleet_router_output_tokens_total",
                                                          "tokenfleet_router_time_to_first_token_seconds_count"))}


def delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


@pytest.mark.parametrize("kind, fault, after, client_ids", [
    ("completion", "cut", 0, False),          # broken before the first event: nothing to carry over
    ("completion", "cut", 6, True),
    ("completion", "cut", 25, False),
    ("chat", "cut", 1, False),                # only the role chunk was relayed
    ("chat", "cut", 12, True),
    ("completion", "error", 9, False),        # the backend's engine died, or its drain timed out
    ("chat", "error", 5, False),
])
def test_a_broken_stream_continues_elsewhere_as_one_uninterrupted_stream(fleet, kind, fault, after, client_ids):
    router = fleet["routers"]["main"]
    ref = reference(fleet, kind)
    for p in fleet["proxies"].values():
        p.applied.clear()
    plan_everywhere(fleet, fault, after=after)
    before = counters(router)
    extra = {"return_token_ids": True} if client_ids else {}
    status, headers, events = stream_events(router.base_url, path(kind), body(kind, **extra))
    assert status == 200 and events[-1] == "[DONE]"
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    [broken] = applied(fleet)                                    # one backend broke it, on its first try
    assert headers["x-tokenfleet-backend"] == broken
    # one stream: one id, one opening chunk, the text, tokens and usage of the uninterrupted run
    assert len({e["id"] for e in events if isinstance(e, dict)}) == 1
    if kind == "chat":
        assert sum(1 for c in chunks(events) if c["choices"][0]["delta"].get("role")) == 1
    assert text_of(events) == text_of(ref)
    if client_ids:
        assert ids_of(events) == ids_of(ref)
    else:
        assert not any("token_ids" in c["choices"][0] for c in chunks(events))
    usage = usage_of(events)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (usage_of(ref)["prompt_tokens"], 40)
    assert [c["choices"][0]["finish_reason"] for c in chunks(events)][-1] == "length"
    after_ = counters(router)
    reason = "backend-disconnected" if fault == "cut" else "backend-error"
    assert delta(before, after_, f"tokenfleet_router_migrations_total{{reason={reason}}}") == 1
    # the router's SLO accounting sees one request with one first token and all 40 tokens
    assert delta(before, after_, "tokenfleet_router_output_tokens_total") == 40
    assert delta(before, after_, "tokenfleet_router_time_to_first_token_seconds_count") == 1
    assert (delta(before, after_, "tokenfleet_router_slo_requests_total{result=met}")
            + delta(before, after_, "tokenfleet_router_slo_requests_total{result=missed}")) == 1


def test_seeded_sampling_and_logprobs_continue_as_in_one_run(fleet):
    router = fleet["routers"]["main"]
    extra = {"temperature": 0.9, "top_p": 0.95, "seed": 31, "logprobs": 2}
    ref = reference(fleet, "completion", **extra)
    plan_everywhere(fleet, "cut", after=7)
    status, _, events = stream_events(router.base_url, "/v1/completions",
                                      body("completion", return_token_ids=True, **extra))
    assert status == 200 and events[-1] == "[DONE]"
    assert ids_of(events) == ids_of(ref) and text_of(events) == text_of(ref)
    got = [lp for c in chunks(events) for lp in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    want = [lp for c in chunks(ref) for lp in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert len(got) == len(want) == 40
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3


def test_a_continuation_its_target_refuses_keeps_the_streamed_part_and_ends_with_an_error_event(fleet):
    router = fleet["routers"]["main"]
    ref = reference(fleet, "completion")
    plan_everywhere(fleet, "cut", after=5)
    plan_everywhere(fleet, "refuse", on="continuation", status=400)
    before = counters(router)
    status, _, events = stream_events(router.base_url, "/v1/completions", body("completion"))
    assert status == 200
    *streamed, error, done = events
    assert done == "[DONE]"
    assert text_of(streamed) == text_of(chunks(ref)[:5])      # (chunks that held only token ids are dropped)
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["code"] == 400 and error["error"]["type"] == "invalid_request_error"
    assert "continuing the stream on" in error["error"]["message"]
    after_ = counters(router)
    assert delta(before, after_, "tokenfleet_router_migration_failures_total{reason=target-error}") == 1
    assert delta(before, after_, "tokenfleet_router_slo_requests_total{result=missed}") == 1


def test_a_stream_that_keeps_breaking_ends_at_the_migration_limit(fleet):
    router = fleet["routers"]["limited"]                    # migrationLimit 1
    ref = reference(fleet, "completion")
    plan_everywhere(fleet, "cut", after=3)
    plan_everywhere(fleet, "cut", after=2, on="continuation")
    before = counters(router)
    status, _, events = stream_events(router.base_url, "/v1/completions", body("completion"))
    assert status == 200
    *streamed, error, done = events
    assert done == "[DONE]" and error["error"]["code"] == 502
    assert "migrationLimit 1" in error["error"]["message"]
    assert text_of(streamed) == text_of(chunks(ref)[:5])
    after_ = counters(router)
    assert delta(before, after_, "tokenfleet_router_migrations_total{reason=backend-disconnected}") == 1
    assert delta(before, after_, "tokenfleet_router_migration_failures_total{reason=limit}") == 1


def test_a_client_cannot_send_a_continuation(fleet):
    status, _, raw = http("POST", fleet["routers"]["main"].base_url + "/v1/completions",
                          body("completion", continuation={"output_token_ids": [5, 6]}))
    assert status == 400
    err = json.loads(raw)["error"]
    assert err["param"] == "continuation" and err["type"] == "invalid_request_error"


def test_a_request_that_finds_no_ready_replica_waits_for_one(fleet):
    """Every replica failing at once (noReplicaHoldSeconds, default 30 s): the request is held, not refused."""
    router, path_ = fleet["routers"]["main"], fleet["dir"] / "main" / "endpoints.json"
    down = [e | {"ready": False} for e in fleet["endpoints"]]
    path_.write_text(json.dumps(down))
    wait_until(lambda: metric_samples(router.base_url).get("tokenfleet_router_backends{state=routable}") == 0, 30,
               what="no routable backend")
    result: dict = {}
    client = threading.Thread(target=lambda: result.update(
        zip(("status", "headers", "events"), stream_events(router.base_url, "/v1/completions", body("completion")))))
    client.start()
    wait_until(lambda: metric_samples(router.base_url).get("tokenfleet_router_pending_requests") == 1, 30,
               what="the request held")
    assert http("GET", f"{router.base_url}/ready")[0] == 200       # the router still takes requests
    path_.write_text(json.dumps(fleet["endpoints"]))                 # a replica is back
    client.join(120)
    assert result["status"] == 200 and result["events"][-1] == "[DONE]"
    assert usage_of(result["events"])["completion_tokens"] == 40


def test_a_constrained_stream_continues_with_its_grammar_state(fleet):
    """The continuation replays the delivered tokens through the request's grammar on the new backend: the
    client gets the seeded run's document, token for token, and it validates."""
    import jsonschema

    router = fleet["routers"]["main"]
    extra = {"temperature": 1.0, "seed": 11, "max_tokens": 200, "ignore_eos": False,
             "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}}
    ref = reference(fleet, "chat", **extra)
    plan_everywhere(fleet, "cut", after=4)
    status, _, events = stream_events(router.base_url, path("chat"), body("chat", return_token_ids=True, **extra))
    assert status == 200 and events[-1] == "[DONE]" and applied(fleet)
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    assert ids_of(events) == ids_of(ref) and text_of(events) == text_of(ref)
    jsonschema.validate(json.loads(text_of(events)), SCHEMA)


def test_a_stream_of_several_choices_passes_through_and_fails_cleanly_when_broken(fleet):
    router = fleet["routers"]["main"]
    status, _, events = stream_events(router.base_url, path("completion"), body("completion", n=2, max_tokens=6))
    assert status == 200 and events[-1] == "[DONE]"
    assert {c["choices"][0]["index"] for c in chunks(events)} == {0, 1}
    plan_everywhere(fleet, "cut", after=3)
    status, _, events = stream_events(router.base_url, path("completion"), body("completion", n=2))
    *_, error, done = events
    assert done == "[DONE]" and error["error"]["code"] == 502
    assert "several choices (n > 1)" in error["error"]["message"]


def test_a_client_that_hangs_up_once_it_has_done_got_a_served_request(fleet):
    """The official openai client closes its connection as soon as it has read ``[DONE]``. When the backend has
    not yet ended its response by then (the proxy lingers), the router's handler is cancelled: the request was
    served whole all the same, so it counts as met, never as an SLO miss."""
    router = fleet["routers"]["main"]
    plan_everywhere(fleet, "linger")
    before = counters(router)
    conn = HTTPConnection("127.0.0.1", int(router.base_url.rsplit(":", 1)[1]), timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body("completion")),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        lines = []
        while not lines or lines[-1] != b"data: [DONE]":
            line = response.readline()
            assert line, "the stream ended before [DONE]"
            if line.strip():
                lines.append(line.strip())
    finally:
        conn.close()            # hang up with the backend's response still open
    assert sum(f.kind == "linger" for p in fleet["proxies"].values() for f in p.applied) == 1

    def observed() -> bool:
        now = counters(router)
        return sum(delta(before, now, f"tokenfleet_router_slo_requests_total{{result={r}}}")
                   for r in ("met", "missed")) == 1
    wait_until(observed, 30, what="the request observed by the router")
    after = counters(router)
    assert delta(before, after, "tokenfleet_router_slo_requests_total{result=missed}") == 0
    assert delta(before, after, "tokenfleet_router_slo_requests_total{result=met}") == 1


def test_a_backend_killed_in_the_middle_of_a_stream(fleet):
    """Last: it kills a backend. The proxy holds the stream after 4 events, the test SIGKILLs the backend
    process behind it, and the client's stream goes on elsewhere."""
    router = fleet["routers"]["main"]
    ref = reference(fleet, "chat")
    for p in fleet["proxies"].values():
        p.applied.clear()
    plan_everywhere(fleet, "hold", after=4)
    result: dict = {}
    client = threading.Thread(target=lambda: result.update(
        zip(("status", "headers", "events"), stream_events(router.base_url, "/v1/chat/completions", body("chat")))))
    client.start()
    held = wait_until(lambda: applied(fleet), 60, what="a held stream")
    [name] = held
    fleet["backends"][name].kill()
    client.join(120)
    assert result["status"] == 200 and result["events"][-1] == "[DONE]"
    assert text_of(result["events"]) == text_of(ref)
    assert usage_of(result["events"])["completion_tokens"] == 40
    assert result["headers"]["x-tokenfleet-backend"] == name


SCHEMA = {"type": "object", "properties": {
    "tier": {"type": "string", "enum": ["gold", "silver"]},
    "zones": {"type": "array", "maxItems": 3, "items": {"type": "string", "enum": ["a", "b", "c"]}},
    "ready": {"type": "boolean"}}, "required": ["tier", "zones", "ready"], "additionalProperties": False}
