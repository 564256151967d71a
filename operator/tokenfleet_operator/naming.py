"""Names, labels and hashes shared by the builders and the handlers.

Children get deterministic names (SERVICE-INDEX, SLICE-MEMBER, SERVICE-router)
so that re-running a reconcile, or a second operator after a crash, applies
the same objects instead of creating duplicates.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from tokenfleet_operator.api import GROUP

FIELD_MANAGER = "tokenfleet"
FINALIZER = f"{GROUP}/finalizer"

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "tokenfleet"
SERVICE_LABEL = f"{GROUP}/inference-service"
SLICE_LABEL = f"{GROUP}/slice"
ROUTE_LABEL = f"{GROUP}/token-route"       # the children of a TokenRoute
MEMBER_LABEL = f"{GROUP}/member"
ROLE_LABEL = f"{GROUP}/role"  # serve | batch | router
LEADER_LABEL = f"{GROUP}/leader"
REVISION_LABEL = f"{GROUP}/revision"
ATTEMPT_LABEL = f"{GROUP}/attempt"
REPLICA_LABEL = f"{GROUP}/replica"
ACCELERATOR_NODE_LABEL = f"{GROUP}/accelerator"
COMPONENT_LABEL = "app.kubernetes.io/component"

SERVING_PORT = 8000
ROUTER_PORT = 8080


def revision_of(obj: Any) -> str:
    """A short, stable hash of a JSON-able value (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def slice_name(service: str, index: int) -> str:
    return f"{service}-{index}"


def slice_index(service: str, name: str) -> int | None:
    """The replica index encoded in a Slice name, or None if the name is not SERVICE-INDEX."""
    prefix = f"{service}-"
    if not name.startswith(prefix):
        return None
    tail = name[len(prefix):]
    if not tail.isdigit() or (len(tail) > 1 and tail.startswith("0")):
        return None
    return int(tail)


def member_pod_name(slice_: str, member: int) -> str:
    return f"{slice_}-{member}"


def rendezvous_service_name(slice_: str) -> str:
    """Headless Service of a multi-host Slice, the subdomain of its member pods (as LeaderWorkerSet names it)."""
    return slice_


def member_address(slice_: str, member: int, namespace: str) -> str:
    """The DNS name of a member pod of a multi-host Slice: hostname.subdomain.namespace.svc."""
    return f"{member_pod_name(slice_, member)}.{rendezvous_service_name(slice_)}.{namespace}.svc"


def router_name(service: str) -> str:
    return f"{service}-router"


def engines_service_name(service: str) -> str:
    """Headless Service over the replicas' leader pods, which the router resolves."""
    return f"{service}-engines"


def owner_reference(obj: dict[str, Any], *, controller: bool = True) -> dict[str, Any]:
    """An ownerReference to obj, so the garbage collector deletes children with their owner."""
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def child_metadata(owner: dict[str, Any], name: str, labels: dict[str, str]) -> dict[str, Any]:
    """metadata of a child object: in its owner's namespace, owned by it (garbage-collected with it)."""
    return {
        "name": name,
        "namespace": owner["metadata"]["namespace"],
        "labels": labels,
        "ownerReferences": [owner_reference(owner)],
    }
