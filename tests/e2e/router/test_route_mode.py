"""Route mode end to end: two real ``tokenfleet serve`` backends of different tokenizers, each behind its own
``tokenfleet route``, and route-mode routers over those two (docs/routing.md, "Model routing").

The classifier is a small HTTP stand-in for a grading service (it answers /metrics, and /v1/completions either
late or with a fixed grade): what is under test is the route router's use of it, its timeout and fallback.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.router import http, metric_samples, start_backend, start_router, wait_routable, write_endpoints

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


class Grader:
    """A stand-in classifier: ``mode`` "slow" never answers in time, "hard" grades everything hard."""

    def __init__(self, mode: str):
        grader = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/metrics":
                    self._send(b"", "text/plain")
                else:
                    self.send_error(404)

            def do_POST(self):
                asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                grader.asked.append(asked)
                if grader.mode == "slow":
                    grader.stop.wait(3)
                self._send(json.dumps({"choices": [{"index": 0, "text": " hard"}]}).encode())

        self.mode, self.asked, self.stop = mode, [], threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def endpoint(pod: str, port: int, tier: str) -> dict:
    return {"pod": pod, "slice": pod, "ip": "127.0.0.1", "port": port, "ready": True, "tier": tier}


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    from tokenfleet_serving.testing_models import create_random_checkpoint

    d = tmp_path_factory.mktemp("route")
    small_dir = create_random_checkpoint(d / "models" / "small", num_layers=2, vocab_size=512, max_position_embeddings=1024)
    large_dir = create_random_checkpoint(d / "models" / "large", num_layers=2, vocab_size=384, max_position_embeddings=1024,
                                         seed=1)
    procs = []
    graders: dict[str, Grader] = {}
    pool = ThreadPoolExecutor(4)       # the processes start side by side

    def started(futures: dict) -> dict:
        """The processes the futures started; every one that did start is killed at the end, even when another
        failed to."""
        out, failure = {}, None
        for key, f in futures.items():
            try:
                out[key] = f.result()
                procs.append(out[key])
            except Exception as e:  # noqa: BLE001 - raised below, once the others are collected
                failure = failure or e
        if failure is not None:
            raise failure
        return out

    try:
        dirs = {"small": small_dir, "large": large_dir}
        backends = started({name: pool.submit(start_backend, model_dir, "--served-model-name", f"{name}-m")
                            for name, model_dir in dirs.items()})
        for name, model_dir in dirs.items():
            sub = d / name
            sub.mkdir()
            (sub / "router.json").write_text(json.dumps({
                "service": name, "models": [f"{name}-m"], "modelPath": str(model_dir), "policy": "least-load"}))
            write_endpoints(sub / "endpoints.json", {f"{name}-0-0": backends[name]})
        routers = started({name: pool.submit(start_router, d / name / "router.json") for name in dirs})
        graders.update(slow=Grader("slow"), hard=Grader("hard"))
        targets = [{"name": "small", "model": "small-m"}, {"name": "large", "model": "large-m"}]
        difficulty = {"maxPromptTokens": 64, "maxOutputTokens": 16, "maxTurns": 2, "tools": True,
                      "responseSchema": True}
        pending, sizes = {}, {}
        for key, route in (
                ("rules", {"policy": "difficulty", "targets": targets, "difficulty": difficulty, "override": "any"}),
                ("slow", {"policy": "difficulty", "targets": targets, "difficulty": difficulty,
                          "classifier": {"model": "grader", "timeoutMs": 200}}),
                ("hard", {"policy": "difficulty", "targets": targets, "difficulty": difficulty,
                          "classifier": {"timeoutMs": 2000}}),
                ("cost", {"policy": "cost", "targets": targets})):
            sub = d / f"route-{key}"
            sub.mkdir()
            (sub / "router.json").write_text(json.dumps({
                "service": "chat", "models": ["chat"], "policy": "least-load", "migrationLimit": 0,
                "noReplicaHoldSeconds": 0, "route": route}))
            eps = [endpoint("small-router-0", routers["small"].port, "small"),
                   endpoint("large-router-0", routers["large"].port, "large")]
            if key in graders:
                eps.append(endpoint("grader-0", graders[key].port, "@classifier"))
            sizes[key] = len(eps)
            (sub / "endpoints.json").write_text(json.dumps(eps))
            (sub / "targets.json").write_text(json.dumps([
                {"name": "small", "costPerMillionTokens": 0.5, "sloMet": True, "saturated": False},
                {"name": "large", "costPerMillionTokens": 2.0, "sloMet": True, "saturated": False}]))
            pending[key] = pool.submit(start_router, sub / "router.json", "--target-model", "small", str(small_dir),
                                       "--target-model", "large", str(large_dir))
        routes = started(pending)
        for key, route_proc in routes.items():
            wait_routable(route_proc, sizes[key])
        yield {"dir": d, "routes": routes, "graders": graders, "routers": routers}
    finally:
        pool.shutdown(wait=True)
        for p in procs:
            p.kill()
        for g in graders.values():
            g.stop.set()
            g.server.shutdown()
            g.server.server_close()


def ask(base: str, body: dict, headers: dict | None = None):
    status, hdrs, raw = http("POST", f"{base}/v1/chat/completions", {"model": "chat", **body}, headers=headers)
    return status, {k.lower(): v for k, v in hdrs.items()}, json.loads(raw)


def hi(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "temperature": 0, **extra}


def test_easy_goes_small_hard_goes_large_with_the_targets_own_usage(plane):
    base = plane["routes"]["rules"].base_url
    status, hdrs, body = ask(base, hi())
    assert status == 200, body
    assert (hdrs["x-tokenfleet-route-target"], hdrs["x-tokenfleet-route-reason"]) == ("small", "easy")
    assert body["model"] == "small-m"
    # the usage is the target's own: the same prompt asked of each target's router directly
    for name in ("small", "large"):
        _, _, raw = http("POST", f"{plane['routers'][name].base_url}/v1/chat/completions",
                         {"model": f"{name}-m", **hi()})
        plane[f"{name}_prompt_tokens"] = json.loads(raw)["usage"]["prompt_tokens"]
    assert plane["small_prompt_tokens"] != plane["large_prompt_tokens"]   # two tokenizers
    assert body["usage"]["prompt_tokens"] == plane["small_prompt_tokens"]
    for hard in (hi(tools=TOOLS, tool_choice="none"), hi(max_tokens=17), hi(response_format={"type": "json_object"}),
                 {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}] * 2
                  + [{"role": "user", "content": "z"}], "max_tokens": 2}):
        status, hdrs, body = ask(base, hard)
        assert status == 200, body
        assert (hdrs["x-tokenfleet-route-target"], hdrs["x-tokenfleet-route-reason"]) == ("large", "hard"), hard
        assert hdrs["x-tokenfleet-route-detail"].startswith("difficulty 1 (")
    status, hdrs, body = ask(base, hi())
    prompt_long = hi(messages=[{"role": "user", "content": "word " * 80}])
    status, hdrs, body = ask(base, prompt_long)
    assert hdrs["x-tokenfleet-route-target"] == "large" and body["model"] == "large-m"
    assert body["usage"]["prompt_tokens"] > 64
    m = metric_samples(base)
    assert m["tokenfleet_router_route_decisions_total{reason=easy,target=small}"] >= 1
    assert m["tokenfleet_router_route_decisions_total{reason=hard,target=large}"] >= 5


def test_override_header_model_name_and_models_list(plane):
    base = plane["routes"]["rules"].base_url
    status, hdrs, _ = ask(base, hi(), {"X-Tokenfleet-Route-Target": "large"})
    assert (status, hdrs["x-tokenfleet-route-target"], hdrs["x-tokenfleet-route-reason"]) == (200, "large", "override")
    status, _, body = ask(base, hi(), {"X-Tokenfleet-Route-Target": "huge"})
    assert status == 400 and body["error"]["param"] == "x-tokenfleet-route-target"
    status, _, raw = http("POST", f"{base}/v1/chat/completions", {"model": "small-m", **hi()})
    assert status == 404 and json.loads(raw)["error"]["param"] == "model"
    status, _, raw = http("GET", f"{base}/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == ["chat"]


def test_a_slow_classifier_falls_back_to_the_rules_within_its_timeout(plane):
    base = plane["routes"]["slow"].base_url
    started = time.monotonic()
    status, hdrs, _ = ask(base, hi())
    assert status == 200 and time.monotonic() - started < 2.5       # the grader would take 3 s
    assert (hdrs["x-tokenfleet-route-target"], hdrs["x-tokenfleet-route-reason"]) == ("small", "easy")
    assert metric_samples(base)["tokenfleet_router_route_classifier_fallbacks_total{reason=timeout}"] == 1
    asked = plane["graders"]["slow"].asked[-1]
    assert asked["model"] == "grader" and "hello there" in asked["prompt"]
    # a request the rules already send to the last target does not wait for a grade
    ask(base, hi(tools=TOOLS, tool_choice="none"))
    assert len(plane["graders"]["slow"].asked) == 1


def test_a_hard_grade_raises_an_easy_request_to_the_large_target(plane):
    base = plane["routes"]["hard"].base_url
    status, hdrs, _ = ask(base, hi())
    assert (status, hdrs["x-tokenfleet-route-target"], hdrs["x-tokenfleet-route-reason"]) == \
        (200, "large", "classifier-hard")
    assert metric_samples(base)["tokenfleet_router_route_classifier_grades_total{grade=hard}"] == 1


def test_cost_takes_the_cheapest_and_spills_when_it_misses_its_slo(plane):
    route = plane["routes"]["cost"]
    base = route.base_url
    status, hdrs, _ = ask(base, hi(tools=TOOLS, tool_choice="none"))            # difficulty plays no part
    assert (status, hdrs["x-tokenfleet-route-target"], hdrs["x-tokenfleet-route-reason"]) == (200, "small", "cheapest")
    targets = plane["dir"] / "route-cost" / "targets.json"
    tmp = targets.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"name": "small", "costPerMillionTokens": 0.5, "sloMet": False, "saturated": False},
                               {"name": "large", "saturated": False}]))
    tmp.replace(targets)

    def spilled():
        _, h, _ = ask(base, hi())
        return h["x-tokenfleet-route-target"] == "large" and h["x-tokenfleet-route-reason"] == "spill-slo" \
            and "small misses its SLO" in h["x-tokenfleet-route-detail"]
    deadline = time.monotonic() + 10
    while not spilled():
        assert time.monotonic() < deadline, "the route never read the new targets.json"
        time.sleep(0.3)
