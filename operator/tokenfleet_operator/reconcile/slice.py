"""Reconcile one Slice: gather its pods from the cache, plan (``gang/slice_state.py``), carry out the plan.

Admission comes from the gang scheduler's decision on the Slice (``gang/decision.py``) for gang-scheduled
Slices, and is immediate for the others. A batch leader's checkpoint comes from its termination message once
it has exited, else from the collector's latest reading of its metrics.
"""
from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from pydantic import ValidationError

from tokenfleet_operator import metrics
from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.api.slice import SliceSpec
from tokenfleet_operator.builders.slice_pods import rendezvous_service
from tokenfleet_operator.conditions import parse_rfc3339
from tokenfleet_operator.controller.collector import leader_pod
from tokenfleet_operator.controller.errors import InvalidSpec
from tokenfleet_operator.controller.manager import Context
from tokenfleet_operator.gang.decision import admission_for, is_gang
from tokenfleet_operator.gang.slice_state import STAY_FAILED, Admission, Phase, plan_slice, pod_view
from tokenfleet_operator.kube import KubeError
from tokenfleet_operator.naming import SLICE_LABEL
from tokenfleet_operator.policy import DENY_HOST_PATHS, OperatorPolicy
from tokenfleet_operator.reconcile import child_errors
from tokenfleet_operator.validation import Problem
from tokenfleet_serving.contract.termination import checkpoint_of

log = logging.getLogger("tokenfleet.slice")


def _node_domains(ctx: Context, nodes: set[str], topology_key: str) -> dict[str, str]:
    out = {}
    for node in nodes:
        obj = ctx.cache.get("Node", None, node)
        value = ((obj or {}).get("metadata", {}).get("labels") or {}).get(topology_key)
        if value:
            out[node] = value
    return out


def _reported_checkpoint(ctx: Context, namespace: str, name: str, spec: SliceSpec) -> dict[str, str] | None:
    if spec.role != "batch" or spec.checkpoint is None:
        return None
    leader = leader_pod(ctx.cache, namespace, name)
    final = checkpoint_of(leader) if leader is not None else None
    return final or ctx.collector.checkpoint(namespace, name)


def _ensure_rendezvous(ctx: Context, body: dict[str, Any], spec: SliceSpec
                       ) -> tuple[list[tuple[str, child_errors.Refusal]], KubeError | None]:
    """Make the headless Service of a multi-host Slice before its members (they resolve the leader through it).
    It stays across gang restarts and goes with the Slice. A Service of that name that another object owns
    is not taken over: the members are not created, and the Slice says why."""
    service = rendezvous_service(body, spec)
    if service is None:
        return [], None
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    existing = ctx.cache.get("Service", namespace, name)
    if existing is not None:
        if any(r.get("uid") == body["metadata"]["uid"] for r in existing["metadata"].get("ownerReferences") or []):
            return [], None
        message = (f"Service {name} exists and is not this Slice's; the members resolve the leader through a "
                   "headless Service of the Slice's name: rename the Slice or that Service")
        return ([("Ready", child_errors.Refusal("Service", name, "ServiceNameTaken", message))],
                KubeError(409, message, reason="AlreadyExists"))
    try:
        ctx.create(service)
    except KubeError as e:
        refusal = child_errors.refusal_of("Service", name, e)
        if refusal is None:
            raise
        return [("Ready", refusal)], e
    metrics.CHILDREN_APPLIED.labels(kind="Service").inc()
    return [], None


def reconcile_slice(ctx: Context, namespace: str, name: str, *, now: dt.datetime | None = None,
                    policy: OperatorPolicy = DENY_HOST_PATHS) -> float | None:
    """One pass. ``policy``: what a cluster administrator allows (host-path checkpoint stores)."""
    cached = ctx.cache.get("Slice", namespace, name)
    if cached is None or cached["metadata"].get("deletionTimestamp"):
        return None  # member pods go with their owner
    body: dict[str, Any] = {**cached, "apiVersion": API_VERSION, "kind": "Slice"}
    meta = body["metadata"]
    try:
        spec = SliceSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        first = e.errors()[0]
        raise InvalidSpec(Problem("InvalidSpec", "spec." + ".".join(map(str, first["loc"])), first["msg"])) from None

    pod_objs = [p for p in ctx.cache.by_label("Pod", namespace, SLICE_LABEL, name)
                if any(r.get("uid") == meta["uid"] for r in p["metadata"].get("ownerReferences") or [])]
    pods = [pod_view(p) for p in pod_objs]
    admission = admission_for(body, spec, pods) if ctx.gang_scheduling and is_gang(spec) else Admission()
    plan = plan_slice(
        body, spec, pods,
        now=now or dt.datetime.now(dt.UTC),
        admission=admission,
        node_domains=_node_domains(ctx, {p.node for p in pods if p.node}, spec.topology_key),
        reported_checkpoint=_reported_checkpoint(ctx, namespace, name, spec),
        policy=policy,
    )
    refused: list[tuple[str, child_errors.Refusal]] = []
    refusal_error: KubeError | None = None
    if plan.create:
        refused, refusal_error = _ensure_rendezvous(ctx, body, spec)
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pod_objs}
    if plan.counts_restart:
        # Record the restart first, guarded by resourceVersion: if another pass got here first this fails
        # with 409 and nothing is deleted twice.
        ctx.apply_status(body, plan.status, resource_version=meta.get("resourceVersion"))
        last = plan.status.get("lastRestart") or {}
        metrics.SLICE_RESTARTS.labels(namespace=namespace, slice=name, reason=last.get("reason", "")).inc()
    for pod_name in plan.delete:
        ctx.delete("v1", "Pod", namespace, pod_name, uid=uids.get(pod_name))
    for pod in plan.create if not refused else ():
        try:
            ctx.create(pod)
        except KubeError as e:
            refusal = child_errors.refusal_of("Pod", pod["metadata"]["name"], e)
            if refusal is None:
                raise
            refused, refusal_error = [("Ready", refusal)], e
            break                      # the other members would be refused alike
        metrics.CHILDREN_APPLIED.labels(kind="Pod").inc()
    old_conditions = (body.get("status") or {}).get("conditions")
    status = child_errors.with_refusals(plan.status, old_conditions, refused)
    written = plan.status if plan.counts_restart else (body.get("status") or {})
    if status != written:
        ctx.apply_status(body, status)
    for event in plan.events:
        ctx.event(body, event.type, event.reason, event.message)
    for refusal in child_errors.news(old_conditions, refused):
        ctx.event(body, "Warning", refusal.reason, refusal.message)
    if refusal_error is not None:
        raise refusal_error            # shown in the status; tried again with the queue's backoff
    metrics.SLICE_MEMBERS_READY.labels(namespace=namespace, slice=name).set(plan.status["members"]["ready"])
    metrics.SLICE_RESTART_BUDGET_USED.labels(namespace=namespace, slice=name).set(plan.status.get("restarts") or 0)
    metrics.SLICE_RESTART_BUDGET.labels(namespace=namespace, slice=name).set(spec.restart_policy.max_restarts)
    saved = (plan.status.get("checkpoint") or {}).get("savedAt")
    if saved:
        try:
            metrics.SLICE_CHECKPOINT_SAVED.labels(namespace=namespace, slice=name).set(parse_rfc3339(saved).timestamp())
        except ValueError:
            log.warning("Slice %s/%s: checkpoint savedAt %r is not RFC 3339", namespace, name, saved)
    if plan.status.get("phase") == Phase.FAILED:
        failed = next((c for c in plan.status["conditions"] if c["type"] == "Failed"), None)
        if failed and failed["reason"] not in STAY_FAILED:
            raise InvalidSpec(Problem(failed["reason"], "spec", failed["message"]))
    return plan.requeue_after
