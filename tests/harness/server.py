"""Helpers for server tests: HTTP calls, /metrics parsing, servers in a thread or a subprocess."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

from harness.support import http, wait_until  # noqa: F401  (re-exported to the server tests)

API_KEY = "test-key"
MODEL_NAME = "tiny"


def metric_values(base_url: str) -> dict[str, float]:
    """Sample name (with labels other than model_name/engine) -> value, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    _, _, text = http("GET", f"{base_url}/metrics")
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}" if extra else "")
            out[key] = s.value
    return out


class ThreadServer:
    """``serve()`` on its own event loop in a thread, bound to a free loopback port."""

    def __init__(self, config, engine_factory=None, wait_ready: bool = True):
        from tokenfleet_serving.server.main import serve

        self.port: int | None = None
        self.holder: list = []
        self.rc: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        listening = threading.Event()

        def on_listening(port: int) -> None:
            self.port = port
            self.loop = asyncio.get_running_loop()
            listening.set()

        def run() -> None:
            self.rc = asyncio.run(serve(config, "127.0.0.1", 0, on_listening=on_listening,
                                        server_holder=self.holder, engine_factory=engine_factory))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert listening.wait(60), "server never started listening"
        self.base_url = f"http://127.0.0.1:{self.port}"
        if wait_ready:
            wait_until(lambda: http("GET", f"{self.base_url}/ready")[0] == 200, 120, what="/ready")

    @property
    def server(self):
        return self.holder[0]

    def call(self, fn, *args):
        """Run fn on the server's event loop and return its result."""
        fut = asyncio.run_coroutine_threadsafe(_call(fn, *args), self.loop)
        return fut.result(30)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.begin_drain)
            self.thread.join(60)


async def _call(fn, *args):
    return fn(*args)


def server_config(model: Path, **overrides):
    from tokenfleet_serving.engine.engine import EngineConfig
    from tokenfleet_serving.server.app import ServerConfig

    engine_keys = {"kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len",
                   "enable_prefix_caching"}
    engine = EngineConfig(model=str(model), dtype="float32", num_threads=1,
                          **{"kv_cache_bytes": 4 * 2**20, **{k: v for k, v in overrides.items() if k in engine_keys}})
    base = ServerConfig(engine=engine, served_model_names=(MODEL_NAME,), api_key=API_KEY,
                        max_body_bytes=64 * 1024, max_queue=64, drain_timeout_s=10)
    return replace(base, **{k: v for k, v in overrides.items() if k not in engine_keys})


class ProcessServer:
    """``tokenfleet serve`` as a child process, the way the pod runner starts it."""

    def __init__(self, model: Path, *args: str):
        cmd = [sys.executable, "-m", "tokenfleet_cli", "serve", "--model", str(model), "--host", "127.0.0.1",
               "--port", "0", "--served-model-name", MODEL_NAME, "--dtype", "float32", "--kv-cache-mb", "4",
               "--num-threads", "1", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
        self.log: list[str] = []
        port_seen = threading.Event()
        self.port = None

        def pump() -> None:
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening on [\d.]+:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    port_seen.set()

        threading.Thread(target=pump, daemon=True).start()
        if not port_seen.wait(120):
            self.proc.kill()
            raise AssertionError("server never listened:\n" + "".join(self.log))
        self.base_url = f"http://127.0.0.1:{self.port}"
        wait_until(lambda: http("GET", f"{self.base_url}/ready")[0] == 200, 120, what="/ready")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
