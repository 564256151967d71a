"""InferenceService -> one Slice per replica, a router Deployment, its
ConfigMap, the router Service, the router's PodDisruptionBudget
(``router_availability.py``) and a headless Service over the replicas'
leader pods.

A replica is one model split over all accelerators of its Slice
(``parallelism.py``): one rank per accelerator, countPerHost ranks in each
member pod. With several hosts the leader (member 0) runs the API and rank 0;
the other members run headless and join the leader at its address in the
Slice's headless Service. What the containers run (command line, probes, the
replica key's name) is the spec's runtime's (``runtimes/``); the router runs
from the operator's own image (``Wiring.router_image``) whatever the replicas
run, told which runtime they speak.

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

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.api.model_source import ModelSource
from tokenfleet_operator.builders.adapters import adapter_volumes, adapters_configmap, lora_enabled
from tokenfleet_operator.builders.auth import (
    NO_WIRING,
    Wiring,
    client_keys_args,
    client_keys_mount,
    client_keys_volume,
    key_annotations,
    replica_key_env,
    replicas_network_policy,
)
from tokenfleet_operator.builders.router_availability import (
    router_disruption_budget,
    router_grace_seconds,
    router_spreading,
    router_strategy,
)
from tokenfleet_operator.builders.security import harden_container, harden_pod_spec
from tokenfleet_operator.builders.slice_pods import RENDEZVOUS_PORT
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
from tokenfleet_operator.parallelism import ParallelSizes, SizeError, parallel_sizes
from tokenfleet_operator.runtimes import Launch, runtime_of
from tokenfleet_operator.runtimes.base import http_probe
from tokenfleet_serving.contract.router_files import (
    Endpoint,
    RouterConfig,
    ScaleFromZero,
    SessionAffinity,
    Slo,
    endpoints_json,
    router_config_json,
)

MODEL_MOUNT = "/models"
DRAFT_MODEL_MOUNT = "/draft-model"
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


def source_volume(name: str, source: ModelSource) -> dict[str, Any] | None:
    """The read-only volume of a model source (None for a path inside the image). Every model source is
    mounted through here, after ``validation.model_source_problems`` has passed its host path."""
    if source.pvc is not None:
        return {"name": name, "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True}}
    if source.host_path is not None:
        return {"name": name, "hostPath": {"path": source.host_path.path, "type": "Directory"}}
    return None


def model_storage(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict], str]:
    """(volumes, volumeMounts, model directory inside the container) for the model source."""
    model = spec.model
    volume = source_volume("model", model)
    if volume is None:
        assert model.path is not None, "the schema requires exactly one model source"
        return [], [], model.path
    mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    directory = f"{MODEL_MOUNT}/{model.pvc.sub_path.strip('/')}" if model.pvc and model.pvc.sub_path else MODEL_MOUNT
    return [volume], [mount], directory


def draft_model_storage(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict], str | None]:
    """(volumes, volumeMounts, draft model directory inside the container) for a draft model (method draft);
    a draft on the model's own claim mounts that claim's volume a second time, at another subPath."""
    sd = spec.engine.speculative_decoding
    source = sd.draft_model if sd is not None else None
    if source is None:
        return [], [], None
    volume = source_volume("draft-model", source)
    if volume is None:
        return [], [], source.path
    mount: dict[str, Any] = {"name": "draft-model", "mountPath": DRAFT_MODEL_MOUNT, "readOnly": True}
    volumes = [volume]
    if source.pvc is not None:
        if spec.model.pvc is not None and spec.model.pvc.claim_name == source.pvc.claim_name:
            mount["name"] = "model"                         # the model's volume: a claim is mounted once per pod
            volumes = []
        if source.pvc.sub_path:
            mount["subPath"] = source.pvc.sub_path.strip("/")
    return volumes, [mount], DRAFT_MODEL_MOUNT


def replica_sizes(spec: InferenceServiceSpec) -> ParallelSizes:
    """The replica's parallel sizes; a spec whose sizes do not fit its accelerators (refused by the schema and
    by validation before anything is built) falls back to one rank per host."""
    try:
        return parallel_sizes(spec)
    except SizeError:
        hosts = spec.accelerator.hosts_per_replica
        return ParallelSizes(hosts, 1, hosts)


def launch(spec: InferenceServiceSpec, model_dir: str, member: int = 0) -> Launch:
    """What the runtime's command line is made of beyond the spec (``runtimes/base.py``)."""
    return Launch(model_dir=model_dir, sizes=replica_sizes(spec), member=member,
                  draft_model_dir=draft_model_storage(spec)[2], port=SERVING_PORT,
                  price_per_replica_hour=hourly_cost(spec, 1), rendezvous_port=RENDEZVOUS_PORT)


def engine_args(spec: InferenceServiceSpec, model_dir: str, member: int = 0, with_extra_args: bool = True) -> list[str]:
    """Command line of the serving container, from the spec's runtime (``runtimes/``); ``member`` 0 is the
    leader (the only member of a one-host replica), any other value stands for a headless member.
    ``with_extra_args`` False leaves engine.extraArgs (which every runtime appends last) off the end: what the
    operator itself sets."""
    args = runtime_of(spec).command(spec, launch(spec, model_dir, member))
    extra = len(spec.engine.extra_args or [])
    return args[:-extra] if extra and not with_extra_args else args


def serving_container(spec: InferenceServiceSpec, model_dir: str, mounts: list[dict], service: str,
                      member: int = 0) -> dict[str, Any]:
    """The engine container of the leader (``member`` 0) or of a headless member (any other value), as the
    spec's runtime runs it: its command line, probes and the replica key under the name it reads."""
    runtime = runtime_of(spec)
    how = launch(spec, model_dir, member)
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": runtime.command(spec, how),
        "ports": [{"name": "http", "containerPort": SERVING_PORT, "protocol": "TCP"}],
        **runtime.probes(how).to_container(),
        "env": runtime.env(replica_key_env(service)["valueFrom"]),  # the router's key, from the service's Secret
    }
    resources = spec.resources.to_wire()
    events = runtime.kv_events(spec)
    if events is not None and how.leader:
        container["ports"] += events.container_ports()
    if resources:
        container["resources"] = resources
    if mounts:
        container["volumeMounts"] = mounts
    return harden_container(container)


def slice_spec(service: str, spec: InferenceServiceSpec, wiring: Wiring = NO_WIRING) -> dict[str, Any]:
    """The Slice spec of every replica (identical across replicas)."""
    volumes, mounts, model_dir = model_storage(spec)
    draft_volumes, draft_mounts, _ = draft_model_storage(spec)
    adapter_vols, adapter_mounts, _ = adapter_volumes(service, spec)
    volumes, mounts = volumes + draft_volumes + adapter_vols, mounts + draft_mounts + adapter_mounts
    template_meta: dict[str, Any] = {"labels": common_labels(service)}
    if key_annotations(wiring):
        template_meta["annotations"] = key_annotations(wiring)

    def template(member: int) -> dict[str, Any]:
        engine_volumes, engine_mounts = runtime_of(spec).volumes(launch(spec, model_dir, member))
        pod_spec: dict[str, Any] = {
            "containers": [serving_container(spec, model_dir, mounts + engine_mounts, service, member)],
            "terminationGracePeriodSeconds": 30,
            "enableServiceLinks": False,
        }
        if volumes or engine_volumes:
            pod_spec["volumes"] = volumes + engine_volumes
        harden_pod_spec(pod_spec)
        return {"metadata": template_meta, "spec": pod_spec}

    policy = spec.slice_policy
    multi_host = spec.accelerator.hosts_per_replica > 1
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
        "template": template(1 if multi_host else 0),      # with several hosts: the headless members
        "restartPolicy": policy.restart_policy.to_wire(),
    }
    if multi_host:
        out["leaderTemplate"] = template(0)
    if spec.accelerator.topology:
        out["topology"] = spec.accelerator.topology
    if policy.checkpoint is not None:
        out["checkpoint"] = policy.checkpoint.to_wire()
    return out


def slice_revision(service: str, spec: InferenceServiceSpec, wiring: Wiring = NO_WIRING) -> str:
    return revision_of(slice_spec(service, spec, wiring))


def slice_manifest(owner: dict[str, Any], spec: InferenceServiceSpec, index: int, wiring: Wiring = NO_WIRING) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    body = slice_spec(name, spec, wiring)
    labels = common_labels(name) | {REPLICA_LABEL: str(index), REVISION_LABEL: revision_of(body)}
    return {
        "apiVersion": API_VERSION,
        "kind": "Slice",
        "metadata": child_metadata(owner, slice_name(name, index), labels),
        "spec": body,
    }


def router_config(owner: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """router.json (``contract.router_files``): how to choose a replica (the replicas are in endpoints.json)."""
    routing, affinity = spec.routing, spec.routing.session_affinity
    _, _, model_dir = model_storage(spec)
    return router_config_json(RouterConfig(
        service=owner["metadata"]["name"],
        namespace=owner["metadata"]["namespace"],
        models=tuple(spec.model.served_model_names),
        policy=routing.policy,
        load_factor=routing.load_factor,
        load_slack=routing.load_slack,
        session_affinity=SessionAffinity(affinity.enabled, affinity.header.lower(), affinity.ttl_seconds),
        kv_block_size=spec.engine.kv_block_size,
        model_path=model_dir,       # the router loads the tokenizer from here to hash prompts into prefix blocks
        price_per_replica_hour=hourly_cost(spec, 1),
        currency=spec.price.currency,
        slo=Slo(spec.slo.time_to_first_token_ms, spec.slo.time_per_output_token_ms, float(spec.slo.percentile)),
        scale_from_zero=(ScaleFromZero(spec.autoscaling.max_pending_requests, spec.autoscaling.pending_timeout_seconds)
                         if spec.max_replicas is not None and spec.min_replicas == 0 else None),
        migration_limit=routing.migration_limit,
        no_replica_hold_s=float(routing.no_replica_hold_seconds),
        max_recorded_blocks=routing.max_recorded_blocks,
        **kv_events_fields(spec),
    ))


def kv_events_fields(spec: InferenceServiceSpec) -> dict[str, Any]:
    """router.json's prefixSource and KV-event ports: set when the replicas publish KV events to follow."""
    events = runtime_of(spec).kv_events(spec)
    return {} if events is None else {"prefix_source": "kvEvents", "kv_events_port": events.publish,
                                      "kv_events_replay_port": events.replay}


def endpoints_config(pods: list[dict[str, Any]], draining: set[str] | frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """endpoints.json (``contract.router_files``): the serving pods the router may send requests to, sorted by
    pod name.

    ``pods`` are the leader pods of the replicas (``serving_selector``). A pod without an IP yet, or being
    deleted, is left out; ``ready`` is the pod's Ready condition (the router polls the pod itself too); a pod of
    a Slice in ``draining`` is marked so (the router sends it no new request)."""
    return endpoints_json([
        Endpoint(pod=pod["metadata"]["name"], ip=pod["status"]["podIP"], port=SERVING_PORT, ready=cond.is_ready(pod),
                 slice=(slice_ := (pod["metadata"].get("labels") or {}).get(SLICE_LABEL, "")),
                 draining=slice_ in draining)
        for pod in pods
        if (pod.get("status") or {}).get("podIP") and not (pod.get("metadata") or {}).get("deletionTimestamp")
    ])


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


def router_selector(service: str) -> dict[str, str]:
    """The labels that pick a service's router pods (its Service, Deployment and PodDisruptionBudget)."""
    return {SERVICE_LABEL: service, ROLE_LABEL: "router"}


def router_deployment(owner: dict[str, Any], spec: InferenceServiceSpec, wiring: Wiring = NO_WIRING) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    labels = common_labels(name) | {ROLE_LABEL: "router"}
    config_hash = revision_of(router_config(owner, spec))  # endpoints.json is deliberately not in it
    volumes, model_mounts, model_dir = model_storage(spec)
    container: dict[str, Any] = {
        "name": "router",
        "image": wiring.router_image,           # the operator's --router-image, whatever the replicas run
        "imagePullPolicy": spec.image_pull_policy,
        # --model repeats router.json's modelPath on the command line, where a
        # runner that relocates mounts (the local pod runner) can rewrite it.
        "command": [
            "tokenfleet", "route",
            "--config", f"{ROUTER_CONFIG_MOUNT}/{ROUTER_CONFIG_KEY}",
            "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
            "--model", model_dir,
            "--drain-timeout", str(spec.routing.drain_seconds),
            *runtime_of(spec).router_args,
            *client_keys_args(spec),
        ],
        "env": [replica_key_env(name)],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": http_probe("/ready", 5, 3),
        "livenessProbe": http_probe("/health", 10, 3),
        "volumeMounts": [{"name": "config", "mountPath": ROUTER_CONFIG_MOUNT, "readOnly": True}, *model_mounts,
                         *client_keys_mount(spec)],
    }
    harden_container(container)
    if spec.routing.resources is not None and spec.routing.resources.to_wire():
        container["resources"] = spec.routing.resources.to_wire()
    pod_spec: dict[str, Any] = harden_pod_spec({
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": router_name(name)}}, *volumes, *client_keys_volume(spec)],
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": router_grace_seconds(spec.routing.drain_seconds),
        "topologySpreadConstraints": router_spreading(router_selector(name)),
    })
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(owner, router_name(name), labels),
        "spec": {
            "replicas": spec.routing.replicas,
            "strategy": router_strategy(),
            "selector": {"matchLabels": router_selector(name)},
            "template": {
                "metadata": {"labels": labels,
                             "annotations": {CONFIG_HASH_ANNOTATION: config_hash, **key_annotations(wiring)}},
                "spec": pod_spec,
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
            "selector": router_selector(name),
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
    others: tuple[dict[str, Any], ...]  # ConfigMaps (adapters, router), Deployment, Services, PDB, in apply order


def desired_children(owner: dict[str, Any], spec: InferenceServiceSpec,
                     endpoints: list[dict[str, Any]] | None = None, wiring: Wiring = NO_WIRING,
                     replicas: int | None = None) -> Children:
    """``endpoints`` is ``endpoints_config`` of the service's serving pods (the router ConfigMap carries it);
    ``wiring`` the replica key's identity and the operator's namespace (``builders.auth``); ``replicas`` the
    count to run (the autoscaler's choice; default spec.replicas)."""
    name = owner["metadata"]["name"]
    return Children(
        revision=slice_revision(name, spec, wiring),
        slices=tuple(slice_manifest(owner, spec, i, wiring)
                     for i in range(spec.replicas if replicas is None else replicas)),
        others=(
            *([adapters_configmap(owner, spec, common_labels(name))] if lora_enabled(spec) else []),
            router_configmap(owner, spec, endpoints),
            router_deployment(owner, spec, wiring),
            router_service(owner),
            router_disruption_budget(owner, common_labels(name) | {ROLE_LABEL: "router"}, router_selector(name)),
            engines_service(owner),
            replicas_network_policy(owner, wiring, runtime_of(spec).kv_events(spec)),
        ),
    )


def accelerators_per_replica(spec: InferenceServiceSpec) -> int:
    """Accelerators one replica holds (0 for ``cpu``)."""
    return 0 if spec.accelerator.type == "cpu" else spec.accelerator.count_per_host * spec.accelerator.hosts_per_replica


def hourly_cost(spec: InferenceServiceSpec, replicas: int) -> float:
    """Dollars per hour of `replicas` replicas at the spec's prices."""
    per_replica = accelerators_per_replica(spec) * spec.price.accelerator_per_hour + spec.price.overhead_per_hour
    return round(replicas * per_replica, 6)
