"""Who may talk to an InferenceService's pods: the keys and the NetworkPolicy the operator wires in.

```
client ──(client key)──▶ router ──(replica key)──▶ replicas (serving pods, port 8000)
```

- **Replica key.** One Secret per service, ``<service>-replica-key``, made by the operator with a random key
  (``replica_key_secret``), owned by the service, immutable, never logged and never read back. The router and
  every serving container get it as ``$TOKENFLEET_API_KEY`` through a ``secretKeyRef`` (never on a command
  line). A replica answers ``/v1/*`` and ``/cache/blocks`` only with it.
- **Client keys** (``spec.auth.clientKeysSecretName``): the user's Secret, mounted into the router pods at
  ``CLIENT_KEYS_MOUNT`` and named by ``tokenfleet route --client-keys``; the kubelet refreshes the files and
  the router re-reads them.
- **NetworkPolicy** ``<service>-replicas`` over the serving pods: ingress on the serving port from the
  service's router pods and from the operator (its collector reads ``/metrics``), and any port from the
  service's own serving pods (the members of a multi-host replica talk to each other). Policies add up, so
  a Prometheus outside that set needs a policy of its own.

The key's identity (the Secret's uid, not the key) is written into the router's and the replicas' pod
templates (``REPLICA_KEY_ANNOTATION``): a Secret made anew (deleted by someone, or after a rotation) rolls
both onto the new key.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from tokenfleet_operator.api import GROUP
from tokenfleet_operator.api.inference_service import DEFAULT_IMAGE, InferenceServiceSpec
from tokenfleet_operator.naming import MANAGED_BY, MANAGED_BY_LABEL, ROLE_LABEL, SERVICE_LABEL, SERVING_PORT, child_metadata
from tokenfleet_operator.runtimes.base import KvEventPorts

REPLICA_KEY_ENV = "TOKENFLEET_API_KEY"          # read by tokenfleet serve (--api-key) and route (--backend-api-key)
REPLICA_KEY_DATA_KEY = "api-key"
REPLICA_KEY_ANNOTATION = f"{GROUP}/replica-key"
CLIENT_KEYS_VOLUME = "client-keys"
CLIENT_KEYS_MOUNT = "/var/run/tokenfleet/client-keys"
DEFAULT_OPERATOR_NAMESPACE = "tokenfleet-system"
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "tokenfleet", "app.kubernetes.io/component": "operator"}


@dataclass(frozen=True)
class Wiring:
    """What the builders need to know beyond the spec: the identity of the service's replica key (its
    Secret's uid, "" while unknown), the namespace the operator runs in (for the NetworkPolicy) and the image
    the router runs (the operator's --router-image)."""

    replica_key_id: str = ""
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE
    router_image: str = DEFAULT_IMAGE


NO_WIRING = Wiring()


def replica_key_secret_name(service: str) -> str:
    return f"{service}-replica-key"


def replica_key_secret(owner: dict[str, Any], key: str) -> dict[str, Any]:
    """The Secret that holds the router-to-replica key. Made once; immutable, so it is never rewritten."""
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(owner, replica_key_secret_name(name),
                                   {MANAGED_BY_LABEL: MANAGED_BY, SERVICE_LABEL: name, ROLE_LABEL: "replica-key"}),
        "type": "Opaque",
        "immutable": True,
        "data": {REPLICA_KEY_DATA_KEY: base64.b64encode(key.encode()).decode()},
    }


def replica_key_env(service: str) -> dict[str, Any]:
    return {"name": REPLICA_KEY_ENV, "valueFrom": {"secretKeyRef": {
        "name": replica_key_secret_name(service), "key": REPLICA_KEY_DATA_KEY}}}


def key_annotations(wiring: Wiring) -> dict[str, str]:
    return {REPLICA_KEY_ANNOTATION: wiring.replica_key_id} if wiring.replica_key_id else {}


def client_keys_volume(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    if spec.auth is None:
        return []
    return [{"name": CLIENT_KEYS_VOLUME, "secret": {"secretName": spec.auth.client_keys_secret_name}}]


def client_keys_mount(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    if spec.auth is None:
        return []
    return [{"name": CLIENT_KEYS_VOLUME, "mountPath": CLIENT_KEYS_MOUNT, "readOnly": True}]


def client_keys_args(spec: InferenceServiceSpec) -> list[str]:
    return [] if spec.auth is None else ["--client-keys", CLIENT_KEYS_MOUNT]


def replicas_network_policy_name(service: str) -> str:
    return f"{service}-replicas"


def replicas_network_policy(owner: dict[str, Any], wiring: Wiring, kv_events: KvEventPorts | None = None) -> dict[str, Any]:
    """Only the service's router (and the operator, for /metrics) reach its serving pods; the router also their
    KV-event ports, when they have them."""
    name = owner["metadata"]["name"]
    serving = {SERVICE_LABEL: name, ROLE_LABEL: "serve"}
    port = [{"protocol": "TCP", "port": SERVING_PORT}]
    events = kv_events.container_ports() if kv_events is not None else []
    router_ports = port + [{"protocol": "TCP", "port": p["containerPort"]} for p in events]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(owner, replicas_network_policy_name(name),
                                   {MANAGED_BY_LABEL: MANAGED_BY, SERVICE_LABEL: name, ROLE_LABEL: "serve"}),
        "spec": {
            "podSelector": {"matchLabels": serving},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {SERVICE_LABEL: name, ROLE_LABEL: "router"}}}],
                 "ports": router_ports},
                {"from": [{"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": wiring.operator_namespace}},
                    "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}], "ports": port},
                {"from": [{"podSelector": {"matchLabels": serving}}]},
            ],
        },
    }
