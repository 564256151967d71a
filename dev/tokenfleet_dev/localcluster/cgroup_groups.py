"""The cgroups of one pod runner's containers below one hierarchy: what the CPU limits (``cpu_limits.py``) and the
memory limits (``memory_limits.py``) share.

The runner gets a group of its own (``name``, unique per plane) below the hierarchy's root and one group per
container below it; a container's process moves itself into its group before it executes, so everything it
starts inherits the limit. Groups are removed once their processes are gone, and so are those that runners of
earlier planes, killed before they could, left behind.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hierarchy:
    root: Path                 # where the runner's group goes
    version: int               # 1 (one controller's own hierarchy) or 2 (unified)


class ContainerGroups:
    """Groups for the containers of one runner, under the controller ``CONTROLLER`` ("cpu", "memory")."""

    CONTROLLER = ""

    def __init__(self, name: str, hierarchy: Hierarchy | None):
        self.hierarchy = hierarchy
        self.base: Path | None = None
        if hierarchy is not None:
            base = hierarchy.root / name
            try:
                base.mkdir(exist_ok=True)
                if hierarchy.version == 2:    # let the containers' groups below have this controller's files
                    (base / "cgroup.subtree_control").write_text(f"+{self.CONTROLLER}")
                self.base = base
            except OSError:
                self.base = None

    @property
    def available(self) -> bool:
        return self.base is not None

    def _container_group(self, key: str) -> Path:
        """The folder of one container's group, made if it is not there yet."""
        assert self.base is not None and self.hierarchy is not None
        path = self.base / key
        path.mkdir(exist_ok=True)
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
