"""Running tokenfleet's images in real containers (podman + runc), locked down as a restricted pod would be.

``HARDENED`` is what PodSecurity "restricted" plus ``readOnlyRootFilesystem`` ask of a pod, in podman's
words: a read-only root file system (and no tmpfs podman would otherwise add), every capability dropped,
no privilege escalation, and the runtime's default seccomp profile (``RuntimeDefault``). The image's own
user is kept, so a test sees whether the image runs as non-root by itself. Writable paths are bind mounts
of test folders, as emptyDir volumes are.
"""
from __future__ import annotations

import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tokenfleet_dev import images

SECCOMP_DEFAULT = Path("/usr/share/containers/seccomp.json")     # podman's RuntimeDefault profile
HARDENED = ("--read-only", "--read-only-tmpfs=false", "--cap-drop=all", "--security-opt=no-new-privileges",
            f"--security-opt=seccomp={SECCOMP_DEFAULT}")


def podman(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    return images.podman(*args, check=check, timeout=timeout)


@dataclass
class Container:
    """One detached container: ``start()``, inspect its process, ``stop()`` with SIGTERM, ``remove()``."""

    image: str
    args: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)
    name: str = field(default_factory=lambda: f"tokenfleet-test-{uuid.uuid4().hex[:10]}")

    def start(self) -> Container:
        podman("run", "--detach", f"--name={self.name}", "--network=host", *HARDENED, *self.options,
               self.image, *self.args)
        return self

    def inspect(self, template: str) -> str:
        return podman("inspect", "--format", template, self.name).stdout.strip()

    def pid(self) -> int:
        return int(self.inspect("{{.State.Pid}}"))

    def running(self) -> bool:
        return self.inspect("{{.State.Running}}") == "true"

    def process_status(self) -> dict[str, str]:
        """/proc/PID/status of the container's main process, seen from the host."""
        text = Path(f"/proc/{self.pid()}/status").read_text()
        return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)

    def exec(self, *cmd: str) -> subprocess.CompletedProcess:
        return podman("exec", self.name, *cmd, check=False)

    def logs(self) -> str:
        out = podman("logs", self.name, check=False)
        return (out.stdout + out.stderr)[-8000:]

    def stop(self, timeout: int = 40) -> int:
        """SIGTERM, SIGKILL after ``timeout`` s; returns the exit code."""
        podman("stop", f"--time={timeout}", self.name, timeout=timeout + 60)
        return int(self.inspect("{{.State.ExitCode}}"))

    def remove(self) -> None:
        podman("rm", "--force", "--time=0", self.name, check=False)


def effective_capabilities(status: dict[str, str]) -> int:
    return int(status["CapEff"].strip(), 16)


def uids(status: dict[str, str]) -> list[int]:
    return [int(u) for u in status["Uid"].split()]


def wait_http(url: str, timeout: float, container: Container | None = None) -> None:
    """Poll ``url`` until it answers 200 (a readiness wait, not a speed assertion)."""
    import urllib.request
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if container is not None and not container.running():
            raise AssertionError(f"container {container.name} exited:\n{container.logs()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except Exception as e:  # not up yet
            last = e
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready after {timeout:.0f}s ({last})"
                         + (f"\n{container.logs()}" if container else ""))

