"""The one thin layer that talks to the API server.

Children and status are written with server-side apply under one field
manager (``tokenfleet``), so the operator owns exactly the fields it sets
and never touches a user's spec. Everything else here is plain get, list,
create and delete, plus Events.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tokenfleet_operator import metrics
from tokenfleet_operator.naming import FIELD_MANAGER

log = logging.getLogger("tokenfleet.kube")

# kind -> (plural, namespaced)
_PLURALS: dict[str, tuple[str, bool]] = {
    "Pod": ("pods", True),
    "Service": ("services", True),
    "ConfigMap": ("configmaps", True),
    "Event": ("events", True),
    "PersistentVolumeClaim": ("persistentvolumeclaims", True),
    "Secret": ("secrets", True),
    "NetworkPolicy": ("networkpolicies", True),
    "Deployment": ("deployments", True),
    "PodDisruptionBudget": ("poddisruptionbudgets", True),
    "Node": ("nodes", False),
    "Namespace": ("namespaces", False),
    "InferenceService": ("inferenceservices", True),
    "Slice": ("slices", True),
    "SliceQueue": ("slicequeues", False),
    "TokenRoute": ("tokenroutes", True),
    "Lease": ("leases", True),
}


class KubeError(RuntimeError):
    """An API call failed; status is the HTTP status (0 when there was none). ``reason`` and ``detail`` are the
    API server's Status reason (e.g. Invalid, Forbidden) and message, when it sent one."""

    def __init__(self, status: int, message: str, *, reason: str = "", detail: str = ""):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.detail = detail or message

    @property
    def transient(self) -> bool:
        return self.status in (0, 409, 429) or self.status >= 500


@dataclass(frozen=True)
class Ref:
    api_version: str
    kind: str
    name: str
    namespace: str | None = None


def ref_of(obj: dict[str, Any]) -> Ref:
    meta = obj["metadata"]
    return Ref(obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace"))


def path_for(api_version: str, kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
    plural, namespaced = _PLURALS[kind]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespaced:
        if not namespace:
            raise ValueError(f"{kind} {name}: a namespace is required")
        base += f"/namespaces/{namespace}"
    path = f"{base}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


APPLY_CONTENT_TYPE = "application/apply-patch+yaml"


def request_labels(method: str, path: str, content_type: str | None = None) -> tuple[str, str]:
    """(verb, resource) of a request, in RBAC's words: ``GET /api/v1/namespaces/a/pods`` is
    ("list", "pods"), a server-side apply of a status is ("apply", "slices/status"), a
    Binding is ("create", "pods/binding")."""
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]  # drop api/v1 or apis/GROUP/VERSION
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    resource = "/".join(rest[0:1] + rest[2:3]) or "unknown"
    named = len(rest) >= 2
    if method == "GET":
        verb = "get" if named else "list"
    elif method == "POST":
        verb = "create"
    elif method == "PATCH":
        verb = "apply" if content_type == APPLY_CONTENT_TYPE else "patch"
    elif method == "PUT":
        verb = "update"
    elif method == "DELETE":
        verb = "delete" if named else "deletecollection"
    else:
        verb = method.lower()
    return verb, resource


def load_api_client() -> client.ApiClient:
    """In a pod: the ServiceAccount token. Elsewhere: $KUBECONFIG or ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    conf = client.Configuration.get_default_copy()
    # the workers, the collector and the gang pass's parallel writes share one pool of connections
    conf.connection_pool_maxsize = 32
    return client.ApiClient(conf)


# A failpoint for crash tests: "VERB RESOURCE N" (RBAC's words, as ``request_labels`` gives them) makes the process
# exit at once, as SIGKILL would, right after its Nth successful write of that kind, e.g. "create pods/binding 1"
# or "apply slices/status 2". tests/cluster/operator/test_operator_cluster.py kills the operator at each step of
# a Slice's creation in turn this way.
EXIT_AFTER_ENV = "TOKENFLEET_EXIT_AFTER"


class ExitAfter:
    def __init__(self, spec: str | None):
        self.verb, self.resource, self.left = "", "", 0
        if spec:
            verb, resource, count = spec.split()
            self.verb, self.resource, self.left = verb, resource, int(count)
        self._lock = threading.Lock()

    def wrote(self, verb: str, resource: str) -> None:
        if (verb, resource) != (self.verb, self.resource):
            return
        with self._lock:
            self.left -= 1
            if self.left == 0:
                log.critical("%s=%r: exiting as if killed", EXIT_AFTER_ENV, f"{verb} {resource}")
                os._exit(137)


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None):
        self.api = api_client or load_api_client()
        self._lock = threading.Lock()
        self._exit_after = ExitAfter(os.environ.get(EXIT_AFTER_ENV))

    def _call(self, method: str, path: str, *, body: Any = None, query: list | None = None, content_type: str | None = None) -> Any:
        labels = request_labels(method, path, content_type)
        metrics.API_REQUESTS.labels(*labels).inc()
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            status, data = self._request(method, path, headers, body, query or [])
        except ApiException as e:
            status, data = e.status or 0, e.body
        except Exception as e:  # connection errors and the like
            raise KubeError(0, f"{method} {path}: {e}") from e
        text = data.decode() if isinstance(data, bytes) else (data or "")
        if not 200 <= status < 300:
            message, reason = text, ""
            try:
                body = json.loads(text)
                message, reason = body.get("message", text), str(body.get("reason") or "")
            except (TypeError, ValueError, AttributeError):
                pass
            raise KubeError(status, f"{method} {path}: {status} {message}", reason=reason, detail=message)
        if method != "GET":
            self._exit_after.wrote(*labels)
        return json.loads(text) if text else {}

    def _request(self, method: str, path: str, headers: dict, body: Any, query: list) -> tuple[int, Any]:
        """(HTTP status, raw body), for both generations of the kubernetes client."""
        if hasattr(self.api, "param_serialize"):  # kubernetes >= 35 (openapi-generator v7)
            params = self.api.param_serialize(
                method, path, query_params=query, header_params=headers, body=body, auth_settings=["BearerToken"]
            )
            response = self.api.call_api(*params)
            response.read()
            return response.status, response.data
        data, status, _ = self.api.call_api(
            path, method, query_params=query, header_params=headers, body=body, response_type=None,
            auth_settings=["BearerToken"], _return_http_data_only=False, _preload_content=False,
        )
        return status, data.data

    def apply(self, manifest: dict[str, Any], *, subresource: str | None = None) -> dict[str, Any]:
        """Server-side apply as field manager 'tokenfleet' (force: the operator owns its children)."""
        r = ref_of(manifest)
        path = path_for(r.api_version, r.kind, r.namespace, r.name, subresource)
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        return self._call("PATCH", path, body=json.dumps(manifest), query=query, content_type=APPLY_CONTENT_TYPE)

    def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: dict[str, Any], *,
              field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386), for the few fields the operator sets on objects it does not own."""
        return self._call("PATCH", path_for(api_version, kind, namespace, name), body=patch,
                          query=[("fieldManager", field_manager)], content_type="application/merge-patch+json")

    def replace(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """PUT the whole object; with metadata.resourceVersion set, 409 if it changed since it was read."""
        r = ref_of(manifest)
        return self._call("PUT", path_for(r.api_version, r.kind, r.namespace, r.name), body=manifest,
                          query=[("fieldManager", FIELD_MANAGER)], content_type="application/json")

    def apply_status(self, obj: dict[str, Any], status: dict[str, Any], *, resource_version: str | None = None) -> dict[str, Any]:
        """Apply the whole status. With resource_version, fail with 409 if the object changed since it was read."""
        meta: dict[str, Any] = {"name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"]}
        if resource_version:
            meta["resourceVersion"] = resource_version
        body = {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": meta, "status": status}
        return self.apply(body, subresource="status")

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", path_for(api_version, kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None) -> list[dict[str, Any]]:
        return self.listing(api_version, kind, namespace, label_selector=label_selector)[0]

    def list_cluster(self, api_version: str, kind: str, *, label_selector: str | None = None,
                     field_selector: str | None = None, resource_version: str | None = None) -> list[dict[str, Any]]:
        """List a namespaced kind across all namespaces (or a cluster-scoped kind). ``resource_version="0"``:
        any version the API server has, served from its watch cache (no quorum read from etcd)."""
        return self.listing(api_version, kind, None, label_selector=label_selector, field_selector=field_selector,
                            resource_version=resource_version)[0]

    def listing(self, api_version: str, kind: str, namespace: str | None, *, label_selector: str | None = None,
                field_selector: str | None = None,
                resource_version: str | None = None) -> tuple[list[dict[str, Any]], int | None]:
        """(items, the list's resourceVersion) in ``namespace``, or everywhere when it is None."""
        plural, namespaced = _PLURALS[kind]
        path = path_for(api_version, kind, namespace) if namespace and namespaced else \
            ("/api/v1" if api_version == "v1" else f"/apis/{api_version}") + f"/{plural}"
        query = [(k, v) for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector),
                                      ("resourceVersion", resource_version)) if v]
        out = self._call("GET", path, query=query)
        items = out.get("items", [])
        for item in items:  # lists leave apiVersion/kind out of the items
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        try:
            version = int((out.get("metadata") or {}).get("resourceVersion"))
        except (TypeError, ValueError):
            version = None
        return items, version

    def bind(self, namespace: str, pod: str, node: str, *, uid: str | None = None) -> None:
        """Bind a pod to a node through the Binding API (pods/binding).

        The call is made as raw JSON: the generated client's
        create_namespaced_pod_binding fails to parse the Status the server
        returns. With uid, the server refuses to bind a pod of the same name
        that is not the one the caller planned for. A pod that is already
        bound fails with 409."""
        body: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": pod, "namespace": namespace, **({"uid": uid} if uid else {})},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        self._call("POST", path_for("v1", "Pod", namespace, pod, "binding"), body=body,
                   query=[("fieldManager", FIELD_MANAGER)], content_type="application/json")

    def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None if an object of that name already exists."""
        r = ref_of(manifest)
        try:
            return self._call("POST", path_for(r.api_version, r.kind, r.namespace), body=manifest,
                              query=[("fieldManager", FIELD_MANAGER)], content_type="application/json")
        except KubeError as e:
            if e.status == 409:
                return None
            raise

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str, *, uid: str | None = None) -> bool:
        """Delete (background propagation); False if it was already gone."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._call("DELETE", path_for(api_version, kind, namespace, name), body=body, content_type="application/json")
            return True
        except KubeError as e:
            if e.status in (404, 409):
                return False
            raise

    def event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Record a core/v1 Event on obj (shown by kubectl describe). Failures are logged, never raised."""
        meta = obj["metadata"]
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"],
                "namespace": meta["namespace"], "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "source": {"component": "tokenfleet-operator"},
            "reportingComponent": "tokenfleet.dev/operator",
            "reportingInstance": "tokenfleet-operator",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._call("POST", path_for("v1", "Event", meta["namespace"]), body=event, content_type="application/json")
        except KubeError as e:
            log.warning("could not record event %s on %s/%s: %s", reason, meta["namespace"], meta["name"], e)
