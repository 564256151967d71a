"""InferenceService status as a pure function of its children's state, built through the API's status model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.adapter_status import CONDITION as ADAPTERS_CONDITION
from tokenfleet_operator.adapter_status import adapters_status
from tokenfleet_operator.api.inference_service import InferenceServiceSpec, InferenceServiceStatus
from tokenfleet_operator.builders.inference_service import hourly_cost, selector_string, service_url, serving_selector
from tokenfleet_operator.naming import REVISION_LABEL, slice_index
from tokenfleet_operator.pod_metrics import ReplicaAdapters
from tokenfleet_operator.validation import Problem


@dataclass(frozen=True)
class SliceState:
    name: str
    revision: str | None
    phase: str
    ready: bool
    reason: str = ""
    message: str = ""


def slice_state(obj: dict[str, Any]) -> SliceState:
    """Summarise a Slice object. A Slice counts as ready only when its controller
    has seen its latest spec and reports every member ready."""
    meta = obj.get("metadata", {})
    status = obj.get("status") or {}
    ready_cond = cond.find(status.get("conditions"), "Ready") or {}
    caught_up = status.get("observedGeneration") == meta.get("generation")
    return SliceState(
        name=meta.get("name", ""),
        revision=(meta.get("labels") or {}).get(REVISION_LABEL),
        phase=status.get("phase", "Pending"),
        ready=caught_up and status.get("phase") == "Ready",
        reason=ready_cond.get("reason", ""),
        message=ready_cond.get("message", ""),
    )


def deployment_ready_replicas(obj: dict[str, Any] | None) -> int:
    return int(((obj or {}).get("status") or {}).get("readyReplicas") or 0)


@dataclass(frozen=True)
class Scaling:
    """How many replicas the operator converges to, and, with the built-in autoscaler, why."""

    desired: int
    autoscaling: dict[str, Any] | None = None          # status.autoscaling
    limited: cond.Desired | None = None                # the ScalingLimited condition (autoscaler on)
    draining: tuple[dict[str, str], ...] = ()          # status.draining


@dataclass(frozen=True)
class AdapterReports:
    """What the ready serving pods report about their LoRA adapters (``adapter_status.py``)."""

    replicas: dict[str, ReplicaAdapters] = field(default_factory=dict)
    ready_pods: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Measured:
    """What the router's readings say over a window (``autoscale/measure.py``)."""

    cost: dict[str, Any] = field(default_factory=dict)  # tokensPerHour, costPerMillionTokens, window, minTokens
    goodput: dict[str, Any] | None = None
    capacity: dict[str, Any] | None = None


def compute_status(
    owner: dict[str, Any],
    spec: InferenceServiceSpec,
    revision: str,
    slices: list[SliceState],
    router_ready: int,
    old_status: dict[str, Any] | None = None,
    now: str | None = None,
    scaling: Scaling | None = None,
    measured: Measured | None = None,
    adapter_reports: AdapterReports | None = None,
) -> dict[str, Any]:
    old_status = old_status or {}
    now = now or cond.now_rfc3339()
    name = owner["metadata"]["name"]
    generation = owner["metadata"].get("generation")
    scaling = scaling or Scaling(spec.replicas)
    measured = measured or Measured()
    desired = scaling.desired
    indexed = [(i, s) for s in slices if (i := slice_index(name, s.name)) is not None and i < desired]
    mine = [s for _, s in sorted(indexed, key=lambda pair: pair[0])]
    ready = sum(1 for s in mine if s.ready)
    updated = sum(1 for s in mine if s.revision == revision)
    failed = [s for s in mine if s.phase == "Failed"]
    troubled = [s for s in mine if s.phase in ("Failed", "Restarting", "Degraded")]

    if desired == 0:
        slices_c = cond.Desired("SlicesReady", "True", "ScaledToZero", "0 replicas desired")
    elif ready == desired and len(mine) == desired:
        slices_c = cond.Desired("SlicesReady", "True", "AllSlicesReady", f"{ready}/{desired} replicas ready")
    else:
        not_ready = [s for s in mine if not s.ready]
        detail = "; ".join(f"{s.name}: {s.phase}" + (f" ({s.reason}: {s.message})" if s.reason else "") for s in not_ready[:3])
        missing = desired - len(mine)
        if missing:
            detail = (detail + "; " if detail else "") + f"{missing} slices not created yet"
        reason = "SliceFailed" if failed else "SlicesNotReady"
        slices_c = cond.Desired("SlicesReady", "False", reason, f"{ready}/{desired} replicas ready; {detail}")
    if router_ready >= 1:
        router_c = cond.Desired("RouterReady", "True", "RouterAvailable", f"{router_ready}/{spec.routing.replicas} router pods ready")
    else:
        router_c = cond.Desired("RouterReady", "False", "RouterUnavailable", f"no router pod of deployment {name}-router is ready")
    if troubled:
        s = troubled[0]
        degraded = cond.Desired(
            "Degraded", "True", "SliceFailed" if failed else "SliceUnhealthy",
            f"{len(troubled)} replicas unhealthy; {s.name} is {s.phase}" + (f": {s.message}" if s.message else ""),
        )
    elif 0 < ready < desired and updated == desired and _was_serving(old_status):
        # a replica lost after the service was serving; while the replicas first come up the service is
        # Reconciling, not Degraded (no Warning for a normal start)
        degraded = cond.Desired("Degraded", "True", "ReplicasUnavailable", f"only {ready}/{desired} replicas ready")
    else:
        degraded = cond.Desired("Degraded", "False", "AsExpected", "no replica is unhealthy")
    if desired == 0 and router_c.status == "True" and scaling.autoscaling is not None and spec.min_replicas == 0:
        ready_c = cond.Desired("Ready", "True", "ScaledToZero", "no replica runs; the router holds requests while one comes up")
    elif slices_c.status == "True" and router_c.status == "True":
        if updated < desired:
            ready_c = cond.Desired("Ready", "True", "RollingUpdate", f"serving; {updated}/{desired} replicas updated")
        else:
            ready_c = cond.Desired("Ready", "True", "Serving", f"{ready}/{desired} replicas and the router are ready")
    elif slices_c.status != "True":
        ready_c = cond.Desired("Ready", "False", slices_c.reason, slices_c.message)
    else:
        ready_c = cond.Desired("Ready", "False", router_c.reason, router_c.message)
    stalled = cond.Desired(
        "Stalled", "True", "SliceFailed",
        f"{len(failed)} replicas failed and stay down until the spec changes; {failed[0].name}: "
        + (f"{failed[0].reason}: {failed[0].message}" if failed[0].reason else "Failed"),
    ) if failed else None
    desired_conds = [ready_c, slices_c, router_c, degraded,
                     *progress_conditions(ready_c, settled=updated == desired == len(mine), stalled=stalled)]
    if scaling.limited:
        desired_conds.append(scaling.limited)

    cost: dict[str, Any] = {"dollarsPerHour": hourly_cost(spec, len(mine) + len(scaling.draining)), **measured.cost}
    reports = adapter_reports or AdapterReports()
    adapters, adapters_c = adapters_status(spec, reports.replicas, set(reports.ready_pods), cost["dollarsPerHour"])
    if adapters_c is not None:
        desired_conds.append(adapters_c)
    capacity = measured.capacity or (old_status.get("cost") or {}).get("capacity")
    if capacity:
        cost["capacity"] = capacity
    status: dict[str, Any] = {
        "replicas": len(mine),
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "selector": selector_string(serving_selector(name)),
        "url": service_url(owner),
        "slices": [
            {"name": s.name, "phase": s.phase, "ready": s.ready, "updated": s.revision == revision} for s in mine
        ],
        "desiredReplicas": desired,
        "draining": list(scaling.draining) or None,
        "autoscaling": scaling.autoscaling,
        "cost": cost,
        "goodput": measured.goodput,
        "adapters": adapters,
        "observedGeneration": generation,
        "conditions": cond.merge(_without_stale(old_status.get("conditions"), scaling, adapters_c is not None),
                                 desired_conds, now=now, generation=generation),
    }
    return InferenceServiceStatus.model_validate(status).to_wire()


def _without_stale(conditions: list[dict[str, Any]] | None, scaling: Scaling, adapters: bool) -> list[dict[str, Any]]:
    """The old conditions, less ScalingLimited once the autoscaler is off and AdaptersReady once spec.adapters
    is unset (merge keeps other types)."""
    gone = ({"ScalingLimited"} if scaling.limited is None else set()) | (set() if adapters else {ADAPTERS_CONDITION})
    return [c for c in conditions or [] if c.get("type") not in gone]


def invalid_status(owner: dict[str, Any], problem: Problem, old_status: dict[str, Any] | None) -> dict[str, Any]:
    """Status of a service whose spec cannot be reconciled: Ready=False with the
    problem's reason; the rest of the last known status is kept."""
    old_status = old_status or {}
    generation = owner["metadata"].get("generation")
    text = str(problem)
    ready = cond.Desired("Ready", "False", problem.reason, text)
    waiting = problem.reason in WAITING_REASONS
    desired = [
        ready,
        cond.Desired("SlicesReady", "Unknown", problem.reason, "not reconciled until the spec is fixed"),
        cond.Desired("RouterReady", "Unknown", problem.reason, "not reconciled until the spec is fixed"),
        cond.Desired("Degraded", "False", problem.reason, "not reconciled until the spec is fixed"),
        *progress_conditions(ready, settled=False, stalled=None if waiting else ready),
    ]
    kept = ("replicas", "readyReplicas", "updatedReplicas", "selector", "url", "slices", "cost", "goodput",
            "modelShape", "adapters")
    status = {k: v for k, v in old_status.items() if k in kept}
    status["observedGeneration"] = generation
    status["conditions"] = cond.merge(old_status.get("conditions"), desired, now=cond.now_rfc3339(), generation=generation)
    return InferenceServiceStatus.model_validate(status).to_wire()


# ---- kstatus conditions (sigs.k8s.io/cli-utils/pkg/kstatus, read by Flux, kpt and `kubectl wait`-style tools;
# Argo CD's health.lua reads them too). Reconciling=True while the operator works toward the spec; Stalled=True
# when it cannot get there until the spec changes or a person acts (a replica spent its restart budget, the spec
# is semantically invalid). Both are always present, False when they do not apply.

# Problems the operator waits out by itself (their fix is an event it watches): Reconciling, not Stalled.
WAITING_REASONS = frozenset({"ModelSourceNotFound", "ReadingModel"})


def _was_serving(old_status: dict[str, Any]) -> bool:
    return cond.is_true(old_status.get("conditions"), "Ready")


def progress_conditions(ready: cond.Desired, *, settled: bool, stalled: cond.Desired | None) -> list[cond.Desired]:
    """Reconciling and Stalled from the Ready condition. ``settled``: every replica exists and runs the current
    spec; ``stalled``: the condition that blocks progress, if any."""
    if stalled is not None:
        return [cond.Desired("Reconciling", "False", stalled.reason, "stalled: " + stalled.message),
                cond.Desired("Stalled", "True", stalled.reason, stalled.message)]
    not_stalled = cond.Desired("Stalled", "False", "AsExpected", "nothing blocks the operator")
    busy: cond.Status = "False" if ready.status == "True" and settled else "True"
    return [cond.Desired("Reconciling", busy, ready.reason, ready.message), not_stalled]
