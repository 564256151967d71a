"""Which TokenRoutes a watch event concerns beyond ``triggers.py``: the routes that name the changed object as a
target or classifier. An InferenceService's status (its cost, goodput, scaling) and its router pods are what a
route's router is told (targets.json, endpoints.json); a TokenRoute's router pods, and the TokenRoute itself
(a route of routes, a cycle), are what the routes over it are told. Found in the cache, which triggers.py has
no access to."""
from __future__ import annotations

from typing import Any

from tokenfleet_operator.controller.triggers import Key
from tokenfleet_operator.naming import ROLE_LABEL, ROUTE_LABEL, SERVICE_LABEL


def _named(route: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(InferenceServices, TokenRoutes) a route names as targets or classifier."""
    spec = route.get("spec") or {}
    services, routes = set(), set()
    for t in spec.get("targets") or []:
        if isinstance(t, dict):
            if isinstance(t.get("inferenceService"), str):
                services.add(t["inferenceService"])
            if isinstance(t.get("tokenRoute"), str):
                routes.add(t["tokenRoute"])
    classifier = spec.get("classifier")
    if isinstance(classifier, dict) and isinstance(classifier.get("inferenceService"), str):
        services.add(classifier["inferenceService"])
    return services, routes


def routes_naming(cache: Any, kind: str, obj: dict[str, Any]) -> list[Key]:
    meta = obj.get("metadata") or {}
    ns, labels = meta.get("namespace"), meta.get("labels") or {}
    if kind == "InferenceService":
        service, route = meta.get("name"), None
    elif kind == "TokenRoute":
        service, route = None, meta.get("name")
    elif kind == "Pod" and labels.get(ROLE_LABEL) == "router" and SERVICE_LABEL in labels:
        service, route = labels[SERVICE_LABEL], None
    elif kind == "Pod" and ROUTE_LABEL in labels:
        service, route = None, labels[ROUTE_LABEL]
    else:
        return []
    if ns is None:
        return []
    keys: list[Key] = []
    for r in cache.list("TokenRoute", ns):
        services, routes = _named(r)
        if (service is not None and service in services) or (route is not None and route in routes):
            keys.append(("TokenRoute", ns, r["metadata"]["name"]))
    return keys
