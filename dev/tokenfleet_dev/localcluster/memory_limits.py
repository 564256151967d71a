"""Memory limits of local pods, enforced as the kubelet enforces them: a memory cgroup per container.

A container with ``resources.limits.memory`` runs in a group whose limit is that many bytes (``memory.max``
under cgroup v2, ``memory.limit_in_bytes`` under v1's memory controller). When its processes need more than the
kernel can reclaim, the kernel's OOM killer ends one of them inside the group (under v2 all of them:
``memory.oom.group``, as the kubelet sets it), and nothing else on the host. The runner reads the group's
``oom_kill`` count when the container exits and reports it as the kubelet does: terminated, reason
``OOMKilled`` (exit code 137 where the killed process was the container's own). Without such a limit, one
replica sized for "the memory it has" could take the memory of every other process on the host, and the global
OOM killer would pick its victims anywhere.

Under v1 the runner's groups go below its own group in the memory hierarchy (so they stay inside whatever
bounds the runner itself); under v2 below the root, in the same folders as the CPU limits' groups
(``cpu_limits.py``), since a process is in one v2 group for every controller.

Where no memory hierarchy can be written (no cgroup filesystem, no permission, a v2 root without the memory
controller), the runner says so once in its log and a watchdog stands in: every WATCH_SECONDS it sums the
proportional resident memory (PSS) of each limited container's processes and kills a container over its limit
(SIGKILL to all of them, reported OOMKilled). It is coarser than the kernel's: a process can outgrow the limit
between two looks, and memory that is not mapped (page cache a process only reads) is not counted. An address
space limit (RLIMIT_AS) is no stand-in: torch and glibc reserve far more address space than they touch, so a
limit on it fails a process that uses much less memory than it.
"""
from __future__ import annotations

import math
import os
import re
import signal
from collections.abc import Iterable
from decimal import Decimal
from pathlib import Path

from .cgroup_groups import ContainerGroups, Hierarchy

WATCH_SECONDS = 1.0                       # how often the watchdog looks, where no cgroup enforces a limit

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m|[eE][-+]?[0-9]+)?$")
_FACTORS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def memory_bytes(quantity: str | int | float | None) -> int | None:
    """A memory quantity as Kubernetes writes it ("512Mi", "1G", "1e9", 1073741824) in bytes, rounded up as the
    kubelet does; None for no limit. Raises ValueError for anything else."""
    if quantity is None or quantity == "":
        return None
    m = _QUANTITY.match(str(quantity).strip())
    if not m:
        raise ValueError(f"not a memory quantity: {quantity!r}")
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    if suffix == "m":
        value = number / 1000
    elif suffix[:1] in ("e", "E"):
        value = number * Decimal(10) ** int(suffix[1:])
    else:
        value = number * _FACTORS.get(suffix, 1)
    return math.ceil(value)


def find_memory_hierarchy(mount: Path = Path("/sys/fs/cgroup"),
                          membership: Path = Path("/proc/self/cgroup")) -> Hierarchy | None:
    """A writable cgroup hierarchy with the memory controller, or None."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:                                     # v1: this process's own group in the memory hierarchy
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            own = mount / controllers / path.lstrip("/")
            if (own / "memory.limit_in_bytes").exists() and os.access(own, os.W_OK):
                return Hierarchy(own, 1)
    controllers_file = mount / "cgroup.controllers"
    if controllers_file.exists() and "memory" in controllers_file.read_text().split() and os.access(mount, os.W_OK):
        if "memory" in (mount / "cgroup.subtree_control").read_text().split():
            return Hierarchy(mount, 2)
    return None


class MemoryLimiter(ContainerGroups):
    """Memory groups for the containers of one runner (``name``: unique per plane, the CPU limiter's name)."""

    CONTROLLER = "memory"

    def __init__(self, name: str, hierarchy: Hierarchy | None = None):
        super().__init__(name, hierarchy if hierarchy is not None else find_memory_hierarchy())

    def group(self, key: str, limit_bytes: int) -> Path:
        """Make (or reuse) the group of one container with its limit; returns its folder."""
        path = self._container_group(key)
        assert self.hierarchy is not None
        if self.hierarchy.version == 1:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        else:
            (path / "memory.max").write_text(str(limit_bytes))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")       # the kubelet gives containers no swap
            (path / "memory.oom.group").write_text("1")          # the OOM killer ends the whole container
        return path

    def oom_kills(self, path: Path) -> int:
        """How many processes the OOM killer has ended in a container's group (0 where it cannot be read)."""
        name = "memory.oom_control" if self.hierarchy is not None and self.hierarchy.version == 1 else "memory.events"
        try:
            text = (path / name).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0


# ---------------------------------------------------------------- the watchdog, where no cgroup can be written
def process_tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])      # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def resident_bytes(pids: Iterable[int], proc: Path = Path("/proc")) -> int:
    """The proportional resident memory (PSS) of these processes: pages they share count once in all."""
    total = 0
    for pid in pids:
        try:
            text = (proc / str(pid) / "smaps_rollup").read_text()
        except OSError:
            continue                                            # gone meanwhile
        for line in text.splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) * 1024
                break
    return total


def kill_over_limit(pid: int, limit_bytes: int) -> int | None:
    """Kill the process tree of ``pid`` when it holds more than ``limit_bytes``; returns what it held then, or
    None when it is within the limit."""
    tree = process_tree(pid)
    held = resident_bytes(tree)
    if held <= limit_bytes:
        return None
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return held
