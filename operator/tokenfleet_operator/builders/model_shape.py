"""InferenceService -> the short pod that reads the model's shape before any replica of a split model starts.

A replica whose model is split over several ranks (``parallelism.py``) can only start if the model divides
among them. The model is on the replicas' volume, out of the operator's reach, so the operator runs
``tokenfleet model-shape`` (``contract/model_shape.py``) once in a pod that mounts the model exactly as the
replicas do, on a node of the replicas' accelerator type (a hostPath model is there), requesting no
accelerator. Its name carries a hash of the model source: a new source is read again, an unchanged one never.
"""
from __future__ import annotations

from typing import Any

from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.builders.inference_service import common_labels, model_storage
from tokenfleet_operator.builders.security import harden_container, harden_pod_spec
from tokenfleet_operator.naming import ACCELERATOR_NODE_LABEL, ROLE_LABEL, child_metadata, revision_of
from tokenfleet_operator.parallelism import parallel_sizes
from tokenfleet_operator.runtimes import runtime_of
from tokenfleet_operator.validation import runs_bundled_server

ROLE = "model-shape"
DEADLINE_SECONDS = 300


def model_source_hash(spec: InferenceServiceSpec) -> str:
    """What identifies the model a shape was read from (its source and the image that read it)."""
    return revision_of({"model": spec.model.model_dump(mode="json", include={"path", "pvc", "host_path"}),
                        "image": spec.image})


def needs_model_shape(spec: InferenceServiceSpec) -> bool:
    """Whether the model's shape must be checked before replicas start, and the image can read it: when the
    replicas split the model, or when engine.maxModelLen is to be checked against a KV budget the operator
    sizes (an accelerator's, or one set by an engine field: ``kv_budget.py``). Another image than the bundled
    one has no ``model-shape`` command, and its server checks for itself."""
    try:
        sizes = parallel_sizes(spec)
    except ValueError:
        return False                    # refused for its sizes before the shape matters
    eng = spec.engine
    budget_set = (eng.kv_cache_memory is not None or eng.kv_cache_mb is not None
                  or eng.accelerator_memory_utilization is not None or spec.accelerator.type != "cpu")
    checks_budget = eng.max_model_len is not None and budget_set
    return (sizes.world > 1 or checks_budget) and runtime_of(spec).reads_model_shape and runs_bundled_server(spec.image)


def model_shape_pod_name(service: str, spec: InferenceServiceSpec) -> str:
    return f"{service}-model-shape-{model_source_hash(spec)}"


def model_shape_pod(owner: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    volumes, mounts, model_dir = model_storage(spec)
    container: dict[str, Any] = {
        "name": "model-shape",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["tokenfleet", "model-shape", "--model", model_dir],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "500m", "memory": "256Mi"}},
    }
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec: dict[str, Any] = {
        "containers": [harden_container(container)],
        "restartPolicy": "Never",
        "activeDeadlineSeconds": DEADLINE_SECONDS,
        "enableServiceLinks": False,
    }
    if volumes:
        pod_spec["volumes"] = volumes
    if spec.accelerator.type != "cpu":
        pod_spec["nodeSelector"] = {ACCELERATOR_NODE_LABEL: spec.accelerator.type}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(owner, model_shape_pod_name(name, spec), common_labels(name) | {ROLE_LABEL: ROLE}),
        "spec": harden_pod_spec(pod_spec),
    }
