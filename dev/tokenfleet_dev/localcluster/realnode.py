"""A real node for the local plane: the kubelet, containerd, runc and CNI plugins in a network namespace.

KWOK nodes only pretend; this one runs containers from real images. The plane creates a network namespace
for the node and runs containerd and the kubelet inside it (``setns`` on the network namespace only, so they
see the host's cgroups and mounts). Pods get addresses from ``POD_CIDR`` on a bridge in that namespace:
ordinary private addresses, which Services and EndpointSlices accept, where the local pod runner's loopback
ones are refused. The host's own network is left untouched: no interface, route or iptables rule is added
outside the namespace.

The control plane listens on the host's loopback only, so a forwarder (``netns_forward``) gives the
namespace the ``kubernetes`` Service address (``SERVICE_IP:443``), served by the API server: the kubelet
and every pod (through in-cluster config) reach the API server there, as in a real cluster.

What runs where:

- containerd (Debian's) with the CRI plugin, runc, the overlayfs snapshotter, a sandbox ("pause") image
  made of Debian's static ``catatonit`` (no registry), and a base OCI spec without ``process.rlimits``:
  raising a hard limit fails on this machine kind even for root, so containers inherit the node's limits;
- the kubelet (built from the pinned Kubernetes module by ``hack/build-node-bins.sh``) with a client
  certificate for ``system:node:NAME`` (Node authorizer, NodeRestriction), the cgroupfs driver under its own
  cgroup root, and short lease/status periods to match the controller-manager's 10 s grace;
- CNI: the ``bridge`` and ``host-local`` plugins of Debian's containernetworking-plugins.

This module holds the pure parts (names, configuration files, the pause image) and the shell that starts
and stops them; ``plane.py`` calls it.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from .pki import KUBERNETES_SERVICE_IP

NODE_LABEL = "tokenfleet.dev/node-kind"
NODE_KIND = "kubelet"
POD_CIDR = "10.244.0.0/24"
GATEWAY = "10.244.0.1"             # the bridge's address in the namespace, and the node's InternalIP
SERVICE_IP = KUBERNETES_SERVICE_IP  # the `kubernetes` Service: first address of --service-cluster-ip-range
BRIDGE = "tf0"
PAUSE_IMAGE = "localhost/tokenfleet/pause:catatonit"
CATATONIT = Path("/usr/bin/catatonit")
CNI_BIN_DIR = Path("/usr/lib/cni")
K8S_NAMESPACE = "k8s.io"            # containerd namespace of the CRI plugin


class NodeError(RuntimeError):
    pass


@dataclass(frozen=True)
class NodeLayout:
    """Where one real node keeps its state. Names that the whole host shares (the network namespace, the
    runtime folder, the cgroup root) carry a short hash of the plane's folder, so two planes never collide."""

    plane_dir: Path
    name: str = "kubelet-0"

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.plane_dir}/{self.name}".encode()).hexdigest()[:10]

    @property
    def netns(self) -> str:
        return f"tokenfleet-{self.key}"

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / self.netns

    @property
    def run_dir(self) -> Path:
        """containerd's state and socket: a short path (a unix socket path has at most 107 bytes)."""
        return Path(f"/run/tokenfleet-node-{self.key}")

    @property
    def socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def cgroup_root(self) -> str:
        return f"/tokenfleet-{self.key}"

    @property
    def dir(self) -> Path:
        return self.plane_dir / "nodes" / self.name

    @property
    def containerd_root(self) -> Path:
        return self.dir / "containerd"

    @property
    def kubelet_dir(self) -> Path:
        return self.dir / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.dir / "pod-logs"

    @property
    def cni_conf_dir(self) -> Path:
        return self.dir / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.dir / "cni" / "ipam"


# ----------------------------------------------------------------- pure configuration

def containerd_config(layout: NodeLayout, base_spec: Path) -> str:
    """containerd 1.6's configuration (version 2 TOML)."""
    return f"""version = 2
root = "{layout.containerd_root}"
state = "{layout.run_dir / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{layout.socket}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  enable_selinux = false
  disable_apparmor = true
  # Lowering a process's oom_score_adj is refused here ("permission denied" even for root): never ask
  # for less than containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      base_runtime_spec = "{base_spec}"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{layout.cni_conf_dir}"
"""


def base_runtime_spec(default_spec: dict) -> dict:
    """containerd's default OCI spec without ``process.rlimits``: containerd 1.x asks for RLIMIT_NOFILE
    1024 in every container; with none, containers inherit the node's limits, as podman's do here."""
    spec = json.loads(json.dumps(default_spec))
    spec.get("process", {}).pop("rlimits", None)
    return spec


def cni_config(layout: NodeLayout) -> dict:
    return {
        "cniVersion": "0.4.0",
        "name": "tokenfleet",
        "plugins": [{
            "type": "bridge", "bridge": BRIDGE, "isGateway": True, "isDefaultGateway": True,
            "ipMasq": False, "hairpinMode": True,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR, "gateway": GATEWAY}]],
                     "dataDir": str(layout.cni_ipam_dir)},
        }],
    }


def kubelet_config(layout: NodeLayout, ca_crt: Path) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(ca_crt)}},
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{layout.socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": layout.cgroup_root,
        # This machine kind mounts cgroup v1 controllers (plus an empty-of-use cgroup2 mount).
        "failCgroupV1": False,
        "failSwapOn": False,
        "address": GATEWAY,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "podLogsDir": str(layout.pod_logs),
        "resolvConf": "/etc/resolv.conf",
        "clusterDomain": "cluster.local",
        "maxPods": 32,
        "serializeImagePulls": False,
        # Images are loaded, never pulled: keep them (100 % switches image garbage collection off).
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        # The controller-manager marks a node unknown after 10 s without a lease renewal.
        "nodeLeaseDurationSeconds": 8,
        "nodeStatusUpdateFrequency": "4s",
        "nodeStatusReportFrequency": "10s",
        "makeIPTablesUtilChains": False,
        "protectKernelDefaults": False,
    }


def kubelet_kubeconfig(ca_crt: Path, crt: Path, key: Path) -> dict:
    return {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": f"https://{SERVICE_IP}:443",
                                                   "certificate-authority": str(ca_crt)}}],
        "users": [{"name": "kubelet", "user": {"client-certificate": str(crt), "client-key": str(key)}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "kubelet"}}],
        "current-context": "local",
    }


def pause_image_archive(binary: bytes, ref: str = PAUSE_IMAGE) -> bytes:
    """A docker-archive (what ``ctr images import`` reads) of the sandbox image: one static init
    (catatonit) in pause mode, run as nobody. Built here because no registry is reachable."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pause")
        info.size, info.mode, info.mtime = len(binary), 0o755, 0
        tar.addfile(info, io.BytesIO(binary))
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": ["/pause", "-P"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "tokenfleet: catatonit -P as the sandbox process"}],
    }, sort_keys=True).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    layer_name = diff_id.split(":")[1] + "/layer.tar"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [ref], "Layers": [layer_name]}]).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in ((config_name, config), (layer_name, layer_bytes), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


# ----------------------------------------------------------------------------- shell

def _run(*cmd: str, input: bytes | None = None, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), input=input, capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.decode(errors='replace').strip()}")
    return proc


def missing_prerequisites(kubelet: Path) -> list[str]:
    """What this machine lacks to run a real node (empty: nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces, mounts and cgroups)")
    for tool in ("containerd", "ctr", "runc", "ip"):
        if shutil.which(tool) is None:
            missing.append(f"{tool} (bash hack/setup.sh installs it)")
    for path in (CNI_BIN_DIR / "bridge", CNI_BIN_DIR / "host-local", CNI_BIN_DIR / "loopback", CATATONIT):
        if not path.exists():
            missing.append(f"{path} (bash hack/setup.sh installs it)")
    if not kubelet.exists():
        missing.append(f"{kubelet} (bash hack/build-node-bins.sh builds it)")
    return missing


def ctr(layout: NodeLayout, *args: str, input: bytes | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return _run("ctr", "--address", str(layout.socket), "--namespace", K8S_NAMESPACE, *args, input=input,
                timeout=timeout)


def create_network(layout: NodeLayout) -> None:
    """The node's network namespace: loopback, the Service address and the pod bridge (the node's address)."""
    if layout.netns_path.exists():
        delete_network(layout)
    _run("ip", "netns", "add", layout.netns)
    ns = ("ip", "-n", layout.netns)
    _run(*ns, "link", "set", "lo", "up")
    _run(*ns, "addr", "add", f"{SERVICE_IP}/32", "dev", "lo")
    _run(*ns, "link", "add", BRIDGE, "type", "bridge")
    _run(*ns, "addr", "add", f"{GATEWAY}/{POD_CIDR.split('/')[1]}", "dev", BRIDGE)
    _run(*ns, "link", "set", BRIDGE, "up")


def delete_network(layout: NodeLayout) -> None:
    if layout.netns_path.exists():
        _run("ip", "netns", "del", layout.netns, check=False)


def _cgroup_dirs(layout: NodeLayout) -> list[Path]:
    base = Path("/sys/fs/cgroup")
    dirs = []
    for ctl in sorted(base.iterdir()) if base.exists() else []:
        if (ctl / "cgroup.procs").exists():
            dirs.append(ctl / layout.cgroup_root.lstrip("/"))
    return dirs


def create_cgroup_root(layout: NodeLayout) -> None:
    """The kubelet's --cgroup-root, in every mounted hierarchy (the kubelet refuses a missing one). A new
    cpuset cgroup starts with no CPUs or memory nodes: copy the parent's."""
    for d in _cgroup_dirs(layout):
        d.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (d / name).exists() and not (d / name).read_text().strip():
                (d / name).write_text((d.parent / name).read_text())


def delete_cgroup_root(layout: NodeLayout) -> None:
    for d in _cgroup_dirs(layout):
        if not d.exists():
            continue
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            d.rmdir()


def _mounts_under(paths: list[Path]) -> list[str]:
    prefixes = [str(p.resolve()) for p in paths]
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if any(point == p or point.startswith(p + "/") for p in prefixes):
                found.append(point)
    return sorted(set(found), key=lambda p: -len(p))


def unmount_under(paths: list[Path]) -> list[str]:
    """Detach every mount below ``paths`` (deepest first): what a killed kubelet or shim left behind."""
    points = _mounts_under(paths)
    for point in points:
        subprocess.run(["umount", "-l", point], capture_output=True)
    return points


def leftover_shims(layout: NodeLayout) -> list[int]:
    """containerd shims started for this node's containerd (they outlive it by design)."""
    pids = []
    needle = str(layout.socket).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in cmdline and needle in cmdline:
            pids.append(int(proc.name))
    return pids


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(c) for c in (task / "children").read_text().split()]
    return kids


def kill_tree(pid: int) -> None:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    for p in reversed(seen):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def write_files(layout: NodeLayout, pki, node_crt: Path, node_key: Path) -> dict[str, Path]:
    """Every file containerd and the kubelet read; returns their paths by role."""
    for d in (layout.dir, layout.kubelet_dir, layout.pod_logs, layout.cni_conf_dir, layout.run_dir):
        d.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(layout.cni_ipam_dir, ignore_errors=True)     # no leases from an earlier run
    default = json.loads(_run("ctr", "oci", "spec").stdout)
    files = {
        "base_spec": layout.dir / "base-runtime-spec.json",
        "containerd": layout.dir / "containerd.toml",
        "cni": layout.cni_conf_dir / "10-tokenfleet.conflist",
        "kubelet_config": layout.dir / "kubelet-config.yaml",
        "kubeconfig": layout.dir / "kubelet.kubeconfig",
    }
    files["base_spec"].write_text(json.dumps(base_runtime_spec(default), indent=2))
    files["containerd"].write_text(containerd_config(layout, files["base_spec"]))
    files["cni"].write_text(json.dumps(cni_config(layout), indent=2))
    files["kubelet_config"].write_text(yaml.safe_dump(kubelet_config(layout, pki.ca_crt), sort_keys=False))
    files["kubeconfig"].write_text(yaml.safe_dump(kubelet_kubeconfig(pki.ca_crt, node_crt, node_key), sort_keys=False))
    return files


def kubelet_command(kubelet: Path, layout: NodeLayout, files: dict[str, Path], labels: dict[str, str]) -> list[str]:
    return [str(kubelet), f"--config={files['kubelet_config']}", f"--kubeconfig={files['kubeconfig']}",
            f"--root-dir={layout.kubelet_dir}", f"--cert-dir={layout.kubelet_dir / 'pki'}",
            f"--hostname-override={layout.name}", f"--node-ip={GATEWAY}",
            "--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())), "--v=1"]


def wait_for(check, timeout: float, what: str, alive=None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise NodeError(f"{what}: the process exited")
        try:
            if check():
                return
        except Exception as e:       # not there yet
            last = e
        time.sleep(0.3)
    raise NodeError(f"{what}: not ready after {timeout:.0f}s ({last})")


def import_pause_image(layout: NodeLayout) -> None:
    ctr(layout, "images", "import", "-", input=pause_image_archive(CATATONIT.read_bytes()))


def images(layout: NodeLayout) -> set[str]:
    return set(ctr(layout, "images", "list", "--quiet").stdout.decode().split())
