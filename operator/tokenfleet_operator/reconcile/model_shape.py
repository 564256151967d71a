"""The model's shape, known before the first replica of a split model starts (``builders/model_shape.py``).

One step of an InferenceService's reconcile: the shape recorded in ``status.modelShape`` for the current model
source, else the result of the ``model-shape`` pod (created when missing, deleted once read). While the pod
runs, the service waits (Ready=False, reason ReadingModel, Reconciling); a pod that could not read the model
stops the service with reason ModelNotReadable and the pod's last words, until the spec changes or someone
deletes the pod to have it read again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.builders.model_shape import ROLE, model_shape_pod, model_shape_pod_name, model_source_hash
from tokenfleet_operator.controller.manager import Context
from tokenfleet_operator.kube import KubeError
from tokenfleet_operator.naming import ROLE_LABEL, SERVICE_LABEL
from tokenfleet_operator.parallelism import ModelShape
from tokenfleet_operator.validation import Problem
from tokenfleet_serving.contract.model_shape import shape_in


@dataclass(frozen=True)
class ShapeStep:
    shape: ModelShape | None = None
    status: dict[str, Any] | None = None     # status.modelShape to write
    problem: Problem | None = None           # ReadingModel (waiting) or ModelNotReadable


def _last_words(pod: dict[str, Any]) -> str:
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated") or {}
        if terminated.get("message"):
            return " ".join(terminated["message"].split())[-1024:]
        if terminated:
            return f"exit code {terminated.get('exitCode')} ({terminated.get('reason', '')})"
    return status.get("message") or status.get("reason") or "no message"


def model_shape_step(ctx: Context, owner: dict[str, Any], spec: InferenceServiceSpec,
                     old_status: dict[str, Any]) -> ShapeStep:
    meta = owner["metadata"]
    namespace, service = meta["namespace"], meta["name"]
    source = model_source_hash(spec)
    name = model_shape_pod_name(service, spec)
    for stale in ctx.cache.by_label("Pod", namespace, SERVICE_LABEL, service):
        labels = stale["metadata"].get("labels") or {}
        if labels.get(ROLE_LABEL) == ROLE and stale["metadata"]["name"] != name:
            ctx.delete("v1", "Pod", namespace, stale["metadata"]["name"])       # read for an older model source
    recorded = old_status.get("modelShape") or {}
    if recorded.get("source") == source:
        return ShapeStep(_shape(recorded), recorded)
    reading = Problem("ReadingModel", "spec.model",
                      f"reading the model's shape in pod {name} before starting replicas (to check how it splits "
                      "over ranks, and that engine.maxModelLen fits the KV cache)")
    pod = ctx.cache.get("Pod", namespace, name)
    if pod is None:
        try:
            ctx.create(model_shape_pod(owner, spec))
        except KubeError as e:
            if e.status not in (400, 403, 422):
                raise
            return ShapeStep(problem=Problem("ModelNotReadable", "spec.model",
                                             f"the API server refused pod {name}, which reads the model's shape: "
                                             f"{e.detail}"))
        return ShapeStep(problem=reading)
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Succeeded" and (found := shape_in(pod)) is not None:
        entry = {"source": source, **found}
        ctx.delete("v1", "Pod", namespace, name, uid=pod["metadata"].get("uid"))
        return ShapeStep(_shape(entry), entry)
    if phase in ("Succeeded", "Failed"):
        return ShapeStep(problem=Problem(
            "ModelNotReadable", "spec.model",
            f"pod {name} could not read the model's shape: {_last_words(pod)}; fix the model or its source (or "
            f"delete the pod to read it again)"))
    return ShapeStep(problem=reading)


def _shape(entry: dict[str, Any]) -> ModelShape:
    return ModelShape(layers=entry["layers"], attention_heads=entry["attentionHeads"],
                      kv_heads=entry["keyValueHeads"], intermediate_size=entry["intermediateSize"],
                      head_dim=entry.get("headDim"), dtype_bytes=entry.get("dtypeBytes"),
                      weight_bytes=entry.get("weightBytes"))
