"""The hostile layer's cases that need the fleet in a given state (issue 37): requests with large bodies held
while no replica is ready (defect 4), many long session ids (defect 5), and a backend frozen with SIGSTOP in
the middle of a stream (defect 6). Real ``tokenfleet serve`` and ``tokenfleet route`` processes; the freeze is
a real SIGSTOP, as a hung node or a stopped container gives."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import hostile
from harness.rawhttp import connect, read_reply
from harness.router import MODEL_NAME, ROUTER_KEY, http, metric_samples, start_backend, start_router, wait_routable, wait_until

pytestmark = pytest.mark.slow

MB = 2**20
STALL_S = 3.0
TOKENS = 400          # of the tiny model's 512-token context: a stream long enough to freeze in its middle


def test_held_requests_with_large_bodies_are_bounded_in_bytes(tmp_path):
    """Defect 4: 40 concurrent 4 MB requests held while no replica was ready raised the router's RSS from 49 MB
    to 1,010 MB. Now at most --max-held-bytes of bodies wait (each once, as bytes); the rest get 503 with
    Retry-After at once, counted in tokenfleet_router_hold_refusals_total{reason="bytes"}."""
    (tmp_path / "router.json").write_text(json.dumps({"models": [MODEL_NAME],
                                                      "scaleFromZero": {"maxPendingRequests": 1000,
                                                                        "pendingTimeoutSeconds": 15}}))
    (tmp_path / "endpoints.json").write_text("[]")
    router = start_router(tmp_path / "router.json", "--max-held-bytes", str(16 * MB), "--body-timeout", "60")
    try:
        wait_until(lambda: http("GET", f"{router.base_url}/ready")[0] == 200, 60, what="router ready, holding")
        baseline = hostile.rss_bytes(router.proc.pid)
        request = hostile.large_body(4 * MB, {})
        answers: list = []
        peak = {"held": 0.0, "rss": 0}

        def one() -> None:
            with connect(router.port, timeout=60) as s:
                s.sendall(request)
                reply = read_reply(s)
            answers.append((time.monotonic(), reply))

        def watch(stop: threading.Event) -> None:
            while not stop.is_set():
                m = metric_samples(router.base_url)
                peak["held"] = max(peak["held"], m["tokenfleet_router_held_request_bytes"])
                peak["rss"] = max(peak["rss"], hostile.rss_bytes(router.proc.pid))
                time.sleep(0.2)

        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(stop,))
        watcher.start()
        t0 = time.monotonic()
        with ThreadPoolExecutor(40) as pool:
            for _ in range(40):
                pool.submit(one)
            # the refused ones are answered while the held ones still wait
            wait_until(lambda: sum(1 for _, r in answers if r.status == 503) >= 30, 30, what="30 refusals")
            held_rss = hostile.rss_bytes(router.proc.pid)
            m = metric_samples(router.base_url)
        stop.set()
        watcher.join()
        refused = [(t, r) for t, r in answers if r.status == 503 and t - t0 < 10]
        assert len(answers) == 40 and all(r.status == 503 for _, r in answers)
        assert len(refused) >= 30, "the requests past the bound were answered at once"
        assert all(r.headers.get("retry-after") for _, r in answers)
        for _, r in answers:
            r.error()
        assert m["tokenfleet_router_hold_refusals_total{reason=bytes}"] >= 30
        assert peak["held"] <= 16 * MB
        grown = (held_rss - baseline) / MB
        print(f"\nrouter RSS: {baseline / MB:.0f} MB before, {held_rss / MB:.0f} MB while holding "
              f"{peak['held'] / MB:.0f} MB of bodies, peak {peak['rss'] / MB:.0f} MB")
        assert grown < 100, f"the router's RSS grew by {grown:.0f} MB holding 16 MB of bodies"
    finally:
        router.kill()


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    """Two backends behind a router that takes a backend silent for STALL_S seconds as frozen."""
    d = tmp_path_factory.mktemp("frozen")
    backends: dict = {}
    router = None
    try:
        for name in ("tiny-0-0", "tiny-1-0"):
            backends[name] = start_backend(tiny_model, "--api-key", ROUTER_KEY)
        (d / "router.json").write_text(json.dumps({
            "service": "tiny", "namespace": "t", "models": [MODEL_NAME], "policy": "least-load", "kvBlockSize": 16,
            "modelPath": str(tiny_model), "sessionAffinity": {"enabled": True}, "noReplicaHoldSeconds": 10}))
        (d / "endpoints.json").write_text(json.dumps([
            {"pod": n, "slice": n.rsplit("-", 1)[0], "ip": "127.0.0.1", "port": p.port, "ready": True}
            for n, p in backends.items()]))
        router = start_router(d / "router.json", "--backend-api-key", ROUTER_KEY, "--stall-timeout", str(STALL_S),
                              "--max-sessions", "100")
        wait_routable(router, 2)
        yield {"router": router, "backends": backends}
    finally:
        if router is not None:
            router.kill()
        for p in backends.values():
            p.kill()


def _open_stream(router, max_tokens: int):
    """A streamed completion read as it arrives: (socket, backend serving it)."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "a frozen replica must not freeze its clients",
                       "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    s = connect(router.port, timeout=60)
    s.sendall(hostile.request_bytes("POST", hostile.COMPLETIONS, body, {"Content-Type": "application/json"}))
    head = b""
    while b"\r\n\r\n" not in head:
        byte = s.recv(1)
        assert byte, f"no response: {head!r}"
        head += byte
    assert head.startswith(b"HTTP/1.1 200"), head
    backend = [line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
               if line.lower().startswith(b"x-tokenfleet-backend:")][0]
    return s, backend


def test_a_backend_frozen_mid_stream_loses_its_stream_to_another_backend(pair):
    """Defect 6: a replica SIGSTOPped mid-stream gave its client no byte for 65 s. Now, once it has sent nothing
    and answered no poll for the stall timeout, the stream continues on the other backend, and new requests go
    there too while it stays frozen."""
    router, backends = pair["router"], pair["backends"]
    wait_routable(router, 2)
    before = metric_samples(router.base_url)
    s, serving = _open_stream(router, TOKENS)
    other = next(n for n in backends if n != serving)
    data = b""
    with s:
        while data.count(b"data: ") < 3:            # the stream is under way
            chunk = s.recv(65536)
            assert chunk, f"the stream ended early: {data[:300]!r}"
            data += chunk
        with hostile.frozen(backends[serving].proc.pid):
            frozen_at = time.monotonic()
            s.settimeout(60)
            while b"data: [DONE]" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            resumed = time.monotonic() - frozen_at
            # while it is still frozen, new requests go to the other backend
            served = {http("POST", f"{router.base_url}/v1/completions",
                           {"model": MODEL_NAME, "prompt": f"while frozen {i}", "max_tokens": 2})[1]
                      .get("x-tokenfleet-backend") for i in range(4)}
    events = [line[6:] for line in data.decode(errors="replace").split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c]
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
    assert resumed < STALL_S + 30, f"the stream ended {resumed:.0f} s after the freeze"
    assert served == {other}
    after = metric_samples(router.base_url)
    key = "tokenfleet_router_migrations_total{reason=backend-stalled}"
    assert after[key] - before.get(key, 0) == 1
    wait_routable(router, 2, 30)                   # the thawed backend is back


def test_a_request_waiting_on_a_backend_that_freezes_goes_to_another(pair):
    """A request routed to a backend that froze before it answered (here: pinned there by its session) is sent
    to the other backend once the stall timeout has passed, instead of waiting for ever."""
    router, backends = pair["router"], pair["backends"]
    wait_routable(router, 2)
    session = {"X-Session-Id": "frozen-session"}
    body = {"model": MODEL_NAME, "prompt": "pinned", "max_tokens": 2}
    status, headers, _ = http("POST", f"{router.base_url}/v1/completions", body, session)
    pinned = headers["x-tokenfleet-backend"]
    with hostile.frozen(backends[pinned].proc.pid):
        t0 = time.monotonic()
        status, headers, raw = http("POST", f"{router.base_url}/v1/completions", body, session)
        took = time.monotonic() - t0
    assert status == 200, raw[:200]
    assert headers["x-tokenfleet-backend"] != pinned
    assert took < STALL_S + 15
    wait_routable(router, 2, 30)                   # the thawed backend is back


def test_many_long_session_ids_keep_the_session_table_bounded(pair):
    """Defect 5: 20,000 distinct 8 KB session ids grew the router by 160 MB. Ids over 256 characters are refused
    (400 naming the header); the table keeps at most --max-sessions (100 here) and forgets the least recently
    used."""
    router = pair["router"]
    wait_routable(router, 2)
    body = {"model": MODEL_NAME, "prompt": "s", "max_tokens": 1}
    status, _, raw = http("POST", f"{router.base_url}/v1/completions", body, {"X-Session-Id": "s" * 8192})
    assert status == 400 and json.loads(raw)["error"]["param"] == "x-session-id"

    def one(i: int) -> int:
        return http("POST", f"{router.base_url}/v1/completions", body, {"X-Session-Id": f"{i:08d}" + "s" * 248})[0]

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(one, range(400)))
    assert set(statuses) == {200}
    m = metric_samples(router.base_url)
    assert m["tokenfleet_router_sessions"] <= 100
    assert m["tokenfleet_router_session_evictions_total"] >= 300
