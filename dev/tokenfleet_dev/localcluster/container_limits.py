"""The resource limits of the pod runner's containers, as a kubelet enforces them: each container with a CPU or
memory limit runs in cgroups that hold it there (``cpu_limits.py``, ``memory_limits.py``), joined before it
executes so that everything it starts is held too. This is the one place the runner asks: which groups a
container gets, whether the OOM killer ended it, and (where no memory cgroup can be written) whether the
watchdog must.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .cpu_limits import CpuLimiter
from .memory_limits import WATCH_SECONDS, MemoryLimiter, kill_over_limit

log = logging.getLogger("pod-runner")


@dataclass
class Groups:
    """The cgroups of one run of a container (None: that limit is not held by a group)."""
    cpu: Path | None = None
    memory: Path | None = None


class ContainerLimits:
    def __init__(self, cpu: CpuLimiter | None = None, memory: MemoryLimiter | None = None):
        self.cpu, self.memory = cpu, memory
        self._warned: set[str] = set()

    def enter(self, key: str, cpu_millicores: int | None,
              memory_bytes: int | None) -> tuple[Groups, Callable[[], None] | None]:
        """Make the groups of one container run (``key``: unique per container); returns them and the preexec
        function that moves the child into them (None: no group to join)."""
        groups, joins = Groups(), []
        if cpu_millicores is not None:
            if self.cpu is not None and self.cpu.available:
                groups.cpu = self.cpu.group(key, cpu_millicores)
                joins.append(self.cpu.enter(groups.cpu))
            else:
                self._warn("cpu", "CPU limits are not enforced: no writable cgroup hierarchy with the cpu controller")
        if memory_bytes is not None:
            if self.memory is not None and self.memory.available:
                try:
                    groups.memory = self.memory.group(key, memory_bytes)
                    joins.append(self.memory.enter(groups.memory))
                except OSError as e:                  # the watchdog holds this one (kill_over_limit)
                    log.warning("memory limit of %s not set in its cgroup (%s): the watchdog holds it", key, e)
            else:
                self._warn("memory", "memory limits are not enforced by the kernel: no writable cgroup hierarchy with "
                           f"the memory controller; a watchdog kills a container over its limit (every "
                           f"{WATCH_SECONDS:g} s, counting its processes' resident memory)")
        if not joins:
            return groups, None

        def join() -> None:
            for one in joins:
                one()
        return groups, join

    def _warn(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s", message)

    def oom_killed(self, groups: Groups) -> bool:
        """Whether the OOM killer ended a process in the container's memory group."""
        return groups.memory is not None and self.memory is not None and self.memory.oom_kills(groups.memory) > 0

    @staticmethod
    def kill_over_limit(pid: int, groups: Groups, memory_bytes: int | None) -> int | None:
        """The watchdog's look at one container that no memory group holds to its limit: kills its processes
        when they hold more, and returns what they held (None: within it, or a group holds it)."""
        if memory_bytes is None or groups.memory is not None:
            return None
        return kill_over_limit(pid, memory_bytes)

    def release(self, groups: Groups) -> None:
        """Remove a run's groups once its processes are gone (under cgroup v2 both limits may share one)."""
        if groups.cpu is not None and self.cpu is not None:
            self.cpu.remove(groups.cpu)
        if groups.memory is not None and self.memory is not None:
            self.memory.remove(groups.memory)
        groups.cpu = groups.memory = None

    def close(self) -> None:
        for limiter in (self.cpu, self.memory):
            if limiter is not None:
                limiter.close()
