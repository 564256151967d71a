"""TokenRoute: its targets resolved against the cluster, and its status, as pure functions.

``resolve`` looks each target up (an InferenceService or a TokenRoute of the namespace) and finds what is
wrong, first problem first:

- ``RouteCycle``: a TokenRoute target leads back to this route (the message names the cycle);
- ``TargetNotFound``: a target (or, with ``NameConflict``, an InferenceService named like the route's Service)
  does not exist;
- ``TargetModelNotServed``: a target's ``model`` is none of its served model names.

``compute_route_status`` turns that, the router Deployment's readiness and the targets' router pods into
``status`` with conditions Ready, TargetsResolved, ClassifierReady (with a classifier), RouterReady, and
kstatus' Reconciling and Stalled.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.api.token_route import RouteTargetStatus, TokenRouteSpec, TokenRouteStatus
from tokenfleet_operator.builders.token_route import ResolvedTarget, route_child_name
from tokenfleet_operator.validation import Problem

Lookup = Callable[[str], dict[str, Any] | None]


@dataclass(frozen=True)
class Resolution:
    targets: list[ResolvedTarget]
    problems: list[Problem] = field(default_factory=list)
    cycle: bool = False
    classifier_model: str | None = None
    classifier_problem: Problem | None = None


def _parse_isvc(obj: dict[str, Any]) -> InferenceServiceSpec | None:
    try:
        return InferenceServiceSpec.model_validate(obj.get("spec") or {})
    except ValueError:
        return None


def _served(obj: dict[str, Any]) -> list[str]:
    names = ((obj.get("spec") or {}).get("model") or {}).get("servedModelNames") or []
    return [n for n in names if isinstance(n, str)]


def find_cycle(name: str, route_targets: Callable[[str], list[str]]) -> list[str] | None:
    """The route names of a path from ``name`` back to itself through TokenRoute targets, or None."""
    path: list[str] = []
    seen: set[str] = set()

    def visit(current: str) -> list[str] | None:
        for nxt in route_targets(current):
            if nxt == name:
                return [*path, current, nxt]
            if nxt in seen:
                continue
            seen.add(nxt)
            path.append(current)
            found = visit(nxt)
            path.pop()
            if found:
                return found
        return None

    return visit(name)


def resolve(name: str, spec: TokenRouteSpec, isvc: Lookup, route: Lookup) -> Resolution:
    """The targets of route ``name`` as found through ``isvc`` and ``route`` (name -> object or None)."""
    def route_targets(n: str) -> list[str]:
        obj = spec.model_dump(by_alias=True) if n == name else ((route(n) or {}).get("spec") or {})
        return [t["tokenRoute"] for t in obj.get("targets") or [] if isinstance(t, dict) and t.get("tokenRoute")]

    problems: list[Problem] = []
    cycle = find_cycle(name, route_targets)
    if cycle:
        problems.append(Problem("RouteCycle", "spec.targets",
                                f"the route reaches itself again: {' -> '.join(cycle)}; remove one of these targets"))
    conflict = isvc(route_child_name(name))
    if conflict is not None:
        problems.append(Problem("NameConflict", "metadata.name", f"InferenceService {route_child_name(name)} owns the "
                                f"Service name this route needs ({route_child_name(name)}); rename one of them"))
    targets = []
    for i, t in enumerate(spec.targets):
        field_ = f"spec.targets[{i}]"
        obj = isvc(t.name) if t.kind == "InferenceService" else route(t.name)
        if obj is None:
            problems.append(Problem("TargetNotFound", f"{field_}.{'inferenceService' if t.inference_service else 'tokenRoute'}",
                                    f"{t.kind} {t.name} does not exist in this namespace; create it or remove the "
                                    "target (requests go to the other targets meanwhile)"))
            targets.append(ResolvedTarget(t.name, t.kind, t.model, None, t.max_concurrent_requests))
            continue
        if t.kind == "InferenceService":
            served = _served(obj)
            model = t.model or (served[0] if served else None)
            if t.model is not None and t.model not in served:
                problems.append(Problem("TargetModelNotServed", f"{field_}.model",
                                        f"InferenceService {t.name} serves {', '.join(served) or 'no model name'}, "
                                        f"not {t.model}"))
            targets.append(ResolvedTarget(t.name, t.kind, model, _parse_isvc(obj), t.max_concurrent_requests))
        else:
            their_model = (obj.get("spec") or {}).get("model")
            model = t.model or their_model
            if t.model is not None and t.model != their_model:
                problems.append(Problem("TargetModelNotServed", f"{field_}.model",
                                        f"TokenRoute {t.name} serves {their_model}, not {t.model}"))
            targets.append(ResolvedTarget(t.name, t.kind, model, None, t.max_concurrent_requests))
    classifier_model, classifier_problem = None, None
    if spec.classifier is not None:
        c = spec.classifier
        obj = isvc(c.inference_service)
        if obj is None:
            classifier_problem = Problem("ClassifierNotFound", "spec.classifier.inferenceService",
                                         f"InferenceService {c.inference_service} does not exist; requests are scored "
                                         "by the rules alone")
        else:
            served = _served(obj)
            classifier_model = c.model or (served[0] if served else None)
    return Resolution(targets, problems, bool(cycle), classifier_model, classifier_problem)


def _ready(reason: str, message: str) -> cond.Desired:
    return cond.Desired("Ready", "True", reason, message)


def compute_route_status(owner: dict[str, Any], spec: TokenRouteSpec, resolution: Resolution,
                         ready_targets: dict[str, bool], router_ready: int, classifier_ready: bool,
                         statuses: dict[str, Any], url: str, old_status: dict[str, Any] | None = None,
                         now: str | None = None) -> dict[str, Any]:
    """``ready_targets``: target -> whether its router has a ready pod; ``router_ready``: ready pods of the
    route's own router; ``statuses``: target -> TargetStatus (builders/token_route.target_status)."""
    old_status = old_status or {}
    now = now or cond.now_rfc3339()
    generation = owner["metadata"].get("generation")
    n_ready = sum(1 for t in resolution.targets if ready_targets.get(t.name))
    problem = resolution.problems[0] if resolution.problems else None
    desired: list[cond.Desired] = []
    resolved = (cond.Desired("TargetsResolved", "False", problem.reason, f"{problem.field}: {problem.message}")
                if problem else cond.Desired("TargetsResolved", "True", "TargetsFound",
                                             f"{len(resolution.targets)} targets found"))
    router = (cond.Desired("RouterReady", "True", "RouterReady", f"{router_ready} router pods ready") if router_ready
              else cond.Desired("RouterReady", "False", "RouterNotReady", "the route's router has no ready pod yet"))
    if resolution.cycle:
        ready = cond.Desired("Ready", "False", "RouteCycle", resolved.message)
    elif not router_ready:
        ready = cond.Desired("Ready", "False", "RouterNotReady", router.message)
    elif not n_ready:
        ready = cond.Desired("Ready", "False", "NoTargetReady", "no target has a ready router pod")
    elif problem:
        ready = _ready("Routing", f"routing over {n_ready} of {len(resolution.targets)} targets; {problem.message}")
    else:
        ready = _ready("Routing", f"routing over {n_ready} of {len(resolution.targets)} targets by {spec.policy}")
    desired = [ready, resolved]
    if spec.classifier is not None:
        if resolution.classifier_problem is not None:
            desired.append(cond.Desired("ClassifierReady", "False", resolution.classifier_problem.reason,
                                        resolution.classifier_problem.message))
        elif not classifier_ready:
            desired.append(cond.Desired("ClassifierReady", "False", "ClassifierNotReady",
                                        f"InferenceService {spec.classifier.inference_service} has no ready router pod;"
                                        " requests are scored by the rules alone"))
        else:
            desired.append(cond.Desired("ClassifierReady", "True", "ClassifierReady",
                                        f"grading with {spec.classifier.inference_service} within "
                                        f"{spec.classifier.timeout_ms} ms, else by the rules"))
    desired.append(router)
    stalled = problem is not None
    working = ready.status != "True" and not stalled
    desired.append(cond.Desired("Reconciling", "True" if working else "False",
                                ready.reason if working else ("Stalled" if stalled else "Routing"),
                                ready.message if working else ""))
    desired.append(cond.Desired("Stalled", "True" if stalled else "False",
                                problem.reason if problem else "Routing",
                                resolved.message if problem else ""))
    status = TokenRouteStatus(
        url=url,
        ready_targets=n_ready,
        targets=[RouteTargetStatus(
            name=t.name, kind=t.kind, model=t.model, ready=bool(ready_targets.get(t.name)),
            cost_per_million_tokens=statuses[t.name].cost_per_mtok if t.name in statuses else None,
            slo_met=statuses[t.name].slo_met if t.name in statuses else None,
            saturated=statuses[t.name].saturated if t.name in statuses else False) for t in resolution.targets],
        observed_generation=generation,
    ).to_wire()
    status["conditions"] = cond.merge(old_status.get("conditions"), desired, now=now, generation=generation)
    return status


def invalid_route_status(owner: dict[str, Any], problem: Problem, old_status: dict[str, Any] | None,
                         now: str | None = None) -> dict[str, Any]:
    """Status of a route whose spec the operator cannot use."""
    old_status = old_status or {}
    generation = owner["metadata"].get("generation")
    message = f"{problem.field}: {problem.message}"
    desired = [cond.Desired("Ready", "False", problem.reason, message),
               cond.Desired("Reconciling", "False", "Stalled", ""),
               cond.Desired("Stalled", "True", problem.reason, message)]
    return {"observedGeneration": generation, "readyTargets": 0,
            "conditions": cond.merge(old_status.get("conditions"), desired, now=now or cond.now_rfc3339(),
                                     generation=generation)}
