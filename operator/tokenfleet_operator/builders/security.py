"""What makes the pods the operator builds pass PodSecurity "restricted", and what it adds to pods it does not
build.

Serving and router pods (built from an InferenceService) run:

- as the serving image's non-root user (uid and gid 10001), ``runAsNonRoot``;
- with the RuntimeDefault seccomp profile, every capability dropped, no privilege escalation;
- on a read-only root filesystem: the one place they write, ``/tmp``, is an emptyDir;
- without a ServiceAccount token: neither talks to the API server.

Member pods of a Slice a user wrote are the user's pods: the operator adds nothing that weakens them (no host
path unless a cluster administrator allowed it, see ``policy.py``), and PodSecurity admission of the namespace
decides what they may do. Every container the operator builds or runs gets
``terminationMessagePolicy: FallbackToLogsOnError``, so a container that dies without a message leaves the end of
its log as one (shown in the Slice's conditions).
"""
from __future__ import annotations

import copy
from typing import Any

# The serving image's user (serving-image/Dockerfile: USER 10001:10001).
SERVING_UID = 10001
TMP_VOLUME = "tmp"
TMP_MOUNT = "/tmp"
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"

POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": SERVING_UID,
    "runAsGroup": SERVING_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}

CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def pod_security_context() -> dict[str, Any]:
    return copy.deepcopy(POD_SECURITY_CONTEXT)


def container_security_context() -> dict[str, Any]:
    return copy.deepcopy(CONTAINER_SECURITY_CONTEXT)


def scratch_volume() -> dict[str, Any]:
    """The writable /tmp of a container whose root filesystem is read-only."""
    return {"name": TMP_VOLUME, "emptyDir": {}}


def scratch_mount() -> dict[str, Any]:
    return {"name": TMP_VOLUME, "mountPath": TMP_MOUNT}


def harden_container(container: dict[str, Any]) -> dict[str, Any]:
    """A container the operator builds: restricted securityContext, writable /tmp, its last words kept."""
    container["securityContext"] = container_security_context()
    container["terminationMessagePolicy"] = TERMINATION_MESSAGE_POLICY
    container["volumeMounts"] = [*container.get("volumeMounts", []), scratch_mount()]
    return container


def harden_pod_spec(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The pod-level half: restricted securityContext, the /tmp volume, no ServiceAccount token."""
    pod_spec["securityContext"] = pod_security_context()
    pod_spec["automountServiceAccountToken"] = False
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), scratch_volume()]
    return pod_spec


def keep_last_words(pod_spec: dict[str, Any]) -> None:
    """For a user's template: every container that does not choose a terminationMessagePolicy gets
    FallbackToLogsOnError (it adds no privilege; a crash without a message still says why)."""
    for key in ("initContainers", "containers"):
        for container in pod_spec.get(key) or []:
            if isinstance(container, dict):
                container.setdefault("terminationMessagePolicy", TERMINATION_MESSAGE_POLICY)
