"""Memory limits of local pods (issue 48, item 1): quantities as the kubelet reads them, a container that
outgrows its limit ended (by its memory cgroup, or where none can be written by the watchdog) and reported
OOMKilled as a kubelet reports it."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from kubernetes import client

from tokenfleet_dev.localcluster.container_limits import ContainerLimits
from tokenfleet_dev.localcluster.launch import ContainerLaunch, LaunchError, container_launches
from tokenfleet_dev.localcluster.memory_limits import MemoryLimiter, memory_bytes, process_tree, resident_bytes
from tokenfleet_dev.localcluster.podrunner import PodRunner, Running

MIB = 1 << 20


@pytest.mark.parametrize("text, expected", [("512Mi", 512 * MIB), ("1Gi", 1 << 30), ("1G", 10**9), ("1e9", 10**9),
                                             ("1.5Gi", 3 << 29), (1073741824, 1 << 30), ("100k", 100_000),
                                             ("1500m", 2), ("", None), (None, None)])
def test_memory_quantities_in_bytes(text, expected):
    assert memory_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1Gi", "1GB", "Gi", "1.2.3Mi"])
def test_other_quantities_are_refused(text):
    with pytest.raises(ValueError):
        memory_bytes(text)


def _pod(resources: dict) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"containers": [{"name": "engine", "image": "tokenfleet/serving:1", "command": ["tokenfleet", "serve"],
                                     "resources": resources}]}}


def test_a_containers_memory_limit_reaches_its_launch_and_a_bad_one_is_refused_naming_the_field(tmp_path):
    launch, = container_launches(_pod({"limits": {"memory": "2Gi"}, "requests": {"memory": "1Gi"}}), "127.2.0.1",
                                 "127.0.0.1", {}, str(tmp_path), "tokenfleet/serving")
    assert launch.memory_limit_bytes == 2 << 30
    launch, = container_launches(_pod({"requests": {"memory": "1Gi"}}), "127.2.0.1", "127.0.0.1", {}, str(tmp_path),
                                 "tokenfleet/serving")
    assert launch.memory_limit_bytes is None            # a request alone limits nothing
    with pytest.raises(LaunchError, match="resources.limits.memory"):
        container_launches(_pod({"limits": {"memory": "a lot"}}), "127.2.0.1", "127.0.0.1", {}, str(tmp_path),
                           "tokenfleet/serving")


# touches 64 MiB at a time up to 1 GiB, then waits: far over the 128 MiB limit below
GREEDY = ("import time\nheld = []\nfor _ in range(16):\n    held.append(bytearray(64 << 20))\n    time.sleep(0.05)\n"
          "time.sleep(30)\n")


def _run_over_limit(limits: ContainerLimits, key: str) -> tuple[int, bool]:
    """Run GREEDY under a 128 MiB limit as the runner does (the watchdog looks where no group holds it);
    returns its exit status and whether the runner would report it OOMKilled."""
    groups, preexec = limits.enter(key, None, 128 * MIB)
    proc = subprocess.Popen([sys.executable, "-c", GREEDY], preexec_fn=preexec)
    killed = False
    try:
        deadline = time.monotonic() + 25
        while proc.poll() is None and time.monotonic() < deadline:
            killed = killed or limits.kill_over_limit(proc.pid, groups, 128 * MIB) is not None
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    oom = killed or limits.oom_killed(groups)
    limits.release(groups)
    return proc.returncode, oom


def test_a_container_over_its_memory_limit_is_ended_and_counted_as_oom_killed():
    # the kernel's OOM killer in the container's group where this host lets the runner write one (as root on
    # cgroup v1 or v2), else the watchdog: either way the container ends, and it alone
    limiter = MemoryLimiter(f"tokenfleet-test-{__import__('os').getpid()}")
    limits = ContainerLimits(memory=limiter)
    try:
        code, oom = _run_over_limit(limits, "greedy")
    finally:
        limits.close()
    assert code == -9 and oom
    assert limiter.base is None or not limiter.base.exists()


def test_where_no_memory_cgroup_can_be_written_the_watchdog_ends_a_container_over_its_limit():
    code, oom = _run_over_limit(ContainerLimits(memory=None), "greedy")
    assert code == -9 and oom


def test_the_watchdog_counts_the_memory_of_the_whole_process_tree_once():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                              "b = bytearray(96 << 20)\n"
                              "p = subprocess.Popen([sys.executable, '-c', 'import time; b = bytearray(96 << 20); time.sleep(30)'])\n"
                              "time.sleep(30)\n"])
    try:
        deadline = time.monotonic() + 20
        while len(process_tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        tree = process_tree(child.pid)
        assert len(tree) == 2
        assert 192 * MIB <= resident_bytes(tree) < 400 * MIB
    finally:
        for pid in reversed(process_tree(child.pid)):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        child.wait()


def test_an_oom_killed_container_is_reported_as_a_kubelet_reports_it():
    api = client.CoreV1Api(client.ApiClient(client.Configuration(host="https://127.0.0.1:6443")))
    runner = PodRunner(api, "tokenfleet/serving", "127.2.0.0/24", Path("/nonexistent"))
    r = Running(ContainerLaunch("engine", "tokenfleet/serving:1", ("x",)), None, "2026-01-01T00:00:00Z")
    r.exit_code, r.oom_killed = -9, True
    term = runner._container_status(r)["state"]["terminated"]
    assert (term["reason"], term["exitCode"]) == ("OOMKilled", 137)
    r.oom_killed = False                       # killed by a signal otherwise: 128 + its number, an Error
    term = runner._container_status(r)["state"]["terminated"]
    assert (term["reason"], term["exitCode"]) == ("Error", 137)
    r.exit_code = 0
    assert runner._container_status(r)["state"]["terminated"]["reason"] == "Completed"
