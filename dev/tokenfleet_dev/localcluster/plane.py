"""A real Kubernetes control plane as local processes.

``LocalCluster(dir).up()`` starts etcd, kube-apiserver (RBAC, ServiceAccount
tokens, PodSecurity admission), kube-controller-manager, kube-scheduler, KWOK
and tokenfleet's local pod runner on free loopback ports, waits until each is
healthy, and writes ``<dir>/admin.kubeconfig``. With ``real_node=True`` it
also starts a real node (kubelet, containerd, CNI) in a network namespace of
its own (``realnode.py``). Every process is recorded in
``<dir>/state.json`` by pid so that ``down()`` — from this process or another
one — stops exactly what was started and nothing else.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import binaries, kwok_stages, realnode
from .nodes import NOT_READY_LABEL, NodePool, node_manifests
from .pki import SERVICE_CIDR, Pki, create_pki, node_client_certificate

# Pods' not-ready/unreachable tolerations (normally 300 s) and the node
# monitor grace period are shortened so node-failure tests take seconds.
TOLERATION_SECONDS = 5
NODE_MONITOR_GRACE = "10s"
NODE_LEASE_SECONDS = 8
KWOK_POD_CIDR = "127.1.0.0/16"
RUNNER_POD_CIDR = "127.2.0.0/16"


def runner_pod_cidr() -> str:
    """A /24 of RUNNER_POD_CIDR chosen at random for one plane: planes that run on one host at once (several
    test sessions) then do not hand out the same pod addresses, whose ports their pods would fight over."""
    import random
    return f"127.2.{random.randint(1, 254)}.0/24"
SERVING_IMAGE_PREFIX = "tokenfleet/serving"
# Controllers the plane does not run.
DISABLED_CONTROLLERS = (
    "bootstrapsigner", "tokencleaner", "cloud-node-lifecycle", "service-lb-controller", "node-route-controller",
    "persistentvolume-binder", "persistentvolume-expander", "persistentvolume-attach-detach-controller",
)
# Without a real node, neither: they would write every pod's IP into Endpoints and EndpointSlices, which the
# API server rejects for loopback addresses (127.0.0.0/8), so each Service change would leave a
# FailedToUpdateEndpoint(Slices) Warning and nothing else (no kube-proxy uses them; clients reach pods by their
# IPs). A real node's pods have addresses of their own network (10.244.0.0/24), whose Services get endpoints.
ENDPOINTS_CONTROLLERS = ("endpoints-controller", "endpointslice-controller", "endpointslice-mirroring-controller")


class PlaneError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGTERM the child when its parent dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@dataclass
class LocalCluster:
    dir: Path
    pools: list[NodePool] = field(default_factory=list)
    tie_to_parent: bool = False   # for test fixtures: children die with the test process
    log: callable = print
    # Users whose requests the API server writes to <dir>/logs/audit.log (JSON lines, level
    # Metadata, one line per finished request); None: no audit log.
    audit_users: list[str] | None = None
    real_node: bool = False       # also run a real kubelet node (realnode.py) beside the KWOK nodes
    # How long a node may miss its heartbeat before the node controller marks it NotReady (and evicts its pods).
    # Short for the tests of failure handling; a benchmark that loads the plane's two cores may take
    # Kubernetes' default instead, so that lagging KWOK heartbeats are not taken for dead nodes.
    node_monitor_grace: str = NODE_MONITOR_GRACE
    # KWOK's node Leases last this long and are renewed every quarter of it: 136 nodes at 8 s make 68 Lease
    # writes a second, more than a 1,000-service benchmark's operator makes; the kubelet's default is 40 s.
    node_lease_seconds: int = NODE_LEASE_SECONDS

    def __post_init__(self):
        self.dir = Path(self.dir).resolve()

    # ------------------------------------------------------------------ paths
    @property
    def kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    def state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {"processes": {}}

    def _save(self, state: dict) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    # ------------------------------------------------------------- processes
    def _start(self, state: dict, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        logs = self.dir / "logs"
        logs.mkdir(exist_ok=True)
        out = open(logs / f"{name}.log", "ab")
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.dir,
            start_new_session=True, env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent if self.tie_to_parent else None)
        out.close()
        state["processes"][name] = {"pid": proc.pid, "log": str(logs / f"{name}.log"), "cmd": cmd}
        self._save(state)
        return proc

    def _wait(self, name: str, proc: subprocess.Popen, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise PlaneError(f"{name} exited with {proc.returncode}:\n{self._tail(name)}")
            try:
                if check():
                    return
            except Exception as e:  # not up yet
                last = e
            time.sleep(0.3)
        raise PlaneError(f"{name} not healthy after {timeout:.0f}s ({last}):\n{self._tail(name)}")

    def _tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join((self.dir / "logs" / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # ----------------------------------------------------------------- health
    @staticmethod
    def _get(url: str, ctx: ssl.SSLContext | None = None) -> tuple[int, str]:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
            return r.status, r.read().decode()

    def _admin_ctx(self, pki: Pki) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(pki.ca_crt))
        ctx.load_cert_chain(str(pki.admin_crt), str(pki.admin_key))
        return ctx

    @staticmethod
    def _insecure_ctx() -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    # --------------------------------------------------------------------- up
    def up(self) -> LocalCluster:
        if any(pid_alive(p["pid"]) for p in self.state()["processes"].values()):
            raise PlaneError(f"a control plane is already running in {self.dir}; run 'tokenfleet cluster down --dir {self.dir}' first")
        t0 = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        stale = self.state().get("real_node")
        if stale:       # a node of an earlier run that was killed rather than stopped
            self._clean_real_node(realnode.NodeLayout(self.dir, stale["name"]))
        # A fresh plane every time: no objects or pod folders from an earlier run.
        for stale in (self.dir / "etcd", self.dir / "logs"):
            shutil.rmtree(stale, ignore_errors=True)
        bins = binaries.ensure_built()
        b = lambda n: str(bins / n)  # noqa: E731
        pki = create_pki(self.dir / "pki")
        ports = {k: free_port() for k in ("etcd", "etcd_peer", "apiserver", "kcm", "scheduler", "kwok")}
        state = {"processes": {}, "ports": ports, "kubeconfig": str(self.kubeconfig), "bin_dir": str(bins)}
        self._save(state)
        try:
            self._up(state, b, pki, ports)
        except BaseException:
            self.down()
            raise
        self.log(f"control plane ready in {time.monotonic() - t0:.1f}s: {self.kubeconfig}")
        return self

    @property
    def audit_log(self) -> Path:
        return self.dir / "logs" / "audit.log"

    def _audit_args(self) -> list[str]:
        if self.audit_users is None:
            return []
        policy = {
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
            "omitStages": ["RequestReceived", "ResponseStarted"],
            "rules": [{"level": "Metadata", "users": list(self.audit_users)}, {"level": "None"}],
        }
        path = self.dir / "audit-policy.yaml"
        path.write_text(yaml.safe_dump(policy, sort_keys=False))
        return [f"--audit-policy-file={path}", f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
                "--audit-log-mode=blocking", "--audit-log-maxsize=0"]

    def _up(self, state: dict, b, pki: Pki, ports: dict) -> None:
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd_peer']}"
        data = self.dir / "etcd"
        proc = self._start(state, "etcd", [
            b("etcd"), "--name=local", f"--data-dir={data}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=local={peer_url}", "--unsafe-no-fsync=true", "--log-level=warn",
            "--quota-backend-bytes=4294967296"])
        self._wait("etcd", proc, lambda: '"health":"true"' in self._get(f"{etcd_url}/health")[1], 60)
        self.log(f"etcd up on {etcd_url}")

        api = f"https://127.0.0.1:{ports['apiserver']}"
        proc = self._start(state, "kube-apiserver", [
            b("kube-apiserver"), f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", f"--secure-port={ports['apiserver']}",
            "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
            f"--tls-cert-file={pki.apiserver_crt}", f"--tls-private-key-file={pki.apiserver_key}",
            f"--client-ca-file={pki.ca_crt}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            # PodNodeSelector: a namespace's scheduler.alpha.kubernetes.io/node-selector annotation pins its
            # pods to nodes (how the demo keeps a namespace on the real node).
            "--enable-admission-plugins=NodeRestriction,PodNodeSelector",
            "--allow-privileged=true",
            f"--default-not-ready-toleration-seconds={TOLERATION_SECONDS}",
            f"--default-unreachable-toleration-seconds={TOLERATION_SECONDS}",
            f"--cert-dir={self.dir / 'pki'}",
            "--profiling=" + os.environ.get("TOKENFLEET_PLANE_PROFILING", "false"), "--v=1", *self._audit_args()])
        ctx = self._admin_ctx(pki)
        self._wait("kube-apiserver", proc, lambda: self._get(f"{api}/readyz", ctx)[1] == "ok", 180)
        self.log(f"kube-apiserver up on {api}")
        self._write_kubeconfig(self.kubeconfig, api, pki, {"client-certificate": str(pki.admin_crt),
                                                           "client-key": str(pki.admin_key)})
        kc = str(self.kubeconfig)
        insecure = self._insecure_ctx()
        common = [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                  "--bind-address=127.0.0.1", "--leader-elect=false",
                  "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics"]
        kcm = self._start(state, "kube-controller-manager", [
            b("kube-controller-manager"), *common, f"--secure-port={ports['kcm']}",
            f"--root-ca-file={pki.ca_crt}", f"--service-account-private-key-file={pki.sa_key}",
            "--use-service-account-credentials=false",
            "--node-monitor-period=1s", f"--node-monitor-grace-period={self.node_monitor_grace}",
            "--kube-api-qps=200", "--kube-api-burst=400", "--concurrent-gc-syncs=5",
            "--controllers=" + ",".join(["*", *(f"-{c}" for c in DISABLED_CONTROLLERS
                                                + (() if self.real_node else ENDPOINTS_CONTROLLERS))]),
            "--v=1"])
        sched = self._start(state, "kube-scheduler", [
            b("kube-scheduler"), *common, f"--secure-port={ports['scheduler']}",
            "--kube-api-qps=200", "--kube-api-burst=400", "--v=1"])
        stages = kwok_stages.write(self.dir / "kwok-stages.yaml", Path(state["bin_dir"]) / "kwok-stages",
                                   SERVING_IMAGE_PREFIX)
        kwok = self._start(state, "kwok", [
            b("kwok"), f"--kubeconfig={kc}", f"--config={stages}",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--node-ip=127.0.0.1", f"--cidr={KWOK_POD_CIDR}", f"--node-lease-duration-seconds={self.node_lease_seconds}",
            f"--server-address=127.0.0.1:{ports['kwok']}"])
        (self.dir / "logs" / "pod-runner.ready").unlink(missing_ok=True)
        runner = self._start(state, "pod-runner", [
            sys.executable, "-m", "tokenfleet_dev.localcluster.podrunner", f"--kubeconfig={kc}",
            f"--image-prefix={SERVING_IMAGE_PREFIX}", f"--cidr={runner_pod_cidr()}",
            f"--log-dir={self.dir / 'logs' / 'pods'}"])
        self._wait("kube-controller-manager", kcm,
                   lambda: self._get(f"https://127.0.0.1:{ports['kcm']}/healthz", insecure)[1] == "ok", 120)
        self._wait("kube-scheduler", sched,
                   lambda: self._get(f"https://127.0.0.1:{ports['scheduler']}/healthz", insecure)[1] == "ok", 120)
        self._wait("kwok", kwok, lambda: self._get(f"http://127.0.0.1:{ports['kwok']}/healthz")[0] == 200, 60)
        self._wait("pod-runner", runner, lambda: (self.dir / "logs" / "pod-runner.ready").exists(), 60)
        self.log("controller-manager, scheduler, kwok and pod runner up")
        if self.pools:
            self.add_nodes(self.pools)
        if self.real_node:
            self._start_real_node(state, pki, ports)

    # -------------------------------------------------------------- real node
    def _start_real_node(self, state: dict, pki: Pki, ports: dict) -> None:
        t0 = time.monotonic()
        layout = realnode.NodeLayout(self.dir)
        kubelet = binaries.ensure_node_built() / "kubelet"
        missing = realnode.missing_prerequisites(kubelet)
        if missing:
            raise PlaneError("a real node needs: " + "; ".join(missing))
        state["real_node"] = {"name": layout.name, "netns": layout.netns, "dir": str(layout.dir),
                              "run_dir": str(layout.run_dir), "cgroup_root": layout.cgroup_root}
        self._save(state)
        realnode.create_network(layout)
        realnode.create_cgroup_root(layout)
        ready = self.dir / "logs" / "node-apiserver-forward.ready"
        ready.unlink(missing_ok=True)
        fwd = self._start(state, "node-apiserver-forward", [
            sys.executable, "-m", "tokenfleet_dev.localcluster.netns_forward", f"--ready-file={ready}",
            f"{layout.netns_path}@{realnode.SERVICE_IP}:443=127.0.0.1:{ports['apiserver']}"])
        self._wait("node-apiserver-forward", fwd, ready.exists, 30)
        crt, key = layout.dir / "kubelet-client.crt", layout.dir / "kubelet-client.key"
        layout.dir.mkdir(parents=True, exist_ok=True)
        node_client_certificate(pki, layout.name, crt, key)
        files = realnode.write_files(layout, pki, crt, key)
        in_ns = ["nsenter", f"--net={layout.netns_path}", "--"]
        ctrd = self._start(state, "containerd", [*in_ns, "containerd", f"--config={files['containerd']}"])
        self._wait("containerd", ctrd, lambda: realnode.ctr(layout, "version", timeout=5).returncode == 0, 60)
        realnode.import_pause_image(layout)
        labels = {realnode.NODE_LABEL: realnode.NODE_KIND}
        kl = self._start(state, "kubelet", [*in_ns, *realnode.kubelet_command(kubelet, layout, files, labels)])
        self._wait("kubelet", kl, lambda: layout.name in self.ready_nodes(), 120)
        took = time.monotonic() - t0
        state = self.state()
        state["real_node"]["startup_seconds"] = round(took, 2)
        self._save(state)
        self.log(f"real node {layout.name} Ready in {took:.1f}s (kubelet + containerd in netns {layout.netns}, "
                 f"pods on {realnode.POD_CIDR})")

    def node_layout(self) -> realnode.NodeLayout:
        info = self.state().get("real_node")
        if not info:
            raise PlaneError(f"the plane in {self.dir} has no real node (cluster up --real-node)")
        return realnode.NodeLayout(self.dir, info["name"])

    def expose(self, name: str, ip: str, port: int) -> int:
        """Forward a free loopback port of the host to ``ip:port`` in the real node's network (a pod's
        address); returns the port. The forwarder belongs to the plane: ``down`` stops it."""
        layout = self.node_layout()
        local = free_port()
        ready = self.dir / "logs" / f"forward-{name}.ready"
        ready.unlink(missing_ok=True)
        self.start_process(f"forward-{name}", [
            sys.executable, "-m", "tokenfleet_dev.localcluster.netns_forward", f"--ready-file={ready}",
            f"127.0.0.1:{local}={layout.netns_path}@{ip}:{port}"])
        deadline = time.monotonic() + 30
        while not ready.exists():
            if time.monotonic() > deadline:
                raise PlaneError(f"forward-{name} did not start:\n{self._tail(f'forward-{name}')}")
            time.sleep(0.1)
        return local

    def _drain_real_node(self, name: str, timeout: float = 60) -> None:
        """Cordon the node and delete its pods, so the kubelet stops their containers, tears down their
        networks and unmounts their volumes before it stops."""
        if self.kubectl("get", "node", name, check=False, timeout=10).returncode != 0:
            return
        self.kubectl("cordon", name, check=False, timeout=20)
        selector = f"spec.nodeName={name}"
        self.kubectl("delete", "pods", "-A", "--field-selector", selector, "--grace-period=10", "--wait=false",
                     check=False, timeout=30)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.kubectl("get", "pods", "-A", "--field-selector", selector, "-o", "name", check=False, timeout=10)
            if out.returncode != 0 or not out.stdout.strip():
                return
            time.sleep(0.5)
        self.log(f"pods still on {name} after {timeout:.0f}s; stopping the node anyway")

    @staticmethod
    def _clean_real_node(layout: realnode.NodeLayout) -> None:
        """What a stopped node may leave on the host: shims and their containers, mounts, the network
        namespace, the cgroup root, the runtime folder."""
        for pid in realnode.leftover_shims(layout):
            realnode.kill_tree(pid)
        realnode.unmount_under([layout.dir, layout.run_dir])
        realnode.delete_network(layout)
        realnode.delete_cgroup_root(layout)
        shutil.rmtree(layout.run_dir, ignore_errors=True)

    @staticmethod
    def _write_kubeconfig(path: Path, server: str, pki: Pki, user: dict) -> None:
        cfg = {
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "tokenfleet-local", "cluster": {"server": server,
                                                                  "certificate-authority": str(pki.ca_crt)}}],
            "users": [{"name": "user", "user": user}],
            "contexts": [{"name": "tokenfleet-local", "context": {"cluster": "tokenfleet-local", "user": "user"}}],
            "current-context": "tokenfleet-local",
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)

    def start_process(self, name: str, cmd: list[str], env: dict | None = None) -> int:
        """Start another process that belongs to this plane (e.g. the operator): 'down' stops it too."""
        state = self.state()
        if name in state["processes"] and pid_alive(state["processes"][name]["pid"]):
            raise PlaneError(f"{name} is already running (pid {state['processes'][name]['pid']})")
        return self._start(state, name, cmd, env).pid

    # ------------------------------------------------------------------ nodes
    def add_nodes(self, pools: list[NodePool], timeout: float = 120) -> list[str]:
        """Create the pools' nodes and wait until KWOK reports them Ready."""
        manifests, offset = [], self._node_count()
        for pool in pools:
            manifests += node_manifests(pool, first_index=offset + len(manifests))
        if not manifests:
            return []
        text = "\n---\n".join(yaml.safe_dump(m) for m in manifests)
        self.kubectl("apply", "--server-side", "-f", "-", input=text)
        names = [m["metadata"]["name"] for m in manifests]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = self.ready_nodes()
            if all(n in ready for n in names):
                self.log(f"{len(names)} KWOK nodes Ready")
                return names
            time.sleep(0.5)
        raise PlaneError(f"nodes not Ready after {timeout}s: {sorted(set(names) - self.ready_nodes())[:10]}")

    def fail_node(self, name: str, mode: str) -> None:
        """Simulate a node failure.

        ``not-ready``: the node reports Ready=False (KWOK chaos stage);
        ``lease-loss``: the node's Lease is taken from KWOK (another holder,
        one-hour duration), so nobody renews it and the node lifecycle
        controller marks the node Unknown after the grace period, as after
        a crash or a partition;
        ``delete``: the Node object disappears.
        """
        if mode == "not-ready":
            self.kubectl("label", "node", name, f"{NOT_READY_LABEL}=true", "--overwrite")
        elif mode == "lease-loss":
            self.kubectl("patch", "lease", name, "-n", "kube-node-lease", "--type=merge",
                         "-p", '{"spec":{"holderIdentity":"tokenfleet-chaos","leaseDurationSeconds":3600}}')
        elif mode == "delete":
            self.kubectl("delete", "node", name, "--wait=false")
        else:
            raise ValueError(f"mode must be not-ready, lease-loss or delete, got {mode!r}")

    def recover_node(self, name: str) -> None:
        """Undo ``fail_node(name, 'not-ready' | 'lease-loss')``."""
        self.kubectl("label", "node", name, f"{NOT_READY_LABEL}-")
        # An expired lease: KWOK takes it back and renews it again.
        self.kubectl("patch", "lease", name, "-n", "kube-node-lease", "--type=merge",
                     "-p", '{"spec":{"leaseDurationSeconds":1}}')

    def _node_count(self) -> int:
        out = self.kubectl("get", "nodes", "-o", "name", check=False).stdout
        return len(out.split())

    def ready_nodes(self) -> set[str]:
        out = self.kubectl("get", "nodes", "-o",
                           "jsonpath={range .items[*]}{.metadata.name}="
                           "{.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}").stdout
        return {line.split("=")[0] for line in out.split() if line.endswith("=True")}

    # ---------------------------------------------------------------- kubectl
    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                kubeconfig: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        kubectl = str(Path(self.state().get("bin_dir") or binaries.bin_dir()) / "kubectl")
        proc = subprocess.run([kubectl, f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
                              input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise PlaneError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sa_kubeconfig(self, namespace: str, service_account: str, duration_seconds: int = 3600) -> Path:
        """A kubeconfig for a ServiceAccount token (RBAC enforced), written in the plane's folder."""
        from .credentials import service_account_kubeconfig
        out = self.dir / f"sa-{namespace}-{service_account}.kubeconfig"
        return service_account_kubeconfig(self, namespace, service_account, out, duration_seconds)

    # ------------------------------------------------------------------- down
    def down(self, grace: float = 10) -> list[str]:
        """Stop every process recorded in state.json (pods of the runner first; a real node is drained
        first, then stopped, then cleaned)."""
        state = self.state()
        procs = state["processes"]
        node = state.get("real_node")
        if node and pid_alive(procs.get("kube-apiserver", {}).get("pid", 0)) and pid_alive(procs.get("kubelet", {}).get("pid", 0)):
            # The plane's own extra processes (an operator, forwarders) first, so nothing recreates pods.
            for extra in [p for n, p in procs.items() if n not in _ORDER]:
                _stop(extra["pid"], grace)
            self._drain_real_node(node["name"])
        order = _ORDER
        names = sorted(procs, key=lambda n: order.index(n) if n in order else -1)
        stopped = []
        for name in names:
            if _stop(procs[name]["pid"], grace):
                stopped.append(name)
        if node:
            self._clean_real_node(realnode.NodeLayout(self.dir, node["name"]))
        self._save({**self.state(), "processes": {}, "stopped": {n: procs[n]["pid"] for n in procs}})
        return stopped


_ORDER = ["pod-runner", "kwok", "kubelet", "containerd", "kube-scheduler", "kube-controller-manager",
          "node-apiserver-forward", "kube-apiserver", "etcd"]


def _stop(pid: int, grace: float) -> bool:
    """SIGTERM the process group, SIGKILL after ``grace``; False when it was not running."""
    if not pid_alive(pid):
        return False
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.1)
    if pid_alive(pid):
        _signal_group(pid, signal.SIGKILL)
        while pid_alive(pid):
            _reap(pid)
            time.sleep(0.05)
    # Anything else left in the process group (e.g. a pod's children).
    _signal_group(pid, signal.SIGKILL)
    return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass

