"""The hostile-input layer (issue 19): thousands of generated requests against one ``tokenfleet serve``
process, a share of them through ``tokenfleet route`` in front of it, then a drain under the same fire.

Asserted: the engine never dies (``/health`` stays 200, the log never shows a stopped engine, a failed
request or an unhandled error), no answer is a 5xx except a 503 while draining, every error is an
OpenAI-shaped JSON body whose code is its status, every request is answered (or refused once the
listener has closed at the end of the drain) within a bounded time, and the valid canaries mixed in are
served with exactly the tokens they asked for.

``TOKENFLEET_HOSTILE_SEED`` (default 19) and ``TOKENFLEET_HOSTILE_REQUESTS`` (default 5,000) choose the
cases; a failure prints the seed and each failing case, so it can be replayed.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import hostile
from harness.router import http, start_router, wait_until, write_endpoints
from harness.server import ProcessServer

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("TOKENFLEET_HOSTILE_SEED", "19"))
N = int(os.environ.get("TOKENFLEET_HOSTILE_REQUESTS", "5000"))
ROUTER_SHARE = 5                         # every fifth case goes through the router
WORKERS = 16
SERVER_KEY, CLIENT_KEY = "hostile-router-key", "hostile-client-key"
LOG_ALARMS = ("Traceback", " ERROR ", "engine step loop stopped", "failed in the engine", "unhandled error",
              "engine stalled", "Unhandled exception")


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    srv = ProcessServer(tiny_model, "--api-key", SERVER_KEY, "--header-timeout", "3", "--body-timeout", "3",
                        "--max-body-bytes", str(256 * 1024), "--max-queue", "64", "--max-num-seqs", "16",
                        "--drain-timeout", "15")
    router = None
    try:
        (d / "keys").write_text(CLIENT_KEY + "\n")
        (d / "router.json").write_text(json.dumps({"models": [hostile.MODEL], "kvBlockSize": 16,
                                                   "modelPath": str(tiny_model),
                                                   "sessionAffinity": {"enabled": True}}))

        class _P:   # endpoints.json wants a port
            port = srv.port
        write_endpoints(d / "endpoints.json", {"hostile-0": _P})
        router = start_router(d / "router.json", "--client-keys", str(d / "keys"), "--backend-api-key", SERVER_KEY,
                              "--header-timeout", "3", "--body-timeout", "3", "--max-body-bytes", str(256 * 1024 + 4096))
        wait_until(lambda: http("GET", f"{router.base_url}/ready")[0] == 200, 60, what="router ready")
        yield {"server": srv, "router": router}
    finally:
        if router is not None:
            router.kill()
        srv.close()


def _run(cases: list[tuple[int, hostile.Case]], *, draining=lambda: False, on_done=None) -> list[tuple]:
    out: list[tuple] = []
    lock = threading.Lock()

    def one(item: tuple[int, hostile.Case]) -> None:
        port, case = item
        t0 = time.monotonic()
        answer = hostile.send(port, case)
        took = time.monotonic() - t0
        problem = hostile.check(case, answer, draining=draining())
        with lock:
            out.append((case, answer, problem, took))
        if on_done is not None:
            on_done()

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(one, cases))
    return out


def _report(results: list[tuple]) -> str:
    bad = [(c, a, p) for c, a, p, _ in results if p]
    lines = [f"seed {SEED}: {len(bad)} of {len(results)} answers are wrong"]
    for case, answer, problem in bad[:25]:
        status = answer if isinstance(answer, str) else answer.status
        lines.append(f"  [{status}] {problem}\n      {case.describe()}")
    return "\n".join(lines)


def _log_alarms(log: list[str]) -> str:
    """The log lines that show a failure, each with the lines after it (empty when there are none)."""
    hits = [i for i, line in enumerate(log) if any(a in line for a in LOG_ALARMS)]
    return "\n".join("".join(log[max(0, i - 3):i + 40]) for i in hits[:2])


def test_thousands_of_hostile_requests_never_kill_or_5xx_the_replica(fleet):
    srv, router = fleet["server"], fleet["router"]
    server_cases = hostile.generate(SEED, N - N // ROUTER_SHARE, {"Authorization": f"Bearer {SERVER_KEY}"})
    router_cases = hostile.generate(SEED + 1, N // ROUTER_SHARE, {"Authorization": f"Bearer {CLIENT_KEY}"})
    cases = [(srv.port, c) for c in server_cases] + [(router.port, c) for c in router_cases]
    cases.sort(key=lambda pc: hash((SEED, pc[1].data[:64], pc[0])))      # interleave, deterministically
    t0 = time.monotonic()
    results = _run(cases)
    took = time.monotonic() - t0

    statuses = collections.Counter(a if isinstance(a, str) else a.status for _, a, _, _ in results)
    families = collections.Counter(c.family for c, _, _, _ in results)
    print(f"\nhostile: {len(results)} requests in {took:.0f} s, statuses {dict(statuses)}, families {dict(families)}")
    by_family: dict[str, list[float]] = collections.defaultdict(list)
    for c, _, _, t in results:
        by_family[c.family].append(t)
    print("seconds per family (total, max): " + ", ".join(f"{f} {sum(ts):.0f}/{max(ts):.1f}"
                                                         for f, ts in sorted(by_family.items())))
    print("slowest: " + "; ".join(f"{t:.1f}s {c.family}/{c.name}" for c, _, _, t in
                                  sorted(results, key=lambda r: -r[3])[:8]))
    assert len(results) >= 5000 or N < 5000
    assert not any(p for _, _, p, _ in results), _report(results)
    # the engine lived through it and still serves
    assert http("GET", f"{srv.base_url}/health")[0] == 200
    assert http("GET", f"{srv.base_url}/ready")[0] == 200
    assert srv.proc.poll() is None and router.proc.poll() is None
    for name, proc in (("server", srv), ("router", router)):
        alarms = _log_alarms(proc.log)
        assert not alarms, f"the {name}'s log:\n{alarms}"
    canaries = [(c, a) for c, a, _, _ in results if c.family == "canary"]
    assert len(canaries) >= N // 25 and all(not isinstance(a, str) and a.status == 200 for _, a in canaries)
    assert statuses[200] >= N // 10, "valid requests (not only the canaries) were served"
    slowest = max(t for _, _, _, t in results)
    assert slowest < 60, f"an answer took {slowest:.0f} s"


def test_a_drain_under_fire_answers_everyone_and_exits_0(fleet):
    """SIGTERM while hostile and valid requests are in flight: 503s (with Retry-After) for what arrives after
    it, everything accepted finishes or is answered, nothing else is a 5xx, and the process exits 0."""
    srv = fleet["server"]
    cases = [(srv.port, c) for c in hostile.generate(SEED + 2, 400, {"Authorization": f"Bearer {SERVER_KEY}"},
                                                     canary_every=3, big_bodies=0)]
    done = {"n": 0}
    signalled = threading.Event()

    def on_done() -> None:
        done["n"] += 1
        if done["n"] == 100 and not signalled.is_set():
            signalled.set()
            srv.proc.send_signal(signal.SIGTERM)

    results = _run(cases, draining=signalled.is_set, on_done=on_done)
    assert signalled.is_set()
    assert not any(p for _, _, p, _ in results), _report(results)
    assert srv.proc.wait(60) == 0, "".join(srv.log[-30:])
    alarms = _log_alarms(srv.log)
    assert not alarms, f"the server's log:\n{alarms}"
    late = [a for _, a, _, _ in results if not isinstance(a, str) and a.status == 503]
    assert all(a.headers.get("retry-after") for a in late if "draining" in a.body.decode(errors="replace"))
