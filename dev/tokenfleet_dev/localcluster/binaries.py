"""Where the control plane's binaries are, and building them when missing.

The binaries are built from Go modules by ``hack/build-kube-bins.sh`` into an
ignored cache folder (``.cache/bin/<kubernetes version>``); that script is a
no-op when the cache already matches the pinned versions.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-kube-bins.sh"
NAMES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok")


def _pinned_version() -> str:
    gomod = REPO_ROOT / "hack" / "kube-bins" / "go.mod"
    for line in gomod.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "k8s.io/kubernetes":
            return parts[1]
    raise RuntimeError(f"{gomod}: no k8s.io/kubernetes requirement")


def bin_dir() -> Path:
    env = os.environ.get("TOKENFLEET_BIN_DIR")
    if env:
        return Path(env)
    return REPO_ROOT / ".cache" / "bin" / _pinned_version()


def ensure_built(quiet: bool = False) -> Path:
    """Return the binary folder, building (minutes, once) if anything is missing."""
    d = bin_dir()
    if all((d / n).exists() for n in NAMES) and (d / ".stamp").exists():
        return d
    if not BUILD_SCRIPT.exists():
        raise RuntimeError(f"control-plane binaries missing in {d} and no {BUILD_SCRIPT} to build them; "
                           "set TOKENFLEET_BIN_DIR to a folder holding " + ", ".join(NAMES))
    subprocess.run(["bash", str(BUILD_SCRIPT)], check=True,
                   stdout=subprocess.DEVNULL if quiet else None,
                   env={**os.environ, "TOKENFLEET_BIN_DIR": str(d)})
    return d


def binary(name: str) -> str:
    return str(bin_dir() / name)


NODE_BUILD_SCRIPT = REPO_ROOT / "hack" / "build-node-bins.sh"


def node_bin_dir() -> Path:
    """The real node's kubelet (``hack/build-node-bins.sh``): .cache/bin/<kubernetes version>-node."""
    env = os.environ.get("TOKENFLEET_NODE_BIN_DIR")
    if env:
        return Path(env)
    return REPO_ROOT / ".cache" / "bin" / f"{_pinned_version()}-node"


def ensure_node_built(quiet: bool = False) -> Path:
    """Return the kubelet's folder, building it (about a minute with a warm Go cache) if missing."""
    d = node_bin_dir()
    if (d / "kubelet").exists() and (d / ".stamp").exists():
        return d
    subprocess.run(["bash", str(NODE_BUILD_SCRIPT)], check=True, stdout=subprocess.DEVNULL if quiet else None,
                   env={**os.environ, "TOKENFLEET_NODE_BIN_DIR": str(d)})
    return d
