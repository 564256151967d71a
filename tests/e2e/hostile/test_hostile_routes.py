"""The hostile layer's TokenRoute family (issue 48): a client that forces the expensive target with the override
header, floods it past ``maxConcurrentRequests``, sends the header on through a route of routes, or a route that
reaches itself. Real ``tokenfleet route`` processes in route mode; the targets' routers are small HTTP stand-ins
that record what reaches them (what is under test is the route's router, not what is behind it)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.router import http, metric_samples, start_router, wait_routable, wait_until

pytestmark = pytest.mark.slow

HEADER = "x-tokenfleet-route-target"
HOPS = "x-tokenfleet-route-hops"
BODY = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class TargetRouter:
    """A target's router as the route sees it: /metrics, and chat completions answered once ``release`` is set
    (at once by default), counting how many are open at the same time and recording each one's headers."""

    def __init__(self):
        target = self
        self.release = threading.Event()
        self.release.set()
        self.lock = threading.Lock()
        self.open = self.most_open = 0
        self.headers: list[dict[str, str]] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, b"", "text/plain") if self.path == "/metrics" else self._send(404, b"{}")

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with target.lock:
                    target.headers.append({k.lower(): v for k, v in self.headers.items()})
                    target.open += 1
                    target.most_open = max(target.most_open, target.open)
                try:
                    target.release.wait(60)
                    self._send(200, json.dumps({"object": "chat.completion", "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode())
                finally:
                    with target.lock:
                        target.open -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def endpoint(pod: str, port: int, tier: str) -> dict:
    return {"pod": pod, "slice": pod, "ip": "127.0.0.1", "port": port, "ready": True, "tier": tier}


def write_route(d, route: dict, endpoints: list[dict]) -> None:
    d.mkdir(exist_ok=True)
    (d / "router.json").write_text(json.dumps({"service": "chat", "models": ["chat"], "policy": "least-load",
                                               "migrationLimit": 0, "noReplicaHoldSeconds": 0, "route": route}))
    (d / "endpoints.json").write_text(json.dumps(endpoints))


@pytest.fixture
def targets():
    small, large = TargetRouter(), TargetRouter()
    yield small, large
    small.close()
    large.close()


def two_targets(small: TargetRouter, large: TargetRouter) -> list[dict]:
    return [endpoint("small-router-0", small.port, "small"), endpoint("large-router-0", large.port, "large")]


def ask(base: str, headers: dict | None = None) -> tuple[int, dict, dict]:
    status, hdrs, raw = http("POST", f"{base}/v1/chat/completions", BODY, headers)
    return status, {k.lower(): v for k, v in hdrs.items()}, json.loads(raw)


def test_the_override_header_is_refused_by_default_and_with_keys_lets_in_only_those_keys(tmp_path, targets):
    small, large = targets
    keys = tmp_path / "override-keys"
    keys.write_text("ops-key\n")
    routes = {}
    for name, extra in (("off", {}), ("keys", {"override": "keys", "overrideKeys": str(keys)})):
        write_route(tmp_path / name, {"policy": "difficulty", "targets": [{"name": "small"}, {"name": "large"}],
                                      **extra}, two_targets(small, large))
    try:
        for name in ("off", "keys"):
            routes[name] = start_router(tmp_path / name / "router.json")
            wait_routable(routes[name], 2)
        status, _, body = ask(routes["off"].base_url, {HEADER: "large"})
        assert (status, body["error"]["param"], body["error"]["type"]) == (403, HEADER, "permission_error")
        for auth in (None, "Bearer client-key", "ops-key"):
            status, _, body = ask(routes["keys"].base_url, {HEADER: "large"} | ({"Authorization": auth} if auth else {}))
            assert (status, body["error"]["param"]) == (403, HEADER), auth
        assert large.headers == []                                          # nothing reached the large target
        status, hdrs, _ = ask(routes["keys"].base_url, {HEADER: "large", "Authorization": "Bearer ops-key"})
        assert (status, hdrs["x-tokenfleet-route-target"], hdrs["x-tokenfleet-route-reason"]) == \
            (200, "large", "override")
        # the target (which could be a route itself) gets no override header, and one hop
        assert HEADER not in large.headers[-1] and large.headers[-1][HOPS] == "1"
        status, hdrs, _ = ask(routes["off"].base_url)                       # no header: the policy decides
        assert (status, hdrs["x-tokenfleet-route-target"]) == (200, "small")
        m = metric_samples(routes["keys"].base_url)
        assert m["tokenfleet_router_route_override_refusals_total{reason=key}"] == 3
    finally:
        for r in routes.values():
            r.kill()


def test_a_flood_of_overrides_never_has_more_than_max_concurrent_requests_open_at_the_target(tmp_path, targets):
    small, large = targets
    large.release.clear()                                   # the large target answers nothing until released
    write_route(tmp_path / "r", {"policy": "difficulty", "override": "any",
                                 "targets": [{"name": "small"}, {"name": "large", "maxConcurrentRequests": 2}]},
                two_targets(small, large))
    route = start_router(tmp_path / "r" / "router.json")
    pool = ThreadPoolExecutor(24)
    try:
        wait_routable(route, 2)
        futures = [pool.submit(ask, route.base_url, {HEADER: "large"}) for _ in range(20)]
        refused = []
        deadline = time.monotonic() + 60
        while len(refused) < 18 and time.monotonic() < deadline:
            refused = [f.result() for f in futures if f.done()]
            time.sleep(0.05)
        assert len(refused) == 18 and large.open == 2
        for status, hdrs, body in refused:
            assert (status, body["error"]["param"], body["error"]["type"]) == (429, HEADER, "rate_limit_error")
            assert hdrs["retry-after"] == "1" and "maxConcurrentRequests" in body["error"]["message"]
        large.release.set()
        assert sorted(f.result()[0] for f in futures) == [200, 200] + [429] * 18
        assert large.most_open == 2 and small.headers == []              # refused, not spilled to small
        assert ask(route.base_url, {HEADER: "large"})[0] == 200           # room again
    finally:
        large.release.set()
        pool.shutdown(wait=True)
        route.kill()


def test_a_route_that_reaches_itself_ends_with_508_not_a_storm(tmp_path):
    """A route whose target is itself (a loop the operator refuses, made here by hand): the request goes
    round at most 8 times, and the client gets an OpenAI-shaped 508 naming the hops header."""
    d = tmp_path / "loop"
    write_route(d, {"policy": "difficulty", "override": "any", "targets": [{"name": "self"}]}, [])
    route = start_router(d / "router.json")
    try:
        (d / "endpoints.json").write_text(json.dumps([endpoint("self-router-0", route.port, "self")]))
        wait_routable(route, 1)
        status, _, body = ask(route.base_url, {HEADER: "self"})
        assert (status, body["error"]["param"], body["error"]["type"]) == (508, HOPS, "loop_detected")
        assert "8 routes" in body["error"]["message"]
        m = metric_samples(route.base_url)
        assert m["tokenfleet_router_route_decisions_total{reason=override,target=self}"] == 1   # the client's
        assert m["tokenfleet_router_route_decisions_total{reason=easy,target=self}"] == 7       # the loop's
        for bad in ("-1", "many", "1" * 9):
            status, _, body = ask(route.base_url, {HOPS: bad})
            assert (status, body["error"]["param"]) == (400, HOPS)
    finally:
        route.kill()


@pytest.mark.parametrize("header", ["Authorization", "Cookie", "Host", "Content-Length", "Connection"])
def test_a_router_json_naming_a_credential_or_hop_by_hop_header_does_not_start(tmp_path, header):
    write_route(tmp_path, {"targets": [{"name": "a"}], "overrideHeader": header}, [])
    out = subprocess.run([sys.executable, "-m", "tokenfleet_serving.router.main", "--config",
                          str(tmp_path / "router.json"), "--host", "127.0.0.1", "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "route.overrideHeader" in out.stderr, out.stderr


def test_the_route_reads_its_override_keys_again_when_they_rotate(tmp_path, targets):
    small, large = targets
    keys = tmp_path / "override-keys"
    keys.write_text("old-key\n")
    write_route(tmp_path / "r", {"targets": [{"name": "small"}, {"name": "large"}], "override": "keys",
                                 "overrideKeys": str(keys)}, two_targets(small, large))
    route = start_router(tmp_path / "r" / "router.json")
    try:
        wait_routable(route, 2)
        assert ask(route.base_url, {HEADER: "large", "Authorization": "Bearer old-key"})[0] == 200
        keys.write_text("new-key\n")
        wait_until(lambda: ask(route.base_url, {HEADER: "large", "Authorization": "Bearer new-key"})[0] == 200, 30,
                   what="the rotated key")
        assert ask(route.base_url, {HEADER: "large", "Authorization": "Bearer old-key"})[0] == 403
    finally:
        route.kill()
