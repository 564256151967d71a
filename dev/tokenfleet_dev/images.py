"""tokenfleet's container images on this machine: building them, running podman, loading them into a node.

The images are built by ``hack/build-images.sh`` into tokenfleet's own podman store (``hack/podman.sh``:
.cache/containers) as ``tokenfleet/operator:VERSION`` and ``tokenfleet/serving:VERSION``, the tags
``manifests/base`` and the InferenceService default expect. A pod's ``tokenfleet/serving:0.1.0`` means
``docker.io/tokenfleet/serving:0.1.0`` to a container runtime, so that is the name they are loaded under.
"""
from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

from .localcluster import realnode
from .localcluster.binaries import REPO_ROOT

PODMAN = REPO_ROOT / "hack" / "podman.sh"
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-images.sh"
NAMES = ("operator", "serving")


class ImageError(RuntimeError):
    pass


def version() -> str:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


def ref(name: str) -> str:
    """The reference manifests use: tokenfleet/NAME:VERSION."""
    return f"tokenfleet/{name}:{version()}"


def runtime_ref(name: str) -> str:
    """What a container runtime resolves ``ref(name)`` to."""
    return f"docker.io/{ref(name)}"


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(PODMAN), *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ImageError(f"podman {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
    return proc


def image_id(name: str) -> str | None:
    out = podman("image", "inspect", "--format", "{{.Id}}", f"localhost/{ref(name)}", check=False)
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def build(names: tuple[str, ...] = NAMES, log: Path | None = None) -> None:
    """Run hack/build-images.sh for ``names``: layers are cached, so this rebuilds only what changed
    since the last build (and nothing when nothing did)."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        proc = subprocess.run(["bash", str(BUILD_SCRIPT), *names], stdout=out, stderr=subprocess.STDOUT,
                              cwd=REPO_ROOT, timeout=3600)
    finally:
        if log:
            out.close()
    if proc.returncode != 0:
        raise ImageError(f"hack/build-images.sh {' '.join(names)} failed ({proc.returncode})"
                         + (f"; see {log}" if log else ""))


def load_into_node(layout: realnode.NodeLayout, names: tuple[str, ...] = NAMES) -> list[str]:
    """Import the built images into a real node's containerd (``podman save | ctr images import``),
    skipping those already there at the same image id. Returns the names imported."""
    stamp_file = layout.dir / "images.json"
    try:
        stamps = json.loads(stamp_file.read_text())
    except (OSError, ValueError):
        stamps = {}
    present = realnode.images(layout)
    imported = []
    for name in names:
        iid = image_id(name)
        if iid is None:
            raise ImageError(f"{ref(name)} is not built (bash hack/build-images.sh)")
        target = runtime_ref(name)
        if stamps.get(target) == iid and target in present:
            continue
        save = subprocess.Popen(["bash", str(PODMAN), "save", "--format", "docker-archive", target],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        load = subprocess.run(["ctr", "--address", str(layout.socket), "--namespace", realnode.K8S_NAMESPACE,
                               "images", "import", "-"],
                              stdin=save.stdout, capture_output=True, timeout=1800)
        save.stdout.close()
        err = save.stderr.read().decode(errors="replace")
        if save.wait() != 0 or load.returncode != 0:
            raise ImageError(f"loading {target} into {layout.name} failed: {err.strip()[-2000:]} "
                             f"{load.stderr.decode(errors='replace').strip()[-2000:]}")
        stamps[target] = iid
        stamp_file.write_text(json.dumps(stamps, indent=2))
        imported.append(name)
    return imported
