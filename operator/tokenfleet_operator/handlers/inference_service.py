"""Reconcile one InferenceService: apply its children, roll its Slices,
write its status.

Each pass also lists the replicas' serving (leader) pods and writes their
addresses into the router ConfigMap's endpoints.json (server-side apply,
which the API server treats as a no-op when nothing changed). Pod readiness
reaches this pass through the Slice the pod belongs to (a member pod event
reconciles its Slice, whose status change reconciles the service); while a
serving pod is not ready, the pass also asks to run again in a few seconds.
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from tokenfleet_operator import conditions as cond
from tokenfleet_operator import metrics
from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.builders.inference_service import (
    desired_children,
    endpoints_config,
    selector_string,
    serving_selector,
)
from tokenfleet_operator.builders.rollout import ObservedSlice, plan_rollout
from tokenfleet_operator.handlers.errors import InvalidSpec, RetryLater
from tokenfleet_operator.inference_service_status import compute_status, deployment_ready_replicas, invalid_status, slice_state
from tokenfleet_operator.kube import Kube
from tokenfleet_operator.throughput import scrape_output_tokens_per_second
from tokenfleet_operator.naming import REVISION_LABEL, SERVICE_LABEL
from tokenfleet_operator.validation import Problem, check_inference_service

log = logging.getLogger("tokenfleet.inferenceservice")

ENDPOINTS_RECHECK_SECONDS = 10.0


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


def _parse_spec(body: dict[str, Any]) -> InferenceServiceSpec:
    try:
        return InferenceServiceSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        first = e.errors()[0]
        field = "spec." + ".".join(str(p) for p in first["loc"])
        raise InvalidSpec(Problem("InvalidSpec", field, first["msg"])) from None


def _write_status(kube: Kube, body: dict[str, Any], status: dict[str, Any]) -> None:
    old = (body.get("status") or {}).get("conditions")
    kube.apply_status(body, status)
    for t in cond.transitions(old, status["conditions"]):
        if t.type == "Ready":
            kind = "Normal" if t.new_status == "True" else "Warning"
            if t.old_status is None and t.new_status != "True" and t.reason in ("SlicesNotReady",):
                continue  # a brand-new service is expected to be not ready yet
            kube.event(body, kind, t.reason, t.message)
        elif t.type == "Degraded" and t.new_status == "True":
            kube.event(body, "Warning", t.reason, t.message)


def reconcile_inference_service(kube: Kube, body: dict[str, Any]) -> float | None:
    """One level-based pass. Returns seconds until the next pass is needed, or None."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return None  # children go with their owner (ownerReferences)
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    owner = {"apiVersion": API_VERSION, "kind": "InferenceService", "metadata": meta}
    body = {**body, "apiVersion": API_VERSION, "kind": "InferenceService"}
    old_status = body.get("status") or {}

    try:
        spec = _parse_spec(body)
        problems = check_inference_service(spec)
        if problems:
            raise InvalidSpec(problems[0])
    except InvalidSpec as e:
        _write_status(kube, body, invalid_status(owner, e.problem, old_status))
        raise

    if spec.model.pvc is not None:
        claim = spec.model.pvc.claim_name
        if kube.get("v1", "PersistentVolumeClaim", namespace, claim) is None:
            problem = Problem("ModelSourceNotFound", "spec.model.pvc.claimName", f"PersistentVolumeClaim {claim} does not exist in {namespace}; create it")
            _write_status(kube, body, invalid_status(owner, problem, old_status))
            raise RetryLater(str(problem), delay=15)

    pods = kube.list("v1", "Pod", namespace, selector_string(serving_selector(name)))
    endpoints = endpoints_config(pods)
    children = desired_children(owner, spec, endpoints)
    applied: dict[str, dict[str, Any]] = {}
    for manifest in children.others:
        applied[manifest["kind"]] = kube.apply(manifest)
        metrics.CHILDREN_APPLIED.labels(kind=manifest["kind"]).inc()

    existing = [s for s in kube.list(API_VERSION, "Slice", namespace, f"{SERVICE_LABEL}={name}") if _owned_by(s, uid)]
    states = {s["metadata"]["name"]: s for s in existing}
    observed = [
        ObservedSlice(s["metadata"]["name"], (s["metadata"].get("labels") or {}).get(REVISION_LABEL), slice_state(s).ready)
        for s in existing
    ]
    plan = plan_rollout(name, spec.replicas, children.revision, observed, spec.rollout.max_unavailable)
    for index in plan.apply:
        manifest = children.slices[index]
        is_new = manifest["metadata"]["name"] not in states
        states[manifest["metadata"]["name"]] = kube.apply(manifest)
        metrics.CHILDREN_APPLIED.labels(kind="Slice").inc()
        if is_new:
            kube.event(body, "Normal", "SliceCreated", f"created Slice {manifest['metadata']['name']} for replica {index}")
    for slice_name in plan.delete:
        if kube.delete(API_VERSION, "Slice", namespace, slice_name):
            kube.event(body, "Normal", "SliceDeleted", f"deleted Slice {slice_name} (scaled to {spec.replicas})")
        states.pop(slice_name, None)

    status = compute_status(
        owner, spec, children.revision, [slice_state(s) for s in states.values()],
        deployment_ready_replicas(applied.get("Deployment")), old_status=old_status,
        output_tokens_per_second=scrape_output_tokens_per_second(endpoints),
    )
    _write_status(kube, body, status)
    metrics.SERVICE_READY_REPLICAS.labels(namespace=namespace, service=name).set(status["readyReplicas"])
    metrics.SERVICE_COST.labels(namespace=namespace, service=name).set(status["cost"]["dollarsPerHour"])
    if "costPerMillionTokens" in status["cost"]:
        metrics.SERVICE_COST_PER_MTOK.labels(namespace=namespace, service=name).set(
            status["cost"]["costPerMillionTokens"])
    # A rollout that is held back, or replicas that are still coming up, move on
    # through Slice events; the resync loop is the safety net. Serving pods that
    # are not (yet) ready are looked at again soon, so the router learns about
    # them without waiting for the resync.
    if plan.waiting:
        return 5.0
    if any(not e["ready"] for e in endpoints) or len(endpoints) < spec.replicas:
        return ENDPOINTS_RECHECK_SECONDS
    return None
