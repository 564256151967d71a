"""Slice -> member pod manifests.

Member i of attempt a is the pod SLICE-i labelled with the attempt and the
spec revision. The first container is the main one: it gets the accelerator
request and the TOKENFLEET_* environment. Pods never restart in place
(restartPolicy Never): a member that fails fails the gang, and the Slice
controller restarts all members together.

A Slice of several hosts gets a headless Service named like the Slice that
selects its members and publishes them before they are ready; each member pod
has hostname SLICE-i and subdomain SLICE, so every member resolves the leader
at SLICE-0.SLICE.NAMESPACE.svc (TOKENFLEET_LEADER_ADDRESS) while the gang
forms, as in LeaderWorkerSet. The leader (member 0) is made from
leaderTemplate when the Slice has one.

A checkpoint store on a volume (pvc:// or hostpath://) is mounted into the
main container at CHECKPOINT_MOUNT; TOKENFLEET_CHECKPOINT_DIR names the
directory the members share there (for file:// stores, the path itself).
"""
from __future__ import annotations

import copy
from typing import Any

from tokenfleet_operator.api.slice import SliceSpec
from tokenfleet_operator.builders.security import keep_last_words
from tokenfleet_operator.naming import (
    ACCELERATOR_NODE_LABEL,
    ATTEMPT_LABEL,
    COMPONENT_LABEL,
    LEADER_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    MEMBER_LABEL,
    REVISION_LABEL,
    ROLE_LABEL,
    SLICE_LABEL,
    child_metadata,
    member_address,
    member_pod_name,
    rendezvous_service_name,
)
from tokenfleet_serving.contract.pod_env import PodEnv

CHECKPOINT_MOUNT = "/var/run/tokenfleet/checkpoints"
CHECKPOINT_VOLUME = "tokenfleet-checkpoints"


def checkpoint_volume(store: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the pod volume, the members' directory) for a checkpoint store URI (pvc://, hostpath:// or file://: the
    schema refuses any other)."""
    scheme, _, rest = store.partition("://")
    if scheme == "pvc":
        claim, _, sub = rest.partition("/")
        return ({"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": claim}},
                f"{CHECKPOINT_MOUNT}/{sub}".rstrip("/"))
    if scheme == "hostpath":
        return ({"name": CHECKPOINT_VOLUME, "hostPath": {"path": rest, "type": "DirectoryOrCreate"}}, CHECKPOINT_MOUNT)
    if scheme == "file":
        return None, rest
    return None, None


RENDEZVOUS_PORT = 29500       # where the leader of a multi-host workload listens for its members (torch's default)


def rendezvous_service(owner: dict[str, Any], spec: SliceSpec) -> dict[str, Any] | None:
    """The headless Service that gives the members of a multi-host Slice their DNS names (None for one host).
    It publishes members that are not ready yet: the members resolve the leader to form the gang, and only a
    formed gang gets ready."""
    if spec.hosts < 2:
        return None
    name = owner["metadata"]["name"]
    labels = {MANAGED_BY_LABEL: MANAGED_BY, SLICE_LABEL: name, COMPONENT_LABEL: "rendezvous"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, rendezvous_service_name(name), labels),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {SLICE_LABEL: name},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT,
                       "protocol": "TCP"}],
        },
    }


def member_env(slice_name: str, namespace: str, spec: SliceSpec, member: int, attempt: int,
               restore_from: str | None, revision: str) -> list[dict[str, str]]:
    """The ``contract.pod_env`` environment of one member."""
    values: dict[PodEnv, str] = {
        PodEnv.SLICE: slice_name,
        PodEnv.MEMBER_INDEX: str(member),
        PodEnv.SLICE_HOSTS: str(spec.hosts),
        PodEnv.LEADER_POD: member_pod_name(slice_name, 0),
        PodEnv.ATTEMPT: str(attempt),
        PodEnv.REVISION: revision,
    }
    if spec.hosts > 1:
        values[PodEnv.LEADER_ADDRESS] = member_address(slice_name, 0, namespace)
    if spec.topology:
        values[PodEnv.TOPOLOGY] = spec.topology
    if spec.checkpoint is not None:
        values[PodEnv.CHECKPOINT_STORE] = spec.checkpoint.store
        values[PodEnv.CHECKPOINT_INTERVAL_SECONDS] = str(spec.checkpoint.interval_seconds)
        directory = checkpoint_volume(spec.checkpoint.store)[1]
        if directory:
            values[PodEnv.CHECKPOINT_DIR] = directory
        if restore_from:
            values[PodEnv.RESTORE_FROM] = restore_from
    return [{"name": name.value, "value": value} for name, value in values.items()]


def with_accelerator(container: dict[str, Any], spec: SliceSpec) -> None:
    """The main container requests (and is limited to) countPerHost accelerators."""
    if spec.accelerator.type == "cpu":
        return
    resources = container.setdefault("resources", {})
    count = str(spec.accelerator.count_per_host)
    for kind in ("requests", "limits"):
        resources.setdefault(kind, {})[spec.accelerator.resource_name] = count


def _with_colocation(pod_spec: dict[str, Any], slice_name: str, spec: SliceSpec) -> None:
    """Simple placement: ask the default scheduler to keep the members in one
    topology domain. Preferred, not required, so members still schedule on
    nodes without the label; the gang placer binds nodes explicitly instead."""
    affinity = pod_spec.setdefault("affinity", {})
    if "podAffinity" in affinity:
        return
    affinity["podAffinity"] = {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 100,
                "podAffinityTerm": {
                    "labelSelector": {"matchLabels": {SLICE_LABEL: slice_name}},
                    "topologyKey": spec.topology_key,
                },
            }
        ]
    }


def member_pod(
    owner: dict[str, Any],
    spec: SliceSpec,
    member: int,
    *,
    attempt: int,
    revision: str,
    node: str | None = None,
    restore_from: str | None = None,
    scheduler_name: str | None = None,
) -> dict[str, Any]:
    """The pod of one member. `node` binds it directly at creation. With
    `scheduler_name` the pod is left unbound for that scheduler (the gang
    scheduler binds all members at once through the Binding API); with neither,
    the default scheduler places it, preferring one topology domain."""
    name = owner["metadata"]["name"]
    template = spec.leader_template if member == 0 and spec.leader_template is not None else spec.template
    template_meta = template.metadata
    labels = dict(template_meta.labels or {}) if template_meta else {}
    labels.update({
        MANAGED_BY_LABEL: MANAGED_BY,
        SLICE_LABEL: name,
        MEMBER_LABEL: str(member),
        ATTEMPT_LABEL: str(attempt),
        REVISION_LABEL: revision,
        ROLE_LABEL: spec.role,
        LEADER_LABEL: "true" if member == 0 else "false",
    })
    annotations = dict(template_meta.annotations or {}) if template_meta and template_meta.annotations else {}
    pod_spec = copy.deepcopy(template.spec)
    pod_spec["restartPolicy"] = "Never"
    if spec.hosts > 1:
        pod_spec["hostname"] = member_pod_name(name, member)
        pod_spec["subdomain"] = rendezvous_service_name(name)
    keep_last_words(pod_spec)
    containers = pod_spec["containers"]
    main = containers[0]
    with_accelerator(main, spec)
    main["env"] = list(main.get("env", [])) + member_env(name, owner["metadata"]["namespace"], spec, member, attempt,
                                                          restore_from, revision)
    volume = checkpoint_volume(spec.checkpoint.store)[0] if spec.checkpoint is not None else None
    if volume is not None:
        pod_spec["volumes"] = [*pod_spec.get("volumes", []), volume]
        main["volumeMounts"] = [*main.get("volumeMounts", []), {"name": CHECKPOINT_VOLUME, "mountPath": CHECKPOINT_MOUNT}]
    if spec.accelerator.type != "cpu":
        pod_spec["nodeSelector"] = dict(pod_spec.get("nodeSelector", {})) | {ACCELERATOR_NODE_LABEL: spec.accelerator.type}
    if node:
        pod_spec["nodeName"] = node
    elif scheduler_name:
        pod_spec["schedulerName"] = scheduler_name
    elif spec.hosts > 1:
        _with_colocation(pod_spec, name, spec)
    metadata = child_metadata(owner, member_pod_name(name, member), labels)
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
