"""CPU limits of local pods: quantities and quotas as the kubelet computes them, and a real CFS quota that holds a
busy process to its share of a core."""
import os
import resource
import subprocess
import sys
import time

import pytest

from tokenfleet_dev.localcluster.cpu_limits import MIN_QUOTA_US, PERIOD_US, CpuLimiter, millicores, quota_us
from tokenfleet_dev.localcluster.launch import LaunchError, container_launches


@pytest.mark.parametrize("text, expected", [("500m", 500), ("2", 2000), ("0.25", 250), (1, 1000), ("1.5", 1500),
                                             ("0.0005", 1), ("", None), (None, None)])
def test_cpu_quantities_in_millicores(text, expected):
    assert millicores(text) == expected


@pytest.mark.parametrize("text", ["1Gi", "-1", "m", "1.2.3", "five"])
def test_other_quantities_are_refused(text):
    with pytest.raises(ValueError):
        millicores(text)


def test_quota_is_the_limit_of_each_period_and_never_below_the_kernels_least():
    assert quota_us(500) == PERIOD_US // 2
    assert quota_us(2000) == 2 * PERIOD_US
    assert quota_us(1) == MIN_QUOTA_US


def _pod(resources: dict) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"containers": [{"name": "engine", "image": "tokenfleet/serving:1", "command": ["tokenfleet", "serve"],
                                     "resources": resources}]}}


def test_a_containers_limit_reaches_its_launch_and_a_bad_one_is_refused(tmp_path):
    launch, = container_launches(_pod({"limits": {"cpu": "750m"}, "requests": {"cpu": "100m"}}), "127.2.0.1",
                                 "127.0.0.1", {}, str(tmp_path), "tokenfleet/serving")
    assert launch.cpu_limit_millicores == 750
    launch, = container_launches(_pod({"requests": {"cpu": "1"}}), "127.2.0.1", "127.0.0.1", {}, str(tmp_path),
                                 "tokenfleet/serving")
    assert launch.cpu_limit_millicores is None          # a request alone limits nothing
    with pytest.raises(LaunchError, match="resources.limits.cpu"):
        container_launches(_pod({"limits": {"cpu": "lots"}}), "127.2.0.1", "127.0.0.1", {}, str(tmp_path),
                           "tokenfleet/serving")


BUSY = "import time\nend = time.monotonic() + 2.0\nwhile time.monotonic() < end: pass\n"


def _cpu_seconds_of(preexec) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", BUSY], preexec_fn=preexec, check=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups are written as root (the runner runs as root here)")
def test_a_quota_holds_a_busy_process_to_its_share_of_a_core():
    limiter = CpuLimiter(f"tokenfleet-test-{os.getpid()}")
    assert limiter.available, "no writable cgroup hierarchy with the cpu controller on this machine"
    try:
        group = limiter.group("busy", 200)
        limited = _cpu_seconds_of(limiter.enter(group))
        time.sleep(0.1)
        free = _cpu_seconds_of(None)
    finally:
        limiter.close()
    assert limited < 0.2 * 2.0 + 0.25            # 20 % of the 2 s it spun, plus start-up
    assert free > 2 * limited                    # without the group the same loop gets far more
    assert not limiter.base.exists()
