"""Helpers for the real-control-plane tests: install the manifests, run the
operator as a subprocess under its own ServiceAccount, wait for state."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE = "tokenfleet-system"
OPERATOR_SA = "tokenfleet-operator"
FAKE_IMAGE = "example.invalid/fake-serving:1"  # not the serving image: KWOK fakes these pods Ready


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install(cluster) -> None:
    """Apply CRDs, namespace, ServiceAccount and RBAC from manifests/ (as admin)."""
    cluster.kubectl("apply", "--server-side", "-k", str(REPO / "manifests" / "base"))
    for crd in ("inferenceservices.tokenfleet.dev", "slices.tokenfleet.dev", "slicequeues.tokenfleet.dev",
                "tokenroutes.tokenfleet.dev"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")


class Operator:
    """`tokenfleet operator` as a child process, authenticated as the operator's ServiceAccount."""

    def __init__(self, cluster, namespace: str, log_path: Path, *, identity: str = "op-a",
                 lease: str | None = None, extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 router_image: str = FAKE_IMAGE):
        """``lease``: the leader Lease's name (default: one per test namespace, so tests never compete);
        replicas given the same lease elect one leader. ``env``: added to the process's environment.
        ``router_image``: the routers' image (``--router-image``); by default one KWOK fakes Ready, as it does
        the services' FAKE_IMAGE replicas; a test whose requests go through a router passes the serving image,
        whose pods the local pod runner runs as ``tokenfleet route`` processes."""
        self.cluster, self.namespace, self.log_path = cluster, namespace, log_path
        self.env = env or {}
        self.router_image = router_image
        self.identity, self.lease, self.extra = identity, lease or f"tokenfleet-operator-{namespace}", extra
        self.kubeconfig = cluster.sa_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SA)
        self.proc: subprocess.Popen | None = None
        self.metrics_port = free_port()
        self.health_port = free_port()

    def start(self) -> Operator:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1", **self.env}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet_cli", "operator", "-n", self.namespace,
             f"--metrics-port={self.metrics_port}", f"--health-port={self.health_port}",
             "--resync-seconds=3", "--replica-key-check-seconds=3",
             f"--identity={self.identity}", f"--lease-name={self.lease}", f"--lease-namespace={OPERATOR_NAMESPACE}",
             f"--router-image={self.router_image}", *self.extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        )
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def metrics(self) -> str:
        """The operator's /metrics text ("" while it does not answer)."""
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return ""

    def is_leader(self) -> bool:
        return "tokenfleet_operator_leader 1.0" in self.metrics()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def get_json(cluster, *args: str) -> Any:
    out = cluster.kubectl("get", *args, "-o", "json", check=False)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)


def names(cluster, kind: str, namespace: str, selector: str | None = None) -> list[str]:
    args = [kind, "-n", namespace] + (["-l", selector] if selector else [])
    items = (get_json(cluster, *args) or {}).get("items", [])
    return sorted(i["metadata"]["name"] for i in items)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 90, operator: Operator | None = None) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as e:  # transient kubectl errors
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.5)
    tail = f"\n--- operator log ---\n{operator.log()}" if operator else ""
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}{tail}")


def apply(cluster, manifest: dict, namespace: str, check: bool = True) -> subprocess.CompletedProcess:
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=check)


def isvc(name: str, **spec: Any) -> dict:
    body = {
        "model": {"path": "/models/tiny", "servedModelNames": ["tiny"]},
        "replicas": 2,
        "accelerator": {"type": "nvidia-h100-80gb", "countPerHost": 1, "hostsPerReplica": 2, "topology": "2x1"},
        "image": FAKE_IMAGE,
        "price": {"acceleratorPerHour": 2.0, "overheadPerHour": 0.5},
        "slicePolicy": {"topologyKey": "tokenfleet.dev/block", "restartPolicy": {"backoffSeconds": 1}},
    }
    body.update(spec)
    return {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": body}


def condition(obj: dict | None, type_: str) -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


def isvc_obj(cluster, namespace, name="svc"):
    return get_json(cluster, "inferenceservice", name, "-n", namespace)


def ready_with(cluster, namespace, name, replicas):
    obj = isvc_obj(cluster, namespace, name)
    status = (obj or {}).get("status") or {}
    ok = (
        condition(obj, "Ready").get("status") == "True"
        and status.get("readyReplicas") == replicas
        and status.get("updatedReplicas") == replicas
        and status.get("replicas") == replicas
        and status.get("observedGeneration") == obj["metadata"]["generation"]
    )
    return obj if ok else None


def children(cluster, namespace, name="svc"):
    sel = f"tokenfleet.dev/inference-service={name}"
    return {
        "slices": names(cluster, "slices", namespace, sel),
        "deployments": names(cluster, "deployments", namespace, sel),
        "services": names(cluster, "services", namespace, sel),
        "configmaps": names(cluster, "configmaps", namespace, sel),
        "pods": names(cluster, "pods", namespace, "tokenfleet.dev/role=serve"),
    }


def expected(name, replicas, hosts=2):
    return {
        "slices": sorted(f"{name}-{i}" for i in range(replicas)),
        "deployments": [f"{name}-router"],
        "services": sorted([name, f"{name}-engines"]),
        "configmaps": [f"{name}-router"],
        "pods": sorted(f"{name}-{i}-{m}" for i in range(replicas) for m in range(hosts)),
    }
