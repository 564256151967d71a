"""Which work a watch event asks for: a pure function from one changed object to the keys to reconcile.

A key is ``(kind, namespace, name)``; the gang scheduler's pass is the single key ``GANG_PASS``. The rules:

- an InferenceService or a Slice: itself;
- a Slice of a service (label ``tokenfleet.dev/inference-service``): also that service, whose status sums its
  Slices; a gang-scheduled Slice: also the gang pass (a new, changed or deleted gang changes the plan);
- a member pod (label ``tokenfleet.dev/slice``): its Slice, and the gang pass; a serving pod of a service:
  that service (its router's endpoints);
- a router Deployment, ConfigMap, Service, NetworkPolicy or PodDisruptionBudget of a service (label
  ``tokenfleet.dev/inference-service``): that service (a child changed or was deleted by someone else: apply it
  again); the headless Service of a Slice (label ``tokenfleet.dev/slice``): that Slice;
- a TokenRoute, or a child of one (label ``tokenfleet.dev/token-route``): that route (the routes that name an
  InferenceService or its router pods as a target come from ``route_triggers.py``, which needs the cache);
- a Node or a SliceQueue: the gang pass (capacity or quota changed);
- a PersistentVolumeClaim: the services that load a model from it (found by the caller, who has the
  cache: ``pvc_claims``).

An update of a Node, a Pod or a Slice asks for the gang pass only if it changed what placement reads
(``changes_placement``): a node's heartbeat, a pod's readiness or a Slice's Ready condition moves no
capacity and queues nothing.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tokenfleet_operator.naming import ROUTE_LABEL, SERVICE_LABEL, SLICE_LABEL

Key = tuple[str, str | None, str]
GANG_PASS: Key = ("GangPass", None, "")
RESYNC: Key = ("Resync", None, "")


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _ns(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("namespace")


def is_gang_slice(obj: dict[str, Any]) -> bool:
    accelerator = ((obj.get("spec") or {}).get("accelerator") or {}).get("type")
    return accelerator not in (None, "cpu")


def triggers(kind: str, obj: dict[str, Any]) -> list[Key]:
    meta = obj.get("metadata") or {}
    ns, name, labels = _ns(obj), meta.get("name", ""), _labels(obj)
    keys: list[Key] = []
    if kind == "InferenceService":
        keys.append(("InferenceService", ns, name))
    elif kind == "TokenRoute":
        keys.append(("TokenRoute", ns, name))
    elif ROUTE_LABEL in labels:         # a child of a TokenRoute (its service label names no InferenceService)
        keys.append(("TokenRoute", ns, labels[ROUTE_LABEL]))
    elif kind == "Slice":
        keys.append(("Slice", ns, name))
        if SERVICE_LABEL in labels:
            keys.append(("InferenceService", ns, labels[SERVICE_LABEL]))
        if is_gang_slice(obj):
            keys.append(GANG_PASS)
    elif kind == "Pod":
        if SLICE_LABEL in labels:
            keys.append(("Slice", ns, labels[SLICE_LABEL]))
            keys.append(GANG_PASS)
        if SERVICE_LABEL in labels:
            keys.append(("InferenceService", ns, labels[SERVICE_LABEL]))
    elif kind in ("Deployment", "ConfigMap", "Service", "NetworkPolicy", "PodDisruptionBudget"):
        if SERVICE_LABEL in labels:
            keys.append(("InferenceService", ns, labels[SERVICE_LABEL]))
        elif kind == "Service" and SLICE_LABEL in labels:
            keys.append(("Slice", ns, labels[SLICE_LABEL]))
    elif kind in ("Node", "SliceQueue"):
        keys.append(GANG_PASS)
    return keys


def _pod_placement(pod: dict[str, Any]) -> tuple[Any, ...]:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    return (spec.get("nodeName"), spec.get("schedulerName"), status.get("phase") in ("Succeeded", "Failed"),
            bool(meta.get("deletionTimestamp")), (meta.get("labels") or {}).get(SLICE_LABEL))


def _slice_placement(obj: dict[str, Any]) -> tuple[Any, ...]:
    """What the gang pass reads of a Slice (``gang/plan.py``): its spec, whether it is being deleted, the
    scheduler's decision, and the status fields that say which attempt runs and since when it waits."""
    from tokenfleet_operator.gang.decision import ANNOTATION

    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    admission = status.get("admission") or {}
    return (meta.get("uid"), obj.get("spec"), bool(meta.get("deletionTimestamp")),
            (meta.get("annotations") or {}).get(ANNOTATION), status.get("phase"), status.get("revision"),
            status.get("restarts"), admission.get("queuedAt"), admission.get("admittedAt"))


# kinds whose updates are filtered by ``changes_placement``
PLACEMENT_FILTERED = ("Node", "Pod", "Slice")


def changes_placement(kind: str, old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether the update from ``old`` (None: not seen before) to ``new`` can change the gang pass's plan.
    Nodes, Pods and Slices are filtered; every other kind counts as a change."""
    if old is None or kind not in PLACEMENT_FILTERED:
        return True
    if kind == "Slice":
        return _slice_placement(old) != _slice_placement(new)
    if kind == "Node":
        from tokenfleet_operator.gang.snapshot import node_from_object  # the placement's own view of a Node
        return node_from_object(old) != node_from_object(new)
    if kind == "Pod":
        return _pod_placement(old) != _pod_placement(new)
    return True


def pvc_claims(service: dict[str, Any]) -> set[str]:
    """The PersistentVolumeClaims an InferenceService loads a model from (the model, the draft model, ...): the
    ``pvc.claimName`` of every model source (``api.model_source``), read from the object as stored, so that a
    spec the operator refuses still names its claims."""
    def claims(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            pvc = node.get("pvc")
            if isinstance(pvc, dict) and isinstance(pvc.get("claimName"), str):
                yield pvc["claimName"]
            for child in node.values():
                yield from claims(child)
        elif isinstance(node, list):
            for child in node:
                yield from claims(child)
    return set(claims(service.get("spec")))
