"""Builders of the plain Kubernetes dicts the gang scheduler lists (for the pure tests)."""
from __future__ import annotations

from typing import Any

from tokenfleet_operator.api.slice import SliceSpec
from tokenfleet_operator.builders.slice_pods import member_pod
from tokenfleet_operator.gang.plan import SCHEDULER_NAME
from tokenfleet_operator.gang.slice_state import slice_revision

T0 = "2030-01-01T00:00:00Z"
T0_S = 1893456000.0  # T0 as a Unix timestamp


def node(name: str, block: str, index: int, gpus: int = 8, *, ready: bool = True, accel: str = "h100",
         taints: list[dict] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"tokenfleet.dev/block": block, "tokenfleet.dev/host-index": str(index),
                                              "tokenfleet.dev/accelerator": accel}},
        "spec": {"taints": taints or []},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": str(gpus)},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def slice_obj(name: str, *, ns: str = "ns", hosts: int = 2, per_host: int = 8, priority: int = 0, queue: str = "default",
              accel: str = "h100", created: str = T0, status: dict | None = None, topology: str | None = None) -> dict[str, Any]:
    spec = {
        "accelerator": {"type": accel, "resourceName": "nvidia.com/gpu", "countPerHost": per_host},
        "hosts": hosts, "topologyKey": "tokenfleet.dev/block", "priority": priority, "queue": queue,
        "template": {"spec": {"containers": [{"name": "main", "image": "x"}]}},
    }
    if topology:
        spec["topology"] = topology
    return {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "Slice",
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{ns}-{name}", "creationTimestamp": created},
            "spec": spec, "status": status or {}}


def members(obj: dict[str, Any], *, nodes: list[str | None] | None = None, created: str = T0,
            attempt: int = 0) -> list[dict[str, Any]]:
    """The member pods the Slice controller would create, optionally bound."""
    spec = SliceSpec.model_validate(obj["spec"])
    out = []
    for m in range(spec.hosts):
        pod = member_pod(obj, spec, m, attempt=attempt, revision=slice_revision(spec), scheduler_name=SCHEDULER_NAME)
        pod["metadata"]["uid"] = f"pod-uid-{obj['metadata']['name']}-{m}"
        pod["metadata"]["creationTimestamp"] = created
        pod["status"] = {"phase": "Pending"}
        node_name = (nodes or [None] * spec.hosts)[m]
        if node_name:
            pod["spec"]["nodeName"] = node_name
            pod["status"] = {"phase": "Running"}
        out.append(pod)
    return out


def other_pod(node_name: str, gpus: int, ns: str = "other", name: str = "hog") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": "Running"}}


def queue_obj(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "SliceQueue", "metadata": {"name": name}, "spec": spec}


def two_blocks(gpus: int = 8) -> list[dict[str, Any]]:
    return [node(f"a{i}", "a", i, gpus) for i in range(2)] + [node(f"b{i}", "b", i, gpus) for i in range(2)]
