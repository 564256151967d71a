"""Reconcile one Slice: gather its pods, plan, carry out the plan."""
from __future__ import annotations

import datetime as dt
import logging
from typing import Any, Callable

from pydantic import ValidationError

from tokenfleet_operator import metrics
from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.api.slice import SliceSpec
from tokenfleet_operator.checkpoint_report import read_checkpoint
from tokenfleet_operator.handlers.errors import InvalidSpec
from tokenfleet_operator.kube import Kube
from tokenfleet_operator.naming import LEADER_LABEL, SLICE_LABEL
from tokenfleet_operator.slice_state import Admission, PodView, plan_slice, pod_view
from tokenfleet_operator.validation import Problem

log = logging.getLogger("tokenfleet.slice")

# The placement hook: (slice object, spec, current pods) -> Admission. The default
# admits at once and lets the scheduler place members; the gang placer plugs in here.
AdmitFn = Callable[[dict[str, Any], SliceSpec, list[PodView]], Admission]


def default_admission(obj: dict[str, Any], spec: SliceSpec, pods: list[PodView]) -> Admission:
    return Admission()


# The hook reconcile_slice uses when none is passed. `tokenfleet operator` sets it
# to the gang scheduler's (GangScheduler.admission) at start-up.
_ADMISSION: AdmitFn = default_admission


def use_admission(admit: AdmitFn) -> None:
    global _ADMISSION
    _ADMISSION = admit


def _node_domains(kube: Kube, pods: list[PodView], topology_key: str, cache: dict[str, str | None]) -> dict[str, str]:
    out = {}
    for node in {p.node for p in pods if p.node}:
        if node not in cache:
            obj = kube.get("v1", "Node", None, node)
            cache[node] = ((obj or {}).get("metadata", {}).get("labels") or {}).get(topology_key)
        if cache[node]:
            out[node] = cache[node]
    return out


def reconcile_slice(kube: Kube, body: dict[str, Any], *, admit: AdmitFn | None = None,
                    now: dt.datetime | None = None) -> float | None:
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return None  # member pods go with their owner
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    body = {**body, "apiVersion": API_VERSION, "kind": "Slice"}
    try:
        spec = SliceSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        first = e.errors()[0]
        raise InvalidSpec(Problem("InvalidSpec", "spec." + ".".join(map(str, first["loc"])), first["msg"])) from None

    pod_objs = [
        p for p in kube.list("v1", "Pod", namespace, f"{SLICE_LABEL}={name}")
        if any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences") or [])
    ]
    pods = [pod_view(p) for p in pod_objs]
    reported = None
    if spec.role == "batch" and spec.checkpoint is not None:
        leaders = [p for p in pod_objs if (p["metadata"].get("labels") or {}).get(LEADER_LABEL) == "true"
                   and not p["metadata"].get("deletionTimestamp")]
        reported = read_checkpoint(leaders[0]) if len(leaders) == 1 else None
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pod_objs}
    plan = plan_slice(
        body, spec, pods,
        now=now or dt.datetime.now(dt.timezone.utc),
        admission=(admit or _ADMISSION)(body, spec, pods),
        node_domains=_node_domains(kube, pods, spec.topology_key, {}),
        reported_checkpoint=reported,
    )
    if plan.counts_restart:
        # Record the restart first, guarded by resourceVersion: if another pass got
        # here first this fails with 409 and nothing is deleted twice.
        kube.apply_status(body, plan.status, resource_version=meta.get("resourceVersion"))
        last = plan.status.get("lastRestart") or {}
        metrics.SLICE_RESTARTS.labels(namespace=namespace, slice=name, reason=last.get("reason", "")).inc()
    for pod_name in plan.delete:
        kube.delete("v1", "Pod", namespace, pod_name, uid=uids.get(pod_name))
    for pod in plan.create:
        kube.create(pod)
        metrics.CHILDREN_APPLIED.labels(kind="Pod").inc()
    if not plan.counts_restart:
        kube.apply_status(body, plan.status)
    for event in plan.events:
        kube.event(body, event.type, event.reason, event.message)
    metrics.SLICE_MEMBERS_READY.labels(namespace=namespace, slice=name).set(plan.status["members"]["ready"])
    if plan.status.get("phase") == "Failed":
        ready = next((c for c in plan.status["conditions"] if c["type"] == "Failed"), None)
        if ready and ready["reason"] not in ("RestartBudgetExhausted",):
            raise InvalidSpec(Problem(ready["reason"], "spec", ready["message"]))
    return plan.requeue_after
