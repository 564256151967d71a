"""InferenceService status as a pure function of its children's state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.builders.inference_service import hourly_cost, selector_string, serving_selector, service_url
from tokenfleet_operator.naming import REVISION_LABEL, slice_index
from tokenfleet_operator.throughput import measured_cost
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


def compute_status(
    owner: dict[str, Any],
    spec: InferenceServiceSpec,
    revision: str,
    slices: list[SliceState],
    router_ready: int,
    old_status: dict[str, Any] | None = None,
    now: str | None = None,
    output_tokens_per_second: float | None = None,
) -> dict[str, Any]:
    old_status = old_status or {}
    now = now or cond.now_rfc3339()
    name = owner["metadata"]["name"]
    generation = owner["metadata"].get("generation")
    desired = spec.replicas
    mine = sorted(
        (s for s in slices if (slice_index(name, s.name) is not None and slice_index(name, s.name) < desired)),
        key=lambda s: slice_index(name, s.name),
    )
    ready = sum(1 for s in mine if s.ready)
    updated = sum(1 for s in mine if s.revision == revision)
    failed = [s for s in mine if s.phase == "Failed"]
    troubled = [s for s in mine if s.phase in ("Failed", "Restarting", "Degraded")]

    if desired == 0:
        slices_c = cond.Desired("SlicesReady", "True", "ScaledToZero", "spec.replicas is 0")
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
    elif 0 < ready < desired and updated == desired:
        degraded = cond.Desired("Degraded", "True", "ReplicasUnavailable", f"only {ready}/{desired} replicas ready")
    else:
        degraded = cond.Desired("Degraded", "False", "AsExpected", "no replica is unhealthy")
    if slices_c.status == "True" and router_c.status == "True":
        if updated < desired:
            ready_c = cond.Desired("Ready", "True", "RollingUpdate", f"serving; {updated}/{desired} replicas updated")
        else:
            ready_c = cond.Desired("Ready", "True", "Serving", f"{ready}/{desired} replicas and the router are ready")
    elif slices_c.status != "True":
        ready_c = cond.Desired("Ready", "False", slices_c.reason, slices_c.message)
    else:
        ready_c = cond.Desired("Ready", "False", router_c.reason, router_c.message)
    desired_conds = [ready_c, slices_c, router_c, degraded]

    cost = dict(old_status.get("cost") or {})
    cost["dollarsPerHour"] = hourly_cost(spec, len(mine))
    cost.update(measured_cost(cost["dollarsPerHour"], output_tokens_per_second))
    cost = {k: v for k, v in cost.items() if v is not None}
    status: dict[str, Any] = {
        "replicas": len(mine),
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "selector": selector_string(serving_selector(name)),
        "url": service_url(owner),
        "slices": [
            {"name": s.name, "phase": s.phase, "ready": s.ready, "updated": s.revision == revision} for s in mine
        ],
        "cost": cost,
        "observedGeneration": generation,
        "conditions": cond.merge(old_status.get("conditions"), desired_conds, now=now, generation=generation),
    }
    if old_status.get("goodput"):
        status["goodput"] = old_status["goodput"]
    return {k: v for k, v in status.items() if v is not None}


def invalid_status(owner: dict[str, Any], problem: Problem, old_status: dict[str, Any] | None) -> dict[str, Any]:
    """Status of a service whose spec cannot be reconciled: Ready=False with the
    problem's reason; the rest of the last known status is kept."""
    old_status = old_status or {}
    generation = owner["metadata"].get("generation")
    text = str(problem)
    desired = [
        cond.Desired("Ready", "False", problem.reason, text),
        cond.Desired("SlicesReady", "Unknown", problem.reason, "not reconciled until the spec is fixed"),
        cond.Desired("RouterReady", "Unknown", problem.reason, "not reconciled until the spec is fixed"),
        cond.Desired("Degraded", "False", problem.reason, "not reconciled until the spec is fixed"),
    ]
    kept = ("replicas", "readyReplicas", "updatedReplicas", "selector", "url", "slices", "cost", "goodput")
    status = {k: v for k, v in old_status.items() if k in kept}
    status["observedGeneration"] = generation
    status["conditions"] = cond.merge(old_status.get("conditions"), desired, now=cond.now_rfc3339(), generation=generation)
    return status
