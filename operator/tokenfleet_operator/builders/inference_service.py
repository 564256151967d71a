"""InferenceService -> one Slice per replica, a router Deployment, its
ConfigMap, the router Service and a headless Service over the replicas'
leader pods.

The router ConfigMap has two keys: ``router.json`` (how to route; part of the
router Deployment's config hash, so a change rolls the router) and
``endpoints.json`` (the serving pods, from ``endpoints_config``; left out of
the hash, so pods coming and going never roll the router, which re-reads the
mounted file instead).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.naming import (
    LEADER_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    REPLICA_LABEL,
    REVISION_LABEL,
    ROLE_LABEL,
    ROUTER_PORT,
    SERVICE_LABEL,
    SERVING_PORT,
    SLICE_LABEL,
    child_metadata,
    engines_service_name,
    revision_of,
    router_name,
    slice_name,
)

MODEL_MOUNT = "/models"
ROUTER_CONFIG_MOUNT = "/etc/tokenfleet"
ROUTER_CONFIG_KEY = "router.json"
ENDPOINTS_KEY = "endpoints.json"
CONFIG_HASH_ANNOTATION = "tokenfleet.dev/config-hash"


def common_labels(service: str) -> dict[str, str]:
    return {MANAGED_BY_LABEL: MANAGED_BY, SERVICE_LABEL: service}


def serving_selector(service: str) -> dict[str, str]:
    """Labels of the pods that answer requests: the leader (member 0) of every replica."""
    return {SERVICE_LABEL: service, ROLE_LABEL: "serve", LEADER_LABEL: "true"}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def model_storage(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict], str]:
    """(volumes, volumeMounts, model directory inside the container) for the model source."""
    model = spec.model
    if model.pvc is not None:
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": model.pvc.claim_name, "readOnly": True}}
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        directory = f"{MODEL_MOUNT}/{model.pvc.sub_path.strip('/')}" if model.pvc.sub_path else MODEL_MOUNT
        return [volume], [mount], directory
    if model.host_path is not None:
        volume = {"name": "model", "hostPath": {"path": model.host_path.path, "type": "Directory"}}
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        return [volume], [mount], MODEL_MOUNT
    assert model.path is not None, "the schema requires exactly one model source"
    return [], [], model.path


def engine_args(spec: InferenceServiceSpec, model_dir: str) -> list[str]:
    """Command line of the serving container: 'tokenfleet serve' plus the engine flags."""
    eng = spec.engine
    args = ["tokenfleet", "serve", "--model", model_dir, "--host", "0.0.0.0", "--port", str(SERVING_PORT)]
    for name in spec.model.served_model_names:
        args += ["--served-model-name", name]
    args += ["--dtype", eng.dtype, "--block-size", str(eng.kv_block_size), "--max-num-seqs", str(eng.max_num_seqs)]
    if eng.max_model_len is not None:
        args += ["--max-model-len", str(eng.max_model_len)]
    if eng.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(eng.max_num_batched_tokens)]
    if not eng.enable_prefix_caching:
        args.append("--no-prefix-caching")
    if eng.quantization != "none":
        args += ["--quantization", eng.quantization]
    if eng.speculative_decoding is not None:
        sd = eng.speculative_decoding
        args += ["--speculative-method", sd.method, "--num-speculative-tokens", str(sd.num_speculative_tokens)]
        if sd.draft_model:
            args += ["--speculative-draft-model", sd.draft_model]
    per_replica = hourly_cost(spec, 1)
    if per_replica > 0:
        args += ["--price-per-hour", f"{per_replica:g}"]
    args += list(eng.extra_args or [])
    return args


def _http_probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures}


def serving_container(spec: InferenceServiceSpec, model_dir: str, mounts: list[dict]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": engine_args(spec, model_dir),
        "ports": [{"name": "http", "containerPort": SERVING_PORT, "protocol": "TCP"}],
        # Loading weights can take many minutes: the startup probe allows 30 of them.
        "startupProbe": _http_probe("/health", "http", 5, 360),
        "livenessProbe": _http_probe("/health", "http", 10, 3),
        "readinessProbe": _http_probe("/ready", "http", 5, 3),
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    resources = spec.resources.to_wire()
    if resources:
        container["resources"] = resources
    if mounts:
        container["volumeMounts"] = mounts
    return container


def slice_spec(service: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The Slice spec of every replica (identical across replicas)."""
    volumes, mounts, model_dir = model_storage(spec)
    pod_spec: dict[str, Any] = {
        "containers": [serving_container(spec, model_dir, mounts)],
        "terminationGracePeriodSeconds": 30,
        "enableServiceLinks": False,
    }
    if volumes:
        pod_spec["volumes"] = volumes
    policy = spec.slice_policy
    out: dict[str, Any] = {
        "accelerator": {
            "type": spec.accelerator.type,
            "resourceName": spec.accelerator.resource_name,
            "countPerHost": spec.accelerator.count_per_host,
        },
        "hosts": spec.accelerator.hosts_per_replica,
        "topologyKey": policy.topology_key,
        "priority": policy.priority,
        "queue": policy.queue,
        "role": "serve",
        "template": {"metadata": {"labels": common_labels(service)}, "spec": pod_spec},
        "restartPolicy": policy.restart_policy.to_wire(),
    }
    if spec.accelerator.topology:
        out["topology"] = spec.accelerator.topology
    if policy.checkpoint is not None:
        out["checkpoint"] = policy.checkpoint.to_wire()
    return out


def slice_revision(service: str, spec: InferenceServiceSpec) -> str:
    return revision_of(slice_spec(service, spec))


def slice_manifest(owner: dict[str, Any], spec: InferenceServiceSpec, index: int) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    body = slice_spec(name, spec)
    labels = common_labels(name) | {REPLICA_LABEL: str(index), REVISION_LABEL: revision_of(body)}
    return {
        "apiVersion": API_VERSION,
        "kind": "Slice",
        "metadata": child_metadata(owner, slice_name(name, index), labels),
        "spec": body,
    }


def router_config(owner: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """What the router needs to know: how to choose a replica (the replicas themselves are in endpoints.json)."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    routing = spec.routing
    _, _, model_dir = model_storage(spec)
    return {
        "service": name,
        "namespace": namespace,
        "models": list(spec.model.served_model_names),
        "backends": {
            "dns": f"{engines_service_name(name)}.{namespace}.svc",
            "port": SERVING_PORT,
            "labelSelector": selector_string(serving_selector(name)),
        },
        "policy": routing.policy,
        "sessionAffinity": routing.session_affinity.to_wire(),
        "kvBlockSize": spec.engine.kv_block_size,
        # The router loads the tokenizer from here to hash prompts into the engine's prefix blocks.
        "modelPath": model_dir,
        "slo": spec.slo.to_wire(),
        "price": {"perReplicaHour": hourly_cost(spec, 1), "currency": spec.price.currency},
    }


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def endpoints_config(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """endpoints.json: the serving pods the router may send requests to, sorted by pod name.

    ``pods`` are the leader pods of the replicas (``serving_selector``). A pod
    without an IP yet, or being deleted, is left out; ``ready`` is the pod's
    Ready condition (the router polls the pod itself too)."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or meta.get("deletionTimestamp"):
            continue
        out.append({
            "pod": meta["name"],
            "slice": (meta.get("labels") or {}).get(SLICE_LABEL, ""),
            "ip": ip,
            "port": SERVING_PORT,
            "ready": _pod_ready(pod),
        })
    return sorted(out, key=lambda e: e["pod"])


def router_configmap(owner: dict[str, Any], spec: InferenceServiceSpec,
                     endpoints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    text = json.dumps(router_config(owner, spec), indent=2, sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, router_name(name), common_labels(name) | {ROLE_LABEL: "router"}),
        "data": {ROUTER_CONFIG_KEY: text, ENDPOINTS_KEY: json.dumps(endpoints or [], indent=2, sort_keys=True)},
    }


def router_deployment(owner: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    labels = common_labels(name) | {ROLE_LABEL: "router"}
    config_hash = revision_of(router_config(owner, spec))  # endpoints.json is deliberately not in it
    volumes, model_mounts, model_dir = model_storage(spec)
    container: dict[str, Any] = {
        "name": "router",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        # --model repeats router.json's modelPath on the command line, where a
        # runner that relocates mounts (the local pod runner) can rewrite it.
        "command": [
            "tokenfleet", "route",
            "--config", f"{ROUTER_CONFIG_MOUNT}/{ROUTER_CONFIG_KEY}",
            "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
            "--model", model_dir,
        ],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": _http_probe("/ready", "http", 5, 3),
        "livenessProbe": _http_probe("/health", "http", 10, 3),
        "volumeMounts": [{"name": "config", "mountPath": ROUTER_CONFIG_MOUNT, "readOnly": True}, *model_mounts],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    if spec.routing.resources is not None and spec.routing.resources.to_wire():
        container["resources"] = spec.routing.resources.to_wire()
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(owner, router_name(name), labels),
        "spec": {
            "replicas": spec.routing.replicas,
            "selector": {"matchLabels": {SERVICE_LABEL: name, ROLE_LABEL: "router"}},
            "template": {
                "metadata": {"labels": labels, "annotations": {CONFIG_HASH_ANNOTATION: config_hash}},
                "spec": {
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": router_name(name)}}, *volumes],
                    "enableServiceLinks": False,
                },
            },
        },
    }


def router_service(owner: dict[str, Any]) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, name, common_labels(name) | {ROLE_LABEL: "router"}),
        "spec": {
            "type": "ClusterIP",
            "selector": {SERVICE_LABEL: name, ROLE_LABEL: "router"},
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def engines_service(owner: dict[str, Any]) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, engines_service_name(name), common_labels(name) | {ROLE_LABEL: "serve"}),
        "spec": {
            "clusterIP": "None",
            "selector": serving_selector(name),
            "ports": [{"name": "http", "port": SERVING_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def service_url(owner: dict[str, Any]) -> str:
    return f"http://{owner['metadata']['name']}.{owner['metadata']['namespace']}.svc"


@dataclass(frozen=True)
class Children:
    """Everything one InferenceService owns, except which Slices to touch (see rollout)."""

    revision: str
    slices: tuple[dict[str, Any], ...]  # index i -> manifest of replica i at the current revision
    others: tuple[dict[str, Any], ...]  # ConfigMap, Deployment, Services, in apply order


def desired_children(owner: dict[str, Any], spec: InferenceServiceSpec,
                     endpoints: list[dict[str, Any]] | None = None) -> Children:
    """``endpoints`` is ``endpoints_config`` of the service's serving pods (the router ConfigMap carries it)."""
    name = owner["metadata"]["name"]
    return Children(
        revision=slice_revision(name, spec),
        slices=tuple(slice_manifest(owner, spec, i) for i in range(spec.replicas)),
        others=(
            router_configmap(owner, spec, endpoints),
            router_deployment(owner, spec),
            router_service(owner),
            engines_service(owner),
        ),
    )


def hourly_cost(spec: InferenceServiceSpec, replicas: int) -> float:
    """Dollars per hour of `replicas` replicas at the spec's prices."""
    accelerators = 0 if spec.accelerator.type == "cpu" else spec.accelerator.count_per_host * spec.accelerator.hosts_per_replica
    per_replica = accelerators * spec.price.accelerator_per_hour + spec.price.overhead_per_hour
    return round(replicas * per_replica, 6)
