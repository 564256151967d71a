"""The local pod runner holds each container to its memory limit as a kubelet does (issue 48, item 1): a pod that
allocates more than ``resources.limits.memory`` is ended, alone, and its status says OOMKilled."""
from __future__ import annotations

import json
from pathlib import Path

from harness.support import wait_until

# allocates 64 MiB at a time, up to 1 GiB; then leaves a mark that it got there
GREEDY = ("import os, time\nheld = []\nfor _ in range(16):\n    held.append(bytearray(64 << 20))\n    time.sleep(0.05)\n"
          "open(os.environ['MARK'], 'w').write('1 GiB')\ntime.sleep(600)\n")


def _pod(name: str, limit: str, work: Path) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "c", "image": "tokenfleet/serving:test", "command": ["python3", "-c", GREEDY],
                                     "env": [{"name": "MARK", "value": f"/work/{name}"}],
                                     "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                                     "resources": {"limits": {"memory": limit}, "requests": {"memory": limit}}}],
                     "volumes": [{"name": "work", "hostPath": {"path": str(work)}}]}}


def _terminated(cluster, namespace: str, name: str) -> dict | None:
    out = cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    if out.returncode != 0:
        return None
    statuses = json.loads(out.stdout).get("status", {}).get("containerStatuses") or []
    return next((s["state"]["terminated"] for s in statuses if "terminated" in s.get("state", {})), None)


def test_a_pod_over_its_memory_limit_is_oom_killed_and_one_within_it_runs(cluster, namespace, tmp_path):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_pod("greedy", "256Mi", tmp_path)))
    # the same allocation within a limit that holds it: it keeps running
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_pod("roomy", "2Gi", tmp_path)))
    term = wait_until(lambda: _terminated(cluster, namespace, "greedy"), 90, 0.5, "greedy to be ended")
    assert term["reason"] == "OOMKilled" and term["exitCode"] == 137, term
    phase = json.loads(cluster.kubectl("get", "pod", "greedy", "-n", namespace, "-o", "json").stdout)["status"]["phase"]
    assert phase == "Failed"
    assert not (tmp_path / "greedy").exists()
    wait_until(lambda: (tmp_path / "roomy").exists(), 90, 0.5, "roomy to hold its 1 GiB")
    assert _terminated(cluster, namespace, "roomy") is None
    cluster.kubectl("delete", "pod", "roomy", "-n", namespace, "--wait=false")
