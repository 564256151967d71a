"""Helpers for the router's end-to-end tests: serving backends and the router as child processes."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from harness.support import http, wait_until  # noqa: F401  (re-exported to the router tests)

MODEL_NAME = "tiny"
ROUTER_KEY = "router-to-replica-key"    # the replicas' --api-key, which only the router holds


def metric_samples(base_url: str) -> dict[str, float]:
    """'name{k=v,...}' -> value from a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    _, _, text = http("GET", f"{base_url}/metrics")
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


class Process:
    """A child process whose log is collected and whose listening port is read from its log."""

    def __init__(self, cmd: list[str], port_pattern: str, what: str):
        self.what = what
        self.proc = subprocess.Popen(cmd, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ))
        self.log: list[str] = []
        seen = threading.Event()
        self.port: int | None = None

        def pump() -> None:
            for line in self.proc.stdout:
                self.log.append(line)
                m = re.search(port_pattern, line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    seen.set()

        threading.Thread(target=pump, daemon=True).start()
        if not seen.wait(180):
            self.kill()
            raise AssertionError(f"{what} never listened:\n" + "".join(self.log))
        self.base_url = f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(20)

    def terminate(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def start_backend(model: Path, *args: str) -> Process:
    cmd = [sys.executable, "-m", "tokenfleet_cli", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", "0", "--served-model-name", MODEL_NAME, "--dtype", "float32", "--kv-cache-mb", "8",
           "--block-size", "16", "--num-threads", "1", "--drain-timeout", "2", *args]
    p = Process(cmd, r"listening on [\d.]+:(\d+)", "tokenfleet serve")
    wait_until(lambda: http("GET", f"{p.base_url}/ready")[0] == 200, 180, what="backend /ready")
    return p


def routable(router: Process) -> float:
    """How many backends the router would route to now."""
    return metric_samples(router.base_url).get("tokenfleet_router_backends{state=routable}", 0)


def wait_routable(router: Process, n: int, timeout: float = 60) -> None:
    wait_until(lambda: routable(router) == n, timeout, what=f"{n} routable backends")


def start_router(config_path: Path, *args: str) -> Process:
    cmd = [sys.executable, "-m", "tokenfleet_serving.router.main", "--config", str(config_path),
           "--host", "127.0.0.1", "--port", "0", "--poll-interval", "0.25", *args]
    return Process(cmd, r"routing on [\d.]+:(\d+)", "tokenfleet route")


def write_endpoints(path: Path, backends: dict[str, Process | None], ready: bool = True) -> None:
    """endpoints.json as the operator writes it; atomically replaced, as the kubelet does."""
    entries = [{"pod": name, "slice": name.rsplit("-", 1)[0], "ip": "127.0.0.1", "port": p.port if p else 1,
                "ready": ready} for name, p in backends.items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries))
    tmp.replace(path)


def stream_events(base_url: str, path: str, body: dict, headers: dict | None = None,
                  timeout: float = 120) -> tuple[int, dict, list]:
    """POST a streamed request; (status, headers, events) with each ``data:`` event decoded (``"[DONE]"`` as
    the string)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), [json.loads(e.read())]
    events: list = []
    with resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else json.loads(data))
    return resp.status, dict(resp.headers), events
