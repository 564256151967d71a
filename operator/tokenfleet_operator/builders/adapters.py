"""spec.adapters -> what the serving pods need to serve LoRA adapters (pure).

Two parts, split by what may change without a restart:

- **The pod template** (part of the Slice's revision: a change rolls the replicas): the engine flags
  ``--enable-lora --lora-modules-file FILE --lora-root NAME=DIR ...``, the ConfigMap volume the file comes
  from, and one read-only volume per distinct adapter *volume*: a PVC claim (the model's own claim is its
  ``model`` volume) or a hostPath ``path``. Adapters on a volume already mounted, and adapters given by
  ``path``, change none of it. Volumes are named by a hash of their source, so their names do not depend on
  the adapters' order.
- **The adapters ConfigMap** ``<service>-adapters`` (not in the revision): one entry per adapter, its
  directory as a volume name (``root``) plus a path inside it, or an absolute path. The kubelet refreshes a
  mounted ConfigMap within its sync period (about a minute; the local pod runner within 2 s); each replica
  polls the file every second (``tokenfleet_serving/server/lora_file.py``).

The file names volumes rather than mount paths: the pod template maps each volume to its directory with
``--lora-root``, which is where a pod runner that moves mounts (the local one) rewrites it.
"""
from __future__ import annotations

import hashlib
from typing import Any

from tokenfleet_operator.api.inference_service import AdapterSpec, InferenceServiceSpec
from tokenfleet_operator.naming import ROLE_LABEL, child_metadata
from tokenfleet_serving.contract.lora_adapters import ADAPTERS_KEY, AdapterEntry, adapters_json

ADAPTERS_FILE_MOUNT = "/etc/tokenfleet/adapters"
ADAPTERS_FILE_VOLUME = "adapters-file"
ADAPTER_VOLUMES_MOUNT = "/adapters"
MODEL_VOLUME = "model"          # builders/inference_service.py mounts the model's pvc or hostPath by this name
MODEL_MOUNT = "/models"


def adapters_configmap_name(service: str) -> str:
    return f"{service}-adapters"


def lora_enabled(spec: InferenceServiceSpec) -> bool:
    """LoRA is on while spec.adapters is set, even empty, so that removing the last adapter rolls nothing."""
    return spec.adapters is not None


def _volume_name(kind: str, key: str) -> str:
    return f"adapters-{kind}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _volume_of(spec: InferenceServiceSpec, adapter: AdapterSpec) -> tuple[str, dict[str, Any] | None] | None:
    """(volume name, volume or None when it is the model's) an adapter lies on; None for a ``path`` adapter."""
    model = spec.model
    if adapter.pvc is not None:
        claim = adapter.pvc.claim_name
        if model.pvc is not None and model.pvc.claim_name == claim:
            return MODEL_VOLUME, None
        return _volume_name("pvc", claim), {"persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    if adapter.host_path is not None:
        path = adapter.host_path.path.rstrip("/") or "/"
        if model.host_path is not None and model.host_path.path.rstrip("/") == path:
            return MODEL_VOLUME, None
        return _volume_name("host", path), {"hostPath": {"path": path, "type": "Directory"}}
    return None


def model_has_volume(spec: InferenceServiceSpec) -> bool:
    return spec.model.pvc is not None or spec.model.host_path is not None


def adapter_entry(spec: InferenceServiceSpec, adapter: AdapterSpec) -> AdapterEntry:
    """The adapters-file entry of one adapter: a volume and a path inside it, or an absolute path."""
    on = _volume_of(spec, adapter)
    if on is None:
        assert adapter.path is not None, "the schema requires exactly one source"
        path = adapter.path.rstrip("/")
        if model_has_volume(spec) and (path == MODEL_MOUNT or path.startswith(MODEL_MOUNT + "/")):
            return AdapterEntry(adapter.name, path[len(MODEL_MOUNT):].lstrip("/") or ".", MODEL_VOLUME, adapter.hot)
        return AdapterEntry(adapter.name, path, None, adapter.hot)
    name, _ = on
    sub = adapter.pvc.sub_path if adapter.pvc is not None else adapter.host_path.sub_path  # type: ignore[union-attr]
    return AdapterEntry(adapter.name, (sub or "").strip("/") or ".", name, adapter.hot)   # the volume's root


def adapter_volumes(service: str, spec: InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """(volumes, volumeMounts, --lora-root values) of the serving pods; all empty while LoRA is off."""
    if not lora_enabled(spec):
        return [], [], []
    file_source = {"name": adapters_configmap_name(service), "items": [{"key": ADAPTERS_KEY, "path": ADAPTERS_KEY}]}
    volumes: list[dict[str, Any]] = [{"name": ADAPTERS_FILE_VOLUME, "configMap": file_source}]
    mounts: list[dict[str, Any]] = [{"name": ADAPTERS_FILE_VOLUME, "mountPath": ADAPTERS_FILE_MOUNT, "readOnly": True}]
    roots: list[str] = [f"{MODEL_VOLUME}={MODEL_MOUNT}"] if model_has_volume(spec) else []
    seen: set[str] = set()
    for adapter in spec.adapters or []:
        on = _volume_of(spec, adapter)
        if on is None or on[1] is None or on[0] in seen:
            continue
        name, source = on
        assert source is not None
        seen.add(name)
        volumes.append({"name": name, **source})
        mount = f"{ADAPTER_VOLUMES_MOUNT}/{name}"
        mounts.append({"name": name, "mountPath": mount, "readOnly": True})
        roots.append(f"{name}={mount}")
    order = sorted(range(1, len(volumes)), key=lambda i: volumes[i]["name"])
    volumes = volumes[:1] + [volumes[i] for i in order]
    mounts = mounts[:1] + [mounts[i] for i in order]
    head = roots[:1] if model_has_volume(spec) else []
    roots = head + sorted(roots[len(head):])
    return volumes, mounts, roots


def lora_args(spec: InferenceServiceSpec) -> list[str]:
    """The serving container's LoRA flags (none while spec.adapters is unset). Each --lora-root value is a
    token of its own, NAME=DIR, so that a runner rewriting mount paths in flags finds DIR."""
    if not lora_enabled(spec):
        return []
    args = ["--enable-lora", "--lora-modules-file", f"{ADAPTERS_FILE_MOUNT}/{ADAPTERS_KEY}"]
    roots = adapter_volumes("", spec)[2]
    if roots:
        args += ["--lora-root", *roots]
    return args


def adapters_configmap(owner: dict[str, Any], spec: InferenceServiceSpec, labels: dict[str, str]) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    entries = [adapter_entry(spec, a) for a in spec.adapters or []]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, adapters_configmap_name(name), labels | {ROLE_LABEL: "serve"}),
        "data": {ADAPTERS_KEY: adapters_json(entries)},
    }

