"""Starting and stopping planes leaves no process behind, even when a test fails."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenfleet_dev.localcluster.plane import pid_alive

REPO = Path(__file__).resolve().parents[3]
COMPONENTS = {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "pod-runner"}


def recorded_pids(d: Path) -> dict[str, int]:
    state = json.loads((d / "state.json").read_text())
    return state.get("stopped") or {n: p["pid"] for n, p in state["processes"].items()}


@pytest.mark.slow
def test_cli_up_then_down_stops_every_process(tmp_path):
    d = tmp_path / "plane"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "cluster", "up", "--dir", str(d), "--nodes", "2"],
                        capture_output=True, text=True, env=env, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"export KUBECONFIG={d / 'admin.kubeconfig'}" in up.stdout
    state = json.loads((d / "state.json").read_text())
    pids = {n: p["pid"] for n, p in state["processes"].items()}
    assert set(pids) == COMPONENTS
    assert all(pid_alive(p) for p in pids.values()), "'up' returned but a component is not running"
    nodes = subprocess.run([state["bin_dir"] + "/kubectl", f"--kubeconfig={d / 'admin.kubeconfig'}", "get", "nodes",
                            "-o", "name"], capture_output=True, text=True)
    assert len(nodes.stdout.split()) == 2
    down = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "cluster", "down", "--dir", str(d)],
                          capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert [p for n, p in pids.items() if pid_alive(p)] == []
    # A second 'down' is harmless.
    again = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "cluster", "down", "--dir", str(d)],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "nothing was running" in again.stdout


@pytest.mark.slow
def test_a_failing_test_leaves_no_process_of_the_plane(tmp_path):
    d = tmp_path / "inner-plane"
    (tmp_path / "test_inner.py").write_text(textwrap.dedent("""
        def test_fails(cluster):
            assert cluster.ready_nodes()
            assert False, "deliberate failure"
        """))
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    env = {**os.environ, "TOKENFLEET_TEST_CLUSTER_DIR": str(d)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_inner.py")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 1 and "deliberate failure" in run.stdout, run.stdout[-3000:]
    pids = recorded_pids(d)
    assert set(pids) == COMPONENTS
    assert [n for n, p in pids.items() if pid_alive(p)] == []


@pytest.mark.slow
def test_a_killed_test_process_takes_the_plane_with_it(tmp_path):
    """Even SIGKILL of the test process (no teardown) ends the plane: children die with their parent."""
    d = tmp_path / "orphan-plane"
    script = textwrap.dedent(f"""
        import os, signal, sys
        from tokenfleet_dev.localcluster.plane import LocalCluster
        LocalCluster({str(d)!r}, tie_to_parent=True, log=lambda m: None).up()
        print("UP", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert "UP" in run.stdout, run.stderr[-3000:]
    pids = recorded_pids(d)
    import time
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [n for n, p in pids.items() if pid_alive(p)] == []
