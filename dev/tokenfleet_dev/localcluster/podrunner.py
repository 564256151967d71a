"""The local pod runner: the embedded stand-in for a container runtime.

For every pod that is bound to a node and whose image is tokenfleet's serving
image or a vLLM image (``launch.image_runtime``), it runs the container's command as a local process bound to a
loopback pod IP (``launch.py`` decides what to run), reports Running, and
reports Ready only once the readiness probe passes. It stands in for cluster
DNS too: a pod whose env or arguments name another pod by its headless-Service
name (hostname.subdomain.namespace.svc) gets that pod's IP in their place,
and waits (up to RESOLVE_WAIT_SECONDS) until such a record would exist. Only pods on KWOK's fake
nodes are its own: a real node's kubelet runs the pods bound to it. When the pod is deleted
it sends SIGTERM, waits up to the grace period, then SIGKILL, and finally
removes the pod object (the kubelet's last step). Pods of any other image are
left to KWOK.

Run as ``python -m tokenfleet_dev.localcluster.podrunner --kubeconfig K``.
"""
from __future__ import annotations

import argparse
import base64
import datetime as dt
import ipaddress
import json
import logging
import os
import queue
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from .container_limits import ContainerLimits, Groups
from .cpu_limits import CpuLimiter
from .launch import POD_DNS_NAME, ContainerLaunch, FileVolume, LaunchError, Probe, container_launches, image_runtime, pod_dns_names
from .memory_limits import WATCH_SECONDS, MemoryLimiter
from .nodes import KWOK_ANNOTATION

log = logging.getLogger("pod-runner")

# A pod that names another pod by its DNS name waits this long for the name to resolve before it starts
# anyway (and fails to resolve it, as it would against cluster DNS).
RESOLVE_WAIT_SECONDS = 60.0
# How often the runner compares the Ready condition the API holds for its pods with what it reported.
STATUS_CHECK_SECONDS = 2.0


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _bindable(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


class IpPool:
    """Pod addresses from a CIDR, handed out in order from a random place in it: several planes on one machine
    (parallel test sessions) share 127.2.0.0/16, and two that both started at .1 would bind the same address."""

    def __init__(self, cidr: str, rng: random.Random | None = None):
        hosts = list(ipaddress.ip_network(cidr).hosts())
        start = (rng or random.Random()).randrange(len(hosts))
        self._hosts = iter(hosts[start:] + hosts[:start])
        self._free: list[str] = []
        self._lock = threading.Lock()

    def take(self, ports: tuple[int, ...] = ()) -> str:
        """A free address; with ``ports``, one where none of them is in use already (by a process of
        another plane on this host, or one that outlived its pod)."""
        with self._lock:
            skipped = []
            while True:
                ip = self._free.pop(0) if self._free else str(next(self._hosts))
                if all(_bindable(ip, port) for port in ports):
                    self._free[:0] = skipped
                    return ip
                skipped.append(ip)

    def give(self, ip: str) -> None:
        with self._lock:
            self._free.append(ip)


@dataclass
class Running:
    launch: ContainerLaunch
    proc: subprocess.Popen | None
    started: str
    restarts: int = 0
    ready: bool = False
    failures: int = 0
    next_probe: float = 0.0
    exit_code: int | None = None
    next_restart: float = 0.0
    log: Path | None = None
    groups: Groups = field(default_factory=Groups)   # the cgroups holding it to its limits (container_limits.py)
    oom_killed: bool = False       # ended for its memory limit: by the kernel's OOM killer, or the watchdog


def termination_message(r: Running) -> str:
    """What the kubelet would put in the terminated state: the termination log file (4 KiB at most), or with
    FallbackToLogsOnError and a failed container that wrote none, the end of its log (2 KiB, 80 lines)."""
    try:
        text = Path(r.launch.termination_log).read_bytes()[:4096].decode(errors="replace") if r.launch.termination_log else ""
    except OSError:
        text = ""
    if not text.strip() and r.exit_code and r.launch.termination_policy == "FallbackToLogsOnError" and r.log:
        try:
            tail = r.log.read_bytes()[-2048:].decode(errors="replace")
        except OSError:
            tail = ""
        text = "\n".join(tail.splitlines()[-80:])
    return text


@dataclass
class LocalPod:
    uid: str
    namespace: str
    name: str
    ip: str
    host_ip: str
    restart_policy: str
    containers: list[Running] = field(default_factory=list)
    service_account: str = "default"
    terminating: bool = False
    reported: tuple | None = None
    tokens: dict = field(default_factory=dict)
    node: str = ""
    api_ready: bool | None = None     # the pod's Ready condition as the API last showed it


class PodRunner:
    def __init__(self, api: client.CoreV1Api, image_prefix: str, cidr: str, log_dir: Path,
                 limits: ContainerLimits | None = None):
        self.api = api
        self.limits = limits or ContainerLimits()
        self._next_memory_watch = 0.0
        self.image_prefix = image_prefix
        self.ips = IpPool(cidr)
        self.log_dir = log_dir
        self.pods: dict[str, LocalPod] = {}
        self.events: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self._next_volume_refresh = 0.0
        self._fake_node: dict[str, bool] = {}
        self._unresolved: dict[str, tuple[object, float]] = {}   # uid -> (pod, when it first waited for a name)
        self._next_status_check = 0.0
        # What the kubelet gives every container to find the API server.
        url = urllib.parse.urlsplit(api.api_client.configuration.host)
        self.service_env = {"KUBERNETES_SERVICE_HOST": url.hostname, "KUBERNETES_SERVICE_PORT": str(url.port or 443)}

    # ---------------------------------------------------------------- intake
    def ours(self, pod) -> bool:
        if pod.metadata.uid in self.pods:
            return True
        return (any(image_runtime(c.image or "", self.image_prefix) for c in pod.spec.containers)
                and self.on_fake_node(pod))

    def on_fake_node(self, pod) -> bool:
        """Whether the pod is bound to a KWOK node (annotated kwok.x-k8s.io/node=fake) rather than a real one."""
        name = pod.spec.node_name
        if name not in self._fake_node:
            try:
                node = self.api.read_node(name)
            except ApiException as e:
                if e.status == 404:
                    return False     # no such node (any more): nothing to start
                raise
            self._fake_node[name] = (node.metadata.annotations or {}).get(KWOK_ANNOTATION) == "fake"
        return self._fake_node[name]

    def maybe_ours(self, raw: dict) -> bool:
        """A cheap look at a watched pod, still JSON: whether ``ours`` needs to see it at all. Most pods of a
        plane run another image (KWOK fakes them), and turning each into a V1Pod, at every event and at every
        minute's relist, cost more CPU than anything else the runner does."""
        meta, spec = raw.get("metadata") or {}, raw.get("spec") or {}
        return meta.get("uid") in self.pods or any(
            image_runtime(c.get("image") or "", self.image_prefix) for c in spec.get("containers") or ())

    def watch_pods(self) -> None:
        while not self.stopping.is_set():
            try:
                w = watch.Watch()
                # a new watch each minute lists every bound pod again: the runner's resync
                for ev in w.stream(self.api.list_pod_for_all_namespaces, timeout_seconds=60,
                                   field_selector="spec.nodeName!=", deserialize=False):
                    raw = ev.get("object")
                    if ev.get("type") == "ERROR" or not isinstance(raw, dict):
                        raise RuntimeError(f"watch error: {raw}")
                    if self.maybe_ours(raw):
                        self.events.put(self.api.api_client.deserialize(json.dumps(raw), "V1Pod", "application/json"))
                    if self.stopping.is_set():
                        w.stop()
            except Exception as e:  # the API may be restarting: retry
                if not self.stopping.is_set():
                    log.warning("watch failed: %s; retrying", e)
                    time.sleep(1)

    def handle(self, pod) -> None:
        if not self.ours(pod):
            return
        uid = pod.metadata.uid
        local = self.pods.get(uid)
        if local is not None:
            local.api_ready = _ready_condition(self.api.api_client.sanitize_for_serialization(pod))
        if pod.metadata.deletion_timestamp is not None:
            self._unresolved.pop(uid, None)
            if local and not local.terminating:
                local.terminating = True
                grace = pod.metadata.deletion_grace_period_seconds
                grace = 30 if grace is None else grace
                threading.Thread(target=self.terminate, args=(local, grace), daemon=True).start()
            elif local is None:
                self._finalize_delete(pod.metadata.namespace, pod.metadata.name, uid)
            return
        if local is None and pod.status.phase in ("Pending", None, "Running"):
            if uid in self._unresolved:
                self._unresolved[uid] = (pod, self._unresolved[uid][1])
                return
            self.start(pod)

    # ------------------------------------------------------------ pod DNS
    def _pod_address(self, host: str, subdomain: str, namespace: str, own_uid: str, own_ip: str) -> str | None:
        """What cluster DNS answers for host.subdomain.namespace.svc: the IP of the pod with that hostname and
        subdomain, when a headless Service named like the subdomain selects it (and it is ready, unless the
        Service publishes pods that are not); None while there is no such record."""
        try:
            service = self.api.read_namespaced_service(subdomain, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        if service.spec.cluster_ip != "None" or not service.spec.selector:
            return None
        selector = ",".join(f"{k}={v}" for k, v in sorted(service.spec.selector.items()))
        for pod in self.api.list_namespaced_pod(namespace, label_selector=selector).items:
            if pod.spec.hostname != host or pod.spec.subdomain != subdomain or pod.metadata.deletion_timestamp:
                continue
            if pod.metadata.uid == own_uid:
                return own_ip
            local = self.pods.get(pod.metadata.uid)
            ready = local is not None and bool(local.reported and local.reported[1])
            if not service.spec.publish_not_ready_addresses and not ready:
                return None
            return local.ip if local is not None else (pod.status.pod_ip if pod.status else None)
        return None

    def _addresses(self, raw: dict, uid: str, ip: str) -> tuple[dict[str, str], list[str]]:
        """(pod DNS name -> IP, the names that do not resolve yet) for the names the pod's containers use."""
        found, missing = {}, []
        for name in sorted(pod_dns_names(raw)):
            m = POD_DNS_NAME.match(name)
            assert m is not None
            address = self._pod_address(m["host"], m["subdomain"], m["namespace"], uid, ip)
            if address:
                found[name] = address
            else:
                missing.append(name)
        return found, missing

    def retry_unresolved(self) -> None:
        for uid, (pod, _) in list(self._unresolved.items()):
            if uid not in self.pods:
                self.start(pod)

    # ----------------------------------------------------------------- start
    def _lookup(self, kind: str, ns: str, name: str, key: str) -> str | None:
        """One key of a ConfigMap or Secret (env valueFrom), or None if either is missing."""
        return (self._source_data(kind, ns, name) or {}).get(key)

    def _source_data(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        try:
            if kind == "configmap":
                return self.api.read_namespaced_config_map(name, namespace).data or {}
            raw = self.api.read_namespaced_secret(name, namespace).data or {}
            return {k: base64.b64decode(b).decode(errors="replace") for k, b in raw.items()}
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _token(self, local: LocalPod, src: dict) -> str:
        """A ServiceAccount token bound to the pod (TokenRequest), renewed at 80% of its lifetime."""
        key = (src.get("audience"), src.get("expirationSeconds", 3600))
        cached = local.tokens.get(key)
        if cached and time.monotonic() < cached[1]:
            return cached[0]
        spec = client.V1TokenRequestSpec(
            audiences=[src["audience"]] if src.get("audience") else [],
            expiration_seconds=int(src.get("expirationSeconds", 3600)),
            bound_object_ref=client.V1BoundObjectReference(kind="Pod", api_version="v1", name=local.name,
                                                           uid=local.uid))
        tr = self.api.create_namespaced_service_account_token(local.service_account, local.namespace,
                                                              client.AuthenticationV1TokenRequest(spec=spec))
        lifetime = int(src.get("expirationSeconds", 3600))
        local.tokens[key] = (tr.status.token, time.monotonic() + 0.8 * lifetime)
        return tr.status.token

    def _field(self, local: LocalPod, path: str) -> str:
        return {"metadata.namespace": local.namespace, "metadata.name": local.name,
                "metadata.uid": local.uid}.get(path, "")

    def _volume_files(self, local: LocalPod, v: FileVolume) -> dict[str, str] | None:
        """The files of one volume (relative path -> content), or None if a required source is missing."""
        if v.kind in ("configmap", "secret"):
            data = self._source_data(v.kind, local.namespace, v.source)
            if data is None:
                return {} if v.optional else None
            items = v.items or tuple((k, k) for k in data)
            return {rel: data[key] for key, rel in items if key in data}
        files: dict[str, str] = {}
        for src in v.projections:
            if "serviceAccountToken" in src:
                files[src["serviceAccountToken"]["path"]] = self._token(local, src["serviceAccountToken"])
            elif "downwardAPI" in src:
                for item in src["downwardAPI"].get("items", []):
                    files[item["path"]] = self._field(local, item.get("fieldRef", {}).get("fieldPath", ""))
            else:
                kind = "configmap" if "configMap" in src else "secret"
                ref = src.get("configMap") or src.get("secret")
                data = self._source_data(kind, local.namespace, ref["name"])
                if data is None:
                    if ref.get("optional"):
                        continue
                    return None
                items = tuple((i["key"], i["path"]) for i in ref.get("items", [])) or tuple((k, k) for k in data)
                files.update({rel: data[key] for key, rel in items if key in data})
        return files

    def write_volumes(self, local: LocalPod, launch: ContainerLaunch) -> bool:
        """Write configMap/secret/projected volumes as files; True when every required source exists."""
        ok = True
        for v in launch.volumes:
            files = self._volume_files(local, v)
            if files is None:
                ok = False
                continue
            base = Path(v.dir)
            base.mkdir(parents=True, exist_ok=True)
            for rel, content in files.items():
                target = base / rel
                if target.exists() and target.read_text(errors="replace") == content:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.tmp")
                tmp.write_text(content)
                tmp.replace(target)  # atomic, so a reader never sees half a file
        return ok

    def start(self, pod) -> None:
        raw = self.api.api_client.sanitize_for_serialization(pod)
        ports = tuple(int(p.container_port) for c in pod.spec.containers for p in (c.ports or []) if p.container_port)
        ip = self.ips.take(ports)
        addresses, missing = self._addresses(raw, pod.metadata.uid, ip)
        waiting_since = self._unresolved.get(pod.metadata.uid, (None, time.monotonic()))[1]
        if missing and time.monotonic() - waiting_since < RESOLVE_WAIT_SECONDS:
            self.ips.give(ip)                       # not started: wait for the names to resolve
            self._unresolved[pod.metadata.uid] = (pod, waiting_since)
            return
        if self._unresolved.pop(pod.metadata.uid, None) and missing:
            log.warning("%s/%s starts with names no DNS record answers yet: %s", pod.metadata.namespace,
                        pod.metadata.name, ", ".join(missing))
        host_ip = "127.0.0.1"
        node = pod.spec.node_name
        try:
            n = self.api.read_node(node)
            host_ip = next((a.address for a in n.status.addresses or [] if a.type == "InternalIP"), host_ip)
        except ApiException:
            pass
        scratch = self.log_dir / f"{pod.metadata.namespace}_{pod.metadata.name}_{pod.metadata.uid[:8]}"
        scratch.mkdir(parents=True, exist_ok=True)
        local = LocalPod(pod.metadata.uid, pod.metadata.namespace, pod.metadata.name, ip, host_ip,
                         pod.spec.restart_policy or "Always",
                         service_account=pod.spec.service_account_name or "default", node=node)
        self.pods[local.uid] = local
        try:
            launches = container_launches(raw, ip, host_ip, {**os.environ, **self.service_env}, str(scratch),
                                          self.image_prefix, lookup=self._lookup, addresses=addresses)
        except LaunchError as e:
            log.error("%s/%s cannot run locally: %s", local.namespace, local.name, e)
            self._patch(local, {"phase": "Failed", "reason": "LocalRunnerError", "message": str(e)})
            return
        for launch in launches:
            (scratch / "volumes").mkdir(exist_ok=True)
            if not self.write_volumes(local, launch):
                msg = f"container {launch.name}: a configMap/secret volume source does not exist"
                log.error("%s/%s: %s", local.namespace, local.name, msg)
                self._patch(local, {"phase": "Failed", "reason": "LocalRunnerError", "message": msg})
                return
            running = Running(launch, None, now())
            self._spawn(local, running, scratch)
            local.containers.append(running)
        log.info("started %s/%s on %s (%s)", local.namespace, local.name, ip, node)
        self.report(local, force=True)

    def _spawn(self, local: LocalPod, running: Running, scratch: Path) -> None:
        if running.launch.termination_log:
            Path(running.launch.termination_log).unlink(missing_ok=True)   # a restart starts a new message
        running.log = scratch / f"{running.launch.name}.log"
        for folder in running.launch.empty_dirs:
            Path(folder).mkdir(parents=True, exist_ok=True)
        out = open(running.log, "ab")
        Path(running.launch.cwd or scratch).mkdir(parents=True, exist_ok=True)
        running.groups, preexec = self.limits.enter(f"{local.uid}-{running.launch.name}",
                                                    running.launch.cpu_limit_millicores,
                                                    running.launch.memory_limit_bytes)
        running.oom_killed = False
        running.proc = subprocess.Popen(list(running.launch.argv), env=running.launch.env,
                                        cwd=running.launch.cwd or scratch, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=preexec)
        out.close()
        running.started = now()
        running.ready = False
        running.failures = 0
        running.exit_code = None
        probe = running.launch.readiness
        running.next_probe = time.monotonic() + (probe.initial_delay if probe else 0)

    def _watch_memory(self, local: LocalPod) -> None:
        """Where no memory cgroup holds a container to its limit, kill it once it holds more (memory_limits.py)."""
        for r in (r for r in local.containers if r.proc is not None and r.exit_code is None):
            held = self.limits.kill_over_limit(r.proc.pid, r.groups, r.launch.memory_limit_bytes)
            if held is not None:
                r.oom_killed = True
                log.warning("%s/%s container %s held %d MiB, over its memory limit: killed", local.namespace,
                            local.name, r.launch.name, held >> 20)

    # ------------------------------------------------------------ supervise
    def probe(self, local: LocalPod, probe: Probe) -> bool:
        try:
            if probe.kind == "http":
                with urllib.request.urlopen(f"http://{local.ip}:{probe.port}{probe.path}",
                                            timeout=probe.timeout) as r:
                    return 200 <= r.status < 400
            with socket.create_connection((local.ip, probe.port), timeout=probe.timeout):
                return True
        except Exception:
            return False

    def tick(self) -> None:
        t = time.monotonic()
        if self._unresolved:
            self.retry_unresolved()
        if t >= self._next_status_check:
            self._next_status_check = t + STATUS_CHECK_SECONDS
            self.reconcile_status()
        if t >= self._next_volume_refresh:
            self._next_volume_refresh = t + 2.0
            for local in list(self.pods.values()):
                for r in local.containers:
                    if r.launch.volumes and not local.terminating:
                        try:
                            self.write_volumes(local, r.launch)
                        except Exception as e:
                            log.warning("refreshing volumes of %s/%s: %s", local.namespace, local.name, e)
        watch_memory = t >= self._next_memory_watch
        if watch_memory:
            self._next_memory_watch = t + WATCH_SECONDS
        for local in list(self.pods.values()):
            if local.terminating:
                continue
            if watch_memory:
                self._watch_memory(local)
            for r in local.containers:
                if r.proc is not None and r.exit_code is None and r.proc.poll() is not None:
                    r.exit_code = r.proc.returncode
                    r.ready = False
                    r.oom_killed = r.oom_killed or self.limits.oom_killed(r.groups)
                    self.limits.release(r.groups)
                    log.info("%s/%s container %s exited %s", local.namespace, local.name, r.launch.name, r.exit_code)
                    if local.restart_policy == "Always" or (local.restart_policy == "OnFailure" and r.exit_code):
                        r.next_restart = t + min(2 ** r.restarts, 30)
                if r.exit_code is not None and r.next_restart and t >= r.next_restart:
                    r.restarts += 1
                    r.next_restart = 0.0
                    self._spawn(local, r, self.log_dir / f"{local.namespace}_{local.name}_{local.uid[:8]}")
                if r.exit_code is None and t >= r.next_probe:
                    probe = r.launch.readiness
                    if probe is None:
                        r.ready = True
                    else:
                        ok = self.probe(local, probe)
                        r.failures = 0 if ok else r.failures + 1
                        if ok:
                            r.ready = True
                        elif r.failures >= probe.failure_threshold:
                            r.ready = False
                        r.next_probe = t + (probe.period if r.ready else min(probe.period, 0.5))
            self.report(local)

    def reconcile_status(self) -> None:
        """Write a pod's status again where the API's Ready condition is not what the runner reported, as a
        kubelet's status manager does. The node lifecycle controller marks every pod of a node not ready when
        the node's lease lapses (a loaded host can renew KWOK's leases late); once the node is Ready again,
        nothing else would say that the pods are. While the node is not Ready, the controller's word stands."""
        node_ready: dict[str, bool] = {}
        for local in list(self.pods.values()):
            if local.terminating or local.reported is None or local.api_ready is None:
                continue
            if local.api_ready == local.reported[1]:
                continue
            if local.node not in node_ready:
                try:
                    node_ready[local.node] = _ready_condition(
                        self.api.api_client.sanitize_for_serialization(self.api.read_node(local.node))) is True
                except ApiException:
                    node_ready[local.node] = False
            if node_ready[local.node]:
                log.info("%s/%s: the API shows Ready=%s, the runner reported %s: writing its status again",
                         local.namespace, local.name, local.api_ready, local.reported[1])
                self.report(local, force=True)

    def _container_status(self, r: Running) -> dict:
        if r.exit_code is None:
            state = {"running": {"startedAt": r.started}}
        else:
            # a process ended by a signal exits 128 + its number, as a container runtime reports it; a container
            # in which the OOM killer (or the watchdog) ended a process is OOMKilled, whatever its code
            code = 128 - r.exit_code if r.exit_code < 0 else r.exit_code
            reason = "OOMKilled" if r.oom_killed else "Completed" if code == 0 else "Error"
            state = {"terminated": {"exitCode": code, "startedAt": r.started, "finishedAt": now(),
                                    "reason": reason}}
            message = termination_message(r)
            if message:
                state["terminated"]["message"] = message
        return {"name": r.launch.name, "image": r.launch.image, "imageID": "", "ready": r.ready,
                "started": r.exit_code is None, "restartCount": r.restarts, "state": state}

    def report(self, local: LocalPod, force: bool = False) -> None:
        done = [r for r in local.containers if r.exit_code is not None and not r.next_restart]
        phase = "Running"
        if local.containers and len(done) == len(local.containers):
            phase = "Succeeded" if all(r.exit_code == 0 for r in done) else "Failed"
        ready = bool(local.containers) and all(r.ready for r in local.containers) and phase == "Running"
        key = (phase, ready, tuple((r.exit_code, r.restarts, r.ready) for r in local.containers))
        if key == local.reported and not force:
            return
        status = "True" if ready else "False"
        t = now()
        self._patch(local, {
            "phase": phase, "podIP": local.ip, "podIPs": [{"ip": local.ip}], "hostIP": local.host_ip,
            "hostIPs": [{"ip": local.host_ip}], "startTime": local.containers[0].started if local.containers else t,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": t},
                {"type": "Initialized", "status": "True", "lastTransitionTime": t},
                {"type": "ContainersReady", "status": status, "lastTransitionTime": t},
                {"type": "Ready", "status": status, "lastTransitionTime": t},
            ],
            "containerStatuses": [self._container_status(r) for r in local.containers],
        })
        local.reported = key
        local.api_ready = ready

    def _patch(self, local: LocalPod, status: dict) -> None:
        try:
            self.api.patch_namespaced_pod_status(local.name, local.namespace, {"status": status})
        except ApiException as e:
            if e.status != 404:
                log.warning("status of %s/%s: %s", local.namespace, local.name, e.reason)

    # ------------------------------------------------------------- teardown
    def terminate(self, local: LocalPod, grace: float) -> None:
        procs = [r.proc for r in local.containers if r.proc is not None and r.proc.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for r in local.containers:
            self.limits.release(r.groups)
        log.info("stopped %s/%s (%s)", local.namespace, local.name,
                 ", ".join(f"{r.launch.name}={r.proc.returncode if r.proc else None}" for r in local.containers))
        self._finalize_delete(local.namespace, local.name, local.uid)
        self.pods.pop(local.uid, None)
        self.ips.give(local.ip)

    def _finalize_delete(self, ns: str, name: str, uid: str) -> None:
        try:
            self.api.delete_namespaced_pod(name, ns, grace_period_seconds=0,
                                           body=client.V1DeleteOptions(grace_period_seconds=0,
                                                                       preconditions=client.V1Preconditions(uid=uid)))
        except ApiException as e:
            if e.status not in (404, 409):
                log.warning("final delete of %s/%s: %s", ns, name, e.reason)

    def stop_all(self) -> None:
        threads = []
        for local in list(self.pods.values()):
            if not local.terminating:
                local.terminating = True
                th = threading.Thread(target=self.terminate, args=(local, 5), daemon=True)
                th.start()
                threads.append(th)
        for th in threads:
            th.join(timeout=10)

    def run(self, ready_file: Path | None = None) -> None:
        threading.Thread(target=self.watch_pods, daemon=True).start()
        if ready_file:
            ready_file.touch()
        next_tick = 0.0
        while not self.stopping.is_set():
            try:
                pod = self.events.get(timeout=0.2)
                self.handle(pod)
            except queue.Empty:
                pass
            except Exception:
                log.exception("handling a pod event failed")
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + 0.2
                try:
                    self.tick()
                except Exception:
                    log.exception("tick failed")
        self.stop_all()
        self.limits.close()


def _ready_condition(obj: dict) -> bool | None:
    """The Ready condition of a pod or a node, as the API serialises it; None when it has none."""
    for c in (obj.get("status") or {}).get("conditions") or ():
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--image-prefix", default="tokenfleet/serving")
    ap.add_argument("--cidr", default="127.2.0.0/16")
    ap.add_argument("--log-dir", default="pods")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config.load_kube_config(args.kubeconfig)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    cpu = CpuLimiter(f"tokenfleet-pod-runner-{os.getpid()}")
    cpu.remove_stale("tokenfleet-pod-runner-")
    if cpu.available:
        log.info("CPU limits enforced in %s", cpu.base)
    memory = MemoryLimiter(f"tokenfleet-pod-runner-{os.getpid()}")
    memory.remove_stale("tokenfleet-pod-runner-")
    if memory.available:
        log.info("memory limits enforced in %s", memory.base)
    runner = PodRunner(client.CoreV1Api(), args.image_prefix, args.cidr, log_dir,
                       limits=ContainerLimits(cpu, memory))
    signal.signal(signal.SIGTERM, lambda *_: runner.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: runner.stopping.set())
    runner.run(ready_file=log_dir.parent / "pod-runner.ready")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
