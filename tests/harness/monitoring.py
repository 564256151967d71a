"""Helpers for the monitoring tests: Debian's Prometheus (promtool, prometheus) and pod discovery for it.

Debian's prometheus package is built without Kubernetes service discovery, so a test Prometheus cannot run the
shipped ``kubernetes_sd_configs`` itself. ``file_sd_config`` swaps each for a ``file_sd_configs`` entry, and
``pod_targets`` writes what Kubernetes pod discovery would give for the same pods (one target per container
port, with the same ``__meta_kubernetes_*`` labels), so the shipped relabelling runs unchanged on them.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        raise RuntimeError("promtool is missing: hack/setup.sh installs Debian's prometheus package (apt-get install prometheus)")
    return path


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def file_sd_config(config: dict[str, Any], sd_dir: Path) -> dict[str, Any]:
    """The shipped Prometheus configuration with every kubernetes_sd_configs replaced by a file of targets
    (``<sd_dir>/<job>.json``, written by ``pod_targets``); everything else, relabelling included, unchanged."""
    out = copy.deepcopy(config)
    for job in out["scrape_configs"]:
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["file_sd_configs"] = [{"files": [str(sd_dir / f"{job['job_name']}.json")], "refresh_interval": "1s"}]
    return out


def _sanitize(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def pod_targets(sd: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Prometheus' Kubernetes discovery (role: pod) gives for ``pods`` under the sd config ``sd``: a target
    group per container port of every pod with an IP (a container without ports: one target at the pod IP)."""
    assert sd.get("role") == "pod", sd
    namespaces = set((sd.get("namespaces") or {}).get("names") or [])
    groups = []
    for pod in pods:
        meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status") or {}
        if namespaces and meta["namespace"] not in namespaces or not status.get("podIP"):
            continue
        common = {
            "__meta_kubernetes_namespace": meta["namespace"],
            "__meta_kubernetes_pod_name": meta["name"],
            "__meta_kubernetes_pod_ip": status["podIP"],
            "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
            "__meta_kubernetes_pod_phase": status.get("phase", ""),
            "__meta_kubernetes_pod_ready": next((c["status"].lower() for c in status.get("conditions") or []
                                                 if c["type"] == "Ready"), "unknown"),
            "__meta_kubernetes_pod_uid": meta.get("uid", ""),
        }
        for key, value in (meta.get("labels") or {}).items():
            common[f"__meta_kubernetes_pod_label_{_sanitize(key)}"] = value
            common[f"__meta_kubernetes_pod_labelpresent_{_sanitize(key)}"] = "true"
        for container in spec.get("containers", []):
            ports = container.get("ports") or []
            for port in ports or [None]:
                labels = dict(common, __meta_kubernetes_pod_container_name=container["name"],
                              __meta_kubernetes_pod_container_init="false")
                address = status["podIP"]
                if port is not None:
                    address = f"{status['podIP']}:{port['containerPort']}"
                    labels |= {"__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                               "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                               "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP")}
                groups.append({"targets": [address], "labels": labels})
    return groups


# ------------------------------------------------------------------------------------------- live Prometheus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PodDiscovery:
    """Kubernetes pod discovery for a Prometheus without it: every second, list the pods with the given
    kubeconfig (Prometheus' own ServiceAccount, so its RBAC is what is tested) and write each job's targets."""

    def __init__(self, kubectl: str, kubeconfig: Path, config: dict[str, Any], sd_dir: Path):
        self.kubectl, self.kubeconfig, self.sd_dir = kubectl, kubeconfig, sd_dir
        self.jobs = {j["job_name"]: j["kubernetes_sd_configs"][0] for j in config["scrape_configs"]}
        self.stop_event = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def refresh(self) -> None:
        out = subprocess.run([self.kubectl, f"--kubeconfig={self.kubeconfig}", "get", "pods", "-A", "-o", "json"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            self.errors.append(out.stderr.strip())
            return
        pods = json.loads(out.stdout)["items"]
        for job, sd in self.jobs.items():
            path = self.sd_dir / f"{job}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(pod_targets(sd, pods)))
            tmp.replace(path)

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            self.refresh()
            self.stop_event.wait(1.0)

    def start(self) -> PodDiscovery:
        self.refresh()
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=30)


class Prometheus:
    """Debian's prometheus as a child process on a free loopback port."""

    def __init__(self, workdir: Path, config: dict[str, Any], rules: str):
        import yaml
        self.workdir = workdir
        self.port = _free_port()
        (workdir / "rules.yaml").write_text(rules)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> Prometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is missing: hack/setup.sh installs Debian's prometheus package")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={self.workdir / 'prometheus.yml'}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, env={**os.environ})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"prometheus not ready after {timeout}s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def api(self, path: str, **params: Any) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(url, timeout=60) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def range_has_numbers(self, expr: str, start: float, end: float, step: float = 2.0) -> bool:
        """Whether a panel over [start, end] would draw anything: a point that is a number (not NaN)."""
        result = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")["result"]
        return any(value not in ("NaN", "+Inf", "-Inf") for series in result for _, value in series["values"])

    def label_values(self, variable_query: str) -> list[str]:
        """What Grafana's label_values(METRIC_SELECTOR, LABEL) lists."""
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable_query.strip())
        if not m:
            raise ValueError(f"not a label_values query: {variable_query}")
        return self.api(f"label/{m.group(2)}/values", **{"match[]": m.group(1)})


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's template variables in a query, replaced by the values a viewer picked."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("$" + name, values[name])
    if "$" in expr.replace("$value", ""):
        raise ValueError(f"a variable is left in {expr}")
    return expr
