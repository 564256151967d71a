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
from pathlib import Path

from .cgroup_groups import ContainerGroups, Hierarchy

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


class CpuLimiter(ContainerGroups):
    """CPU groups for the containers of one runner (``name``: unique per plane)."""

    CONTROLLER = "cpu"

    def __init__(self, name: str, hierarchy: Hierarchy | None = None):
        super().__init__(name, hierarchy if hierarchy is not None else find_hierarchy())

    def group(self, key: str, limit_millicores: int) -> Path:
        """Make (or reuse) the group of one container with its quota; returns its folder."""
        path = self._container_group(key)
        quota = quota_us(limit_millicores)
        assert self.hierarchy is not None
        if self.hierarchy.version == 1:
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        return path
