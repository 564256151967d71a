"""The labels of tokenfleet_operator_api_requests_total: every path kube.py builds maps to RBAC's verb and resource."""
import pytest

from tokenfleet_operator.kube import APPLY_CONTENT_TYPE, path_for, request_labels


@pytest.mark.parametrize("method, path, content_type, expected", [
    ("GET", path_for("v1", "Pod", "ns", None), None, ("list", "pods")),
    ("GET", path_for("v1", "Pod", "ns", "p-0"), None, ("get", "pods")),
    ("GET", path_for("v1", "Node", None, "node-1"), None, ("get", "nodes")),
    ("GET", path_for("v1", "Node", None), None, ("list", "nodes")),
    ("GET", "/apis/tokenfleet.dev/v1alpha1/slices", None, ("list", "slices")),
    ("GET", path_for("v1", "PersistentVolumeClaim", "ns", "weights"), None, ("get", "persistentvolumeclaims")),
    ("PATCH", path_for("tokenfleet.dev/v1alpha1", "Slice", "ns", "s", "status"), APPLY_CONTENT_TYPE,
     ("apply", "slices/status")),
    ("PATCH", path_for("apps/v1", "Deployment", "ns", "r"), APPLY_CONTENT_TYPE, ("apply", "deployments")),
    ("PATCH", path_for("apps/v1", "Deployment", "ns", "r"), "application/merge-patch+json", ("patch", "deployments")),
    ("POST", path_for("v1", "Pod", "ns", "p-0", "binding"), "application/json", ("create", "pods/binding")),
    ("POST", path_for("v1", "Event", "ns"), "application/json", ("create", "events")),
    ("POST", path_for("tokenfleet.dev/v1alpha1", "InferenceService", "ns"), "application/json",
     ("create", "inferenceservices")),
    ("DELETE", path_for("v1", "Pod", "ns", "p-0"), "application/json", ("delete", "pods")),
    ("DELETE", path_for("v1", "Pod", "ns"), None, ("deletecollection", "pods")),
    ("PUT", path_for("v1", "ConfigMap", "ns", "c"), "application/json", ("update", "configmaps")),
    ("GET", "/api/v1/namespaces/ns", None, ("get", "namespaces")),
    ("GET", "/api/v1/namespaces", None, ("list", "namespaces")),
    ("GET", "/api/v1/namespaces/ns/pods?labelSelector=a%3Db", None, ("list", "pods")),
])
def test_request_labels(method, path, content_type, expected):
    assert request_labels(method, path, content_type) == expected
