"""Reconcile one TokenRoute: resolve its targets, apply its router's children, write its status.

Inputs come from the cache: the route, its targets (InferenceServices and TokenRoutes) with their status
(cost, goodput, scaling) and router pods, the classifier's router pods, and the route's own Deployment. The
targets' state reaches the route's router through its ConfigMap (endpoints.json and targets.json, re-read by
the router every second), rewritten whenever it changes: a target's status or router pods changing queue the
routes that name it (``controller/route_triggers.py``). A route cycle applies nothing; a missing target leaves
the route serving the others.
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from tokenfleet_operator import conditions as cond
from tokenfleet_operator import metrics
from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.api.inference_service import DEFAULT_IMAGE
from tokenfleet_operator.api.token_route import TokenRouteSpec
from tokenfleet_operator.builders.token_route import (
    CLASSIFIER_TIER,
    ROUTE_LABEL,
    desired_route_children,
    route_child_name,
    route_url,
    router_pod_endpoints,
    target_status,
)
from tokenfleet_operator.controller.errors import InvalidSpec
from tokenfleet_operator.controller.manager import Context
from tokenfleet_operator.inference_service_status import deployment_ready_replicas
from tokenfleet_operator.kube import KubeError
from tokenfleet_operator.naming import ROLE_LABEL, SERVICE_LABEL
from tokenfleet_operator.reconcile.drift import needs_apply
from tokenfleet_operator.token_route_status import compute_route_status, invalid_route_status, resolve
from tokenfleet_operator.validation import Problem

log = logging.getLogger("tokenfleet.tokenroute")


def router_pods(ctx: Context, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
    """The router pods of an InferenceService, or the route-router pods of a TokenRoute."""
    if kind == "InferenceService":
        return [p for p in ctx.cache.by_label("Pod", namespace, SERVICE_LABEL, name)
                if (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == "router"]
    return [p for p in ctx.cache.by_label("Pod", namespace, SERVICE_LABEL, route_child_name(name))
            if (p["metadata"].get("labels") or {}).get(ROUTE_LABEL) == name]


def _write_status(ctx: Context, body: dict[str, Any], status: dict[str, Any]) -> None:
    old = body.get("status") or {}
    if status == old:
        return
    ctx.apply_status(body, status)
    for t in cond.transitions(old.get("conditions"), status["conditions"]):
        if t.type == "Ready" and not (t.old_status is None and t.reason == "RouterNotReady"):
            ctx.event(body, "Normal" if t.new_status == "True" else "Warning", t.reason, t.message)
        elif t.type in ("TargetsResolved", "ClassifierReady") and t.new_status == "False":
            ctx.event(body, "Warning", t.reason, t.message)


def reconcile_token_route(ctx: Context, namespace: str, name: str, router_image: str = DEFAULT_IMAGE) -> float | None:
    """One level-based pass; returns None (the targets' changes and the resync bring it back). ``router_image``:
    the image of the route's router Deployment (the operator's --router-image)."""
    cached = ctx.cache.get("TokenRoute", namespace, name)
    if cached is None or cached["metadata"].get("deletionTimestamp"):
        return None
    body = {**cached, "apiVersion": API_VERSION, "kind": "TokenRoute"}
    owner = {"apiVersion": API_VERSION, "kind": "TokenRoute", "metadata": body["metadata"]}
    old_status = body.get("status") or {}
    try:
        spec = TokenRouteSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        first = e.errors()[0]
        problem = Problem("InvalidSpec", "spec." + ".".join(str(p) for p in first["loc"]), first["msg"])
        _write_status(ctx, body, invalid_route_status(owner, problem, old_status))
        raise InvalidSpec(problem) from None

    def isvc(n: str) -> dict[str, Any] | None:
        return ctx.cache.get("InferenceService", namespace, n)

    def route(n: str) -> dict[str, Any] | None:
        return ctx.cache.get("TokenRoute", namespace, n)

    resolution = resolve(name, spec, isvc, route)
    endpoints = []
    ready: dict[str, bool] = {}
    statuses = {}
    for t in resolution.targets:
        pods = router_pods(ctx, namespace, t.kind, t.name)
        eps = router_pod_endpoints(pods, t.name)
        endpoints += eps
        ready[t.name] = any(e.ready for e in eps)
        statuses[t.name] = target_status(t.name, isvc(t.name) if t.kind == "InferenceService" else None)
    classifier_ready = False
    if spec.classifier is not None and resolution.classifier_problem is None:
        eps = router_pod_endpoints(router_pods(ctx, namespace, "InferenceService", spec.classifier.inference_service),
                                   CLASSIFIER_TIER)
        endpoints += eps
        classifier_ready = any(e.ready for e in eps)

    deployment = ctx.cache.get("Deployment", namespace, route_child_name(name))
    first_error: KubeError | None = None
    if not resolution.cycle:
        for manifest in desired_route_children(owner, spec, resolution.targets, endpoints,
                                               [statuses[t.name] for t in resolution.targets],
                                               resolution.classifier_model, router_image):
            current = ctx.cache.get(manifest["kind"], namespace, manifest["metadata"]["name"])
            if not needs_apply(manifest, current):
                continue
            try:
                current = ctx.apply(manifest)
            except KubeError as e:
                log.warning("TokenRoute %s/%s: cannot apply %s %s: %s", namespace, name, manifest["kind"],
                            manifest["metadata"]["name"], e)
                first_error = first_error or e
                continue
            metrics.CHILDREN_APPLIED.labels(kind=manifest["kind"]).inc()
            if manifest["kind"] == "Deployment":
                deployment = current
    status = compute_route_status(owner, spec, resolution, ready, deployment_ready_replicas(deployment),
                                  classifier_ready, statuses, route_url(owner), old_status)
    _write_status(ctx, body, status)
    if first_error is not None:
        raise first_error
    return None
