"""CPU limits of local pods, enforced as the kubelet enforces them: a CFS quota per container in a cgroup.

A container with ``resources.limits.cpu`` gets ``limit x period`` microseconds of CPU time per 100 ms period
(``cpu.cfs_quota_us`` under cgroup v1's cpu controller, ``cpu.max`` under cgroup v2), however idle the rest of
the machine is. Without it every local replica could take every core, so on a small host an added replica
would only share the cores of the others instead of adding capacity, unlike an accelerator of its own.

The runner makes one group per plane below the cpu hierarchy's root, one per container below it, and moves
the container's process into its group before it executes (so everything it starts inherits the limit).
Where no cpu hierarchy can be written (no cgroup filesystem, no permission), limits are not enforced and the
runner says so once in its log.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PERIOD_US = 100_000            # the kubelet's default CFS period
MIN_QUOTA_US = 1_000           # the kernel's smallest quota

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m?)$")


def millicores(quantity: str | int | float | None) -> int | None:
    """A CPU quantity as Kubernetes writes it ("500m", "2", "0.25", 1) in thousandths of a core, rounded up as
    the API server does; None for no limit. Raises ValueError for anything else."""
    if quantity is None or quantity == "":
        return None
    m = _QUANTITY.match(str(quantity).strip())
    if not m:
        raise ValueError(f"not a CPU quantity: {quantity!r}")
    value = float(m.group(1))
    return math.ceil(value if m.group(2) else value * 1000)


def quota_us(limit_millicores: int, period_us: int = PERIOD_US) -> int:
    """CFS quota for a limit, as the kubelet computes it (milliCPUToQuota)."""
    return max(MIN_QUOTA_US, limit_millicores * period_us // 1000)


@dataclass(frozen=True)
class Hierarchy:
    root: Path                 # where the plane's group goes
    version: int               # 1 (cpu controller) or 2 (unified, cpu.max)


def find_hierarchy(candidates: tuple[Path, ...] = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct"),
                                                   Path("/sys/fs/cgroup"))) -> Hierarchy | None:
    """A writable cgroup hierarchy with the cpu controller, or None."""
    for path in candidates:
        if (path / "cpu.cfs_quota_us").exists() and os.access(path, os.W_OK):
            return Hierarchy(path, 1)
        controllers = path / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split() and os.access(path, os.W_OK):
            subtree = (path / "cgroup.subtree_control").read_text().split()
            if "cpu" in subtree:
                return Hierarchy(path, 2)
    return None


class CpuLimiter:
    """Groups for the containers of one runner (``name``: unique per plane)."""

    def __init__(self, name: str, hierarchy: Hierarchy | None = None):
        self.hierarchy = hierarchy if hierarchy is not None else find_hierarchy()
        self.base: Path | None = None
        if self.hierarchy is not None:
            base = self.hierarchy.root / name
            try:
                base.mkdir(exist_ok=True)
                if self.hierarchy.version == 2:       # let the containers' groups below have cpu.max
                    (base / "cgroup.subtree_control").write_text("+cpu")
                self.base = base
            except OSError:
                self.base = None

    @property
    def available(self) -> bool:
        return self.base is not None

    def group(self, key: str, limit_millicores: int) -> Path:
        """Make (or reuse) the group of one container with its quota; returns its folder."""
        assert self.base is not None and self.hierarchy is not None
        path = self.base / key
        path.mkdir(exist_ok=True)
        quota = quota_us(limit_millicores)
        if self.hierarchy.version == 1:
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        return path

    @staticmethod
    def enter(path: Path) -> Callable[[], None]:
        """For ``subprocess.Popen(preexec_fn=...)``: the child moves itself into the group before it executes."""
        procs = str(path / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write("0")            # 0: the writing process itself
        return join

    def remove(self, path: Path) -> None:
        """Remove a container's group once its processes are gone (the kernel refuses while any is left)."""
        try:
            path.rmdir()
        except OSError:
            pass

    def remove_stale(self, prefix: str) -> None:
        """Remove the groups that runners of earlier planes, killed before they could, left behind: those named
        ``prefix`` + the pid of a process that is gone."""
        if self.hierarchy is None:
            return
        for runner in self.hierarchy.root.glob(prefix + "*"):
            pid = runner.name[len(prefix):]
            if runner == self.base or not runner.is_dir() or not pid.isdigit() or Path(f"/proc/{pid}").exists():
                continue
            self._remove_runner_groups(runner)

    def close(self) -> None:
        """Remove every group of this runner whose processes are gone, then the runner's own."""
        if self.base is not None and self.base.exists():
            self._remove_runner_groups(self.base)

    def _remove_runner_groups(self, runner: Path) -> None:
        """A runner's container groups whose processes are gone, then the runner's group if it is empty."""
        for child in runner.iterdir():
            if child.is_dir():
                self.remove(child)
        self.remove(runner)

