"""Two router pods behind one Service (issue 48, item 4): two real ``tokenfleet serve`` replicas, router
processes over the same endpoints, and ``harness/service_proxy.py`` in front of them as the router Service
(kube-proxy following the router pods' readiness).

- SIGKILL one router under streamed load: only the streams whose connection went to the killed router fail,
  every other one ends with ``[DONE]``, and new requests are served by the router that is left.
- A rolling update (a new router started and Ready before an old one gets SIGTERM, as the router
  Deployment's maxSurge 1 / maxUnavailable 0 does, twice): no request is lost, neither the streams open on
  the stopping router nor the new ones that reach it before the Service takes it out of its endpoints.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field
from http.client import HTTPConnection

import pytest

from harness.router import MODEL_NAME, ROUTER_KEY, Process, http, metric_samples, start_backend, start_router, wait_until
from harness.service_proxy import ServiceProxy

pytestmark = pytest.mark.slow

BACKENDS = ("tiny-0-0", "tiny-1-0")
PROMPT = "two routers share one fleet and a stream lives on the one its connection went to"


@dataclass(eq=False)
class Stream:
    """One streamed request through the Service: which router took its connection, when its first and last
    events came, and whether it ended with [DONE] and no error event."""

    router: str | None = None
    first_at: float | None = None
    ended_at: float | None = None
    ok: bool = False
    status: int | None = None
    error: str = ""
    events: int = 0
    done: threading.Event = field(default_factory=threading.Event)


def run_stream(service: ServiceProxy, stream: Stream, max_tokens: int) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    conn = HTTPConnection("127.0.0.1", service.port, timeout=120)
    local = None
    try:
        conn.connect()
        local = conn.sock.getsockname()[1]
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        stream.router = service.routes.get(local)
        stream.status = resp.status
        if resp.status != 200:
            stream.error = resp.read().decode(errors="replace")[:300]
            return
        done = False
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            stream.first_at = stream.first_at or time.monotonic()
            stream.events += 1
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
            elif "error" in json.loads(data):
                stream.error = data
        stream.ok = done and not stream.error
        if not done:
            stream.error = stream.error or "the stream ended without [DONE]"
    except Exception as exc:           # a cut connection: IncompleteRead, ConnectionReset, RemoteDisconnected
        stream.error = f"{type(exc).__name__}: {exc}"
        if stream.router is None and local is not None:
            stream.router = service.routes.get(local)
    finally:
        stream.ended_at = time.monotonic()
        stream.done.set()
        conn.close()


def start_streams(service: ServiceProxy, n: int, max_tokens: int) -> list[Stream]:
    streams = [Stream() for _ in range(n)]
    for s in streams:
        threading.Thread(target=run_stream, args=(service, s, max_tokens), daemon=True).start()
    return streams


def start_named_router(d, name: str) -> Process:
    router = start_router(d / "router.json", "--backend-api-key", ROUTER_KEY, "--drain-timeout", "60")
    wait_until(lambda: metric_samples(router.base_url).get("tokenfleet_router_backends{state=routable}") == 2,
               60, what=f"router {name}: two routable backends")
    return router


@pytest.fixture(scope="module")
def backends(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("router-ha")
    started: dict[str, Process] = {}
    try:
        for name in BACKENDS:
            started[name] = start_backend(tiny_model, "--api-key", ROUTER_KEY)
        config = {"service": "tiny", "namespace": "test", "models": [MODEL_NAME], "policy": "least-load",
                  "kvBlockSize": 16, "modelPath": str(tiny_model), "noReplicaHoldSeconds": 0}
        (d / "router.json").write_text(json.dumps(config))
        (d / "endpoints.json").write_text(json.dumps(
            [{"pod": n, "slice": n.rsplit("-", 1)[0], "ip": "127.0.0.1", "port": p.port, "ready": True}
             for n, p in started.items()]))
        yield d
    finally:
        for p in started.values():
            p.kill()


@pytest.fixture
def routers(backends):
    """name -> router process; every one still running is killed at the end."""
    running: dict[str, Process] = {}
    yield running
    for p in running.values():
        p.kill()


@pytest.fixture
def service():
    proxy = ServiceProxy(poll_s=1.0)      # the endpoints follow readiness a second late, as a real Service can
    yield proxy
    proxy.close()


def join(service: ServiceProxy, routers: dict[str, Process], name: str, d) -> None:
    routers[name] = start_named_router(d, name)
    service.add(name, routers[name].port)
    wait_until(lambda: name in service.ready, 10, what=f"the Service to list router {name}")


def test_a_killed_router_costs_only_its_own_streams(backends, routers, service):
    for name in ("router-a", "router-b"):
        join(service, routers, name, backends)
    streams = start_streams(service, 8, max_tokens=600)
    wait_until(lambda: all(s.first_at or s.done.is_set() for s in streams), 120, what="every stream under way")
    assert {s.router for s in streams} == {"router-a", "router-b"}
    killed_at = time.monotonic()
    routers["router-a"].kill()              # SIGKILL: no drain, its connections are cut

    # new requests keep being served: the Service drops the dead router at its next look
    wait_until(lambda: service.ready == ["router-b"], 10, what="the Service to drop the killed router")
    later = start_streams(service, 4, max_tokens=8)
    for s in [*streams, *later]:
        assert s.done.wait(180)
    assert all(s.ok and s.router == "router-b" for s in later), [(s.router, s.status, s.error) for s in later]

    on_killed = [s for s in streams if s.router == "router-a" and s.ended_at > killed_at]
    on_other = [s for s in streams if s.router == "router-b"]
    failed = [s for s in streams if not s.ok]
    assert on_killed, "no stream was open on the killed router: nothing was tested"
    assert failed == on_killed, [(s.router, s.error) for s in failed]
    assert all(s.ok for s in on_other), [(s.router, s.error) for s in on_other]
    print(f"streams: {len(on_killed)} on the killed router failed, {len(on_other)} on the other finished")


def keep_sending(service: ServiceProxy, stop: threading.Event, out: list[Stream]) -> None:
    """One client: a new connection and a short stream after another, until ``stop``."""
    while not stop.is_set():
        s = Stream()
        out.append(s)
        run_stream(service, s, max_tokens=24)


def roll(service: ServiceProxy, routers: dict[str, Process], d, old: str, new: str, sent: list[Stream]) -> None:
    """One step of the Deployment's rolling update: the new pod Ready first, then SIGTERM to the old one while
    streams are open on it; it must exit 0 once they are done."""
    join(service, routers, new, d)
    wait_until(lambda: any(s.router == old and s.first_at and not s.done.is_set() for s in list(sent)), 60,
               what=f"a stream open on {old}")
    proc = routers[old].proc
    proc.send_signal(signal.SIGTERM)       # what the kubelet sends when the ReplicaSet scales the old pods down
    stopped_at = time.monotonic()
    wait_until(lambda: old not in service.ready, 10, what=f"the Service to drop {old}")
    assert proc.wait(90) == 0, "".join(routers[old].log[-30:])
    service.remove(old)
    served_after = [s for s in list(sent) if s.router == old and s.first_at and s.first_at > stopped_at]
    print(f"{old}: {len(served_after)} requests reached it after SIGTERM and were served")


def test_a_rolling_update_of_the_router_loses_no_request(backends, routers, service):
    for name in ("router-a", "router-b"):
        join(service, routers, name, backends)
    sent: list[Stream] = []
    stop = threading.Event()
    clients = [threading.Thread(target=keep_sending, args=(service, stop, sent), daemon=True) for _ in range(4)]
    for c in clients:
        c.start()
    try:
        roll(service, routers, backends, "router-a", "router-c", sent)
        roll(service, routers, backends, "router-b", "router-d", sent)
        wait_until(lambda: sum(s.router in ("router-c", "router-d") and s.ok for s in list(sent)) >= 4, 60,
                   what="requests served by the new routers")
    finally:
        stop.set()
        for c in clients:
            c.join(180)
    lost = [(s.router, s.status, s.error) for s in sent if not s.ok]
    assert not lost, lost
    by_router = {name: sum(s.router == name for s in sent) for name in ("router-a", "router-b", "router-c", "router-d")}
    assert all(by_router.values()), by_router
    assert service.refused == 0
    status, _, _ = http("GET", f"{routers['router-c'].base_url}/ready")
    assert status == 200
