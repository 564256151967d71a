"""TokenRoute -> the route's router: a ConfigMap, a Deployment running ``tokenfleet route`` in route mode, and a
Service (``status.url``). All three are named ``<route>-route``.

The ConfigMap has three keys:

- ``router.json``: the route (``contract/route_files.py``): its public model, policy, targets and their served
  model names, difficulty thresholds, classifier, override header and who may send it (with override keys,
  the Secret ``spec.overrideKeysSecretName`` is mounted at ``OVERRIDE_KEYS_MOUNT`` and named there). Part of
  the Deployment's config hash: a change rolls the route's router.
- ``endpoints.json``: the targets' router pods (tier = the target's name) and the classifier's router pods
  (tier ``@classifier``), from the cache; rewritten on every pass, not hashed, re-read by the router.
- ``targets.json``: each target's measured cost per million tokens, whether it meets its SLO now and whether
  it is saturated, from its status (``target_status``); rewritten and re-read like endpoints.json.

The router forwards to the targets' routers, which keep their own replica choice, keys and stream migration
(the route's own migration is off). Each target's model directory is mounted read-only at
``/route-models/<target>`` so that the route's router counts and hashes prompts with that target's own
tokenizer and chat template (``--target-model``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.api.token_route import TokenRouteSpec
from tokenfleet_operator.builders.inference_service import (
    CONFIG_HASH_ANNOTATION,
    ENDPOINTS_KEY,
    ROUTER_CONFIG_KEY,
    ROUTER_CONFIG_MOUNT,
    source_volume,
)
from tokenfleet_operator.builders.security import harden_container, harden_pod_spec
from tokenfleet_operator.naming import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    ROLE_LABEL,
    ROUTE_LABEL,
    ROUTER_PORT,
    SERVICE_LABEL,
    child_metadata,
    revision_of,
)
from tokenfleet_operator.runtimes.base import http_probe
from tokenfleet_serving.contract.route_files import (
    CLASSIFIER_TIER,
    Classifier,
    Difficulty,
    RouteConfig,
    RouteTarget,
    TargetStatus,
    targets_json,
)
from tokenfleet_serving.contract.router_files import Endpoint, RouterConfig, endpoints_json, router_config_json

ROUTE_ROLE = "route"
TARGETS_KEY = "targets.json"
ROUTE_MODELS_MOUNT = "/route-models"
OVERRIDE_KEYS_VOLUME = "override-keys"
OVERRIDE_KEYS_MOUNT = "/var/run/tokenfleet/override-keys"   # spec.overrideKeysSecretName, with override keys
DEFAULT_IMAGE = InferenceServiceSpec.model_fields["image"].default


def route_child_name(route: str) -> str:
    """The route's ConfigMap, Deployment and Service."""
    return f"{route}-route"


def route_labels(route: str) -> dict[str, str]:
    """Labels of the route's children. They carry the service label (with the child's name, which names no
    InferenceService) so that the operator's watches, which select on it, see them."""
    return {MANAGED_BY_LABEL: MANAGED_BY, SERVICE_LABEL: route_child_name(route), ROLE_LABEL: ROUTE_ROLE,
            ROUTE_LABEL: route}


@dataclass(frozen=True)
class ResolvedTarget:
    """A target as the builder needs it: its name, the model name to ask for, and (an InferenceService's) spec."""

    name: str
    kind: str
    model: str | None
    spec: InferenceServiceSpec | None = None      # None: a TokenRoute, or a missing target
    max_concurrent: int | None = None


def route_config(owner: dict[str, Any], spec: TokenRouteSpec, targets: list[ResolvedTarget],
                 classifier_model: str | None) -> dict[str, Any]:
    """router.json of the route's router."""
    d = spec.difficulty
    return router_config_json(RouterConfig(
        service=owner["metadata"]["name"],
        namespace=owner["metadata"]["namespace"],
        models=(spec.model,),
        policy="least-load",                 # among one target's router pods
        migration_limit=0,                   # the targets' routers migrate their own streams
        no_replica_hold_s=0.0,
        route=RouteConfig(
            policy=spec.policy,
            targets=tuple(RouteTarget(t.name, t.model, t.spec.engine.kv_block_size if t.spec else 16,
                                      t.max_concurrent) for t in targets),
            difficulty=Difficulty(d.max_prompt_tokens, d.max_output_tokens, d.max_turns, d.tools, d.response_schema),
            classifier=(Classifier(classifier_model, spec.classifier.timeout_ms / 1000)
                        if spec.classifier is not None else None),
            override_header=spec.override_header.lower(),
            override=spec.override,
            override_keys=OVERRIDE_KEYS_MOUNT if spec.override_keys_secret_name else None,
        ),
    ))


def router_pod_endpoints(pods: list[dict[str, Any]], tier: str) -> list[Endpoint]:
    """Router pods (of a target or the classifier) as endpoints of the route's router."""
    return [Endpoint(pod=p["metadata"]["name"], ip=p["status"]["podIP"], port=ROUTER_PORT, ready=cond.is_ready(p),
                     tier=tier)
            for p in pods
            if (p.get("status") or {}).get("podIP") and not (p.get("metadata") or {}).get("deletionTimestamp")]


def target_status(name: str, obj: dict[str, Any] | None) -> TargetStatus:
    """What the route's router is told of a target, from its status: the windowed cost per million tokens (else
    the measured capacity cost; absent, or a service without a price: unknown), goodput's ``met``, and
    saturated when it is at maxReplicas and asks for more (ScalingLimited=True) or has no ready replica while
    it should have some."""
    if obj is None or obj.get("kind") not in (None, "InferenceService"):
        return TargetStatus(name)
    status = obj.get("status") or {}
    cost = status.get("cost") or {}
    per_mtok = cost.get("costPerMillionTokens")
    if per_mtok is None:
        per_mtok = (cost.get("capacity") or {}).get("costPerMillionTokens")
    if not cost.get("dollarsPerHour"):
        per_mtok = None          # no price set (spec.price all 0): its tokens look free, but their cost is unknown
    met = (status.get("goodput") or {}).get("met")
    wanted = status.get("desiredReplicas")
    saturated = cond.is_true(status.get("conditions"), "ScalingLimited") or (
        bool(wanted) and not status.get("readyReplicas"))
    return TargetStatus(name, float(per_mtok) if per_mtok is not None else None,
                        met if isinstance(met, bool) else None, saturated)


def route_configmap(owner: dict[str, Any], config: dict[str, Any], endpoints: list[Endpoint],
                    statuses: list[TargetStatus]) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, route_child_name(name), route_labels(name)),
        "data": {
            ROUTER_CONFIG_KEY: json.dumps(config, indent=2, sort_keys=True),
            ENDPOINTS_KEY: json.dumps(endpoints_json(endpoints), indent=2, sort_keys=True),
            TARGETS_KEY: json.dumps(targets_json(statuses), indent=2, sort_keys=True),
        },
    }


def target_model_storage(target: ResolvedTarget) -> tuple[list[dict], list[dict], str | None]:
    """(volumes, volumeMounts, directory) of a target's model in the route's router pod; no directory for a
    TokenRoute target (its prompts are counted by characters / 4)."""
    if target.spec is None:
        return [], [], None
    model = target.spec.model
    volume = source_volume(f"model-{target.name}", model)
    if volume is None:
        return [], [], model.path
    mount_path = f"{ROUTE_MODELS_MOUNT}/{target.name}"
    mount = {"name": volume["name"], "mountPath": mount_path, "readOnly": True}
    directory = f"{mount_path}/{model.pvc.sub_path.strip('/')}" if model.pvc and model.pvc.sub_path else mount_path
    return [volume], [mount], directory


def route_deployment(owner: dict[str, Any], spec: TokenRouteSpec, config: dict[str, Any],
                     targets: list[ResolvedTarget], router_image: str = DEFAULT_IMAGE) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    child = route_child_name(name)
    labels = route_labels(name)
    volumes: list[dict] = []
    mounts: list[dict] = []
    args: list[str] = []
    claims: dict[str, str] = {}          # a claim is mounted once per pod
    for t in targets:
        vols, mnts, directory = target_model_storage(t)
        for v, m in zip(vols, mnts):
            claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is not None and claim in claims:
                m = {**m, "name": claims[claim]}
            else:
                volumes.append(v)
                if claim is not None:
                    claims[claim] = v["name"]
            mounts.append(m)
        if directory:
            args += ["--target-model", t.name, directory]
    if spec.override_keys_secret_name:
        volumes.append({"name": OVERRIDE_KEYS_VOLUME, "secret": {"secretName": spec.override_keys_secret_name}})
        mounts.append({"name": OVERRIDE_KEYS_VOLUME, "mountPath": OVERRIDE_KEYS_MOUNT, "readOnly": True})
    pull = next((t.spec.image_pull_policy for t in targets if t.spec is not None), "IfNotPresent")
    container: dict[str, Any] = {
        "name": "router",
        "image": router_image,                  # the operator's --router-image, whatever the targets run
        "imagePullPolicy": pull,
        "command": ["tokenfleet", "route", "--config", f"{ROUTER_CONFIG_MOUNT}/{ROUTER_CONFIG_KEY}",
                    "--host", "0.0.0.0", "--port", str(ROUTER_PORT), *args],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": http_probe("/ready", 5, 3),
        "livenessProbe": http_probe("/health", 10, 3),
        "volumeMounts": [{"name": "config", "mountPath": ROUTER_CONFIG_MOUNT, "readOnly": True}, *mounts],
    }
    harden_container(container)
    if spec.router.resources is not None and spec.router.resources.to_wire():
        container["resources"] = spec.router.resources.to_wire()
    pod_spec = harden_pod_spec({
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": child}}, *volumes],
        "enableServiceLinks": False,
    })
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(owner, child, labels),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": {ROUTE_LABEL: name, ROLE_LABEL: ROUTE_ROLE}},
            "template": {"metadata": {"labels": labels, "annotations": {CONFIG_HASH_ANNOTATION: revision_of(config)}},
                         "spec": pod_spec},
        },
    }


def route_service(owner: dict[str, Any]) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, route_child_name(name), route_labels(name)),
        "spec": {
            "type": "ClusterIP",
            "selector": {ROUTE_LABEL: name, ROLE_LABEL: ROUTE_ROLE},
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def route_url(owner: dict[str, Any]) -> str:
    return f"http://{route_child_name(owner['metadata']['name'])}.{owner['metadata']['namespace']}.svc"


def desired_route_children(owner: dict[str, Any], spec: TokenRouteSpec, targets: list[ResolvedTarget],
                           endpoints: list[Endpoint], statuses: list[TargetStatus],
                           classifier_model: str | None,
                           router_image: str = DEFAULT_IMAGE) -> tuple[dict[str, Any], ...]:
    """The ConfigMap, Deployment and Service of the route, in apply order. ``endpoints``: the targets' and the
    classifier's router pods (``router_pod_endpoints``); ``statuses``: ``target_status`` of each target."""
    config = route_config(owner, spec, targets, classifier_model)
    return (route_configmap(owner, config, endpoints, statuses), route_deployment(owner, spec, config, targets, router_image),
            route_service(owner))


__all__ = ["CLASSIFIER_TIER", "ROUTE_LABEL", "ResolvedTarget", "desired_route_children", "route_child_name",
           "route_url", "router_pod_endpoints", "target_status"]
