"""A HorizontalPodAutoscaler scales an InferenceService through its scale subresource, on the real
kube-controller-manager's HPA controller (docs/autoscaling.md, "HPA and KEDA").

The local plane has no metrics API (no metrics-server, no custom-metrics adapter), so the HPA cannot compute
a metric here. Its bounds need none: the controller reads the scale subresource, and a count below
minReplicas or above maxReplicas is corrected through it, as for a Deployment. That is the path every HPA
(and KEDA, which drives an HPA) takes to change the replicas, so it is the part the operator must get right:
the scale subresource's paths, status.replicas and status.selector, and the operator following spec.replicas
written by someone else."""
from __future__ import annotations

import pytest

from harness.operator_cluster import Operator, apply, condition, get_json, install, isvc, names, ready_with, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def hpa(target: str, low: int, high: int) -> dict:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": target},
            "spec": {"scaleTargetRef": {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "InferenceService",
                                        "name": target},
                     "minReplicas": low, "maxReplicas": high,
                     "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                         "type": "Utilization", "averageUtilization": 80}}}]}}


def hpa_condition(cluster, namespace, name, type_):
    return condition(get_json(cluster, "hpa", name, "-n", namespace), type_)


def test_an_hpa_moves_an_inference_service_into_its_bounds_through_the_scale_subresource(cluster, namespace, tmp_path):
    install(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log").start()
    try:
        apply(cluster, isvc("svc", replicas=1, autoscaling={"drainTimeoutSeconds": 3}), namespace)
        wait_for("1 ready replica", lambda: ready_with(cluster, namespace, "svc", 1), 120, op)

        apply(cluster, hpa("svc", 2, 3), namespace)
        obj = wait_for("the HPA's minReplicas in spec.replicas", lambda: (o := get_json(
            cluster, "inferenceservice", "svc", "-n", namespace)) and o["spec"]["replicas"] == 2 and o, 120, op)
        able = hpa_condition(cluster, namespace, "svc", "AbleToScale")
        assert able["status"] == "True" and able["reason"] in ("SucceededRescale", "ReadyForNewScale"), able
        wait_for("2 ready replicas", lambda: ready_with(cluster, namespace, "svc", 2), 120, op)
        assert names(cluster, "slices", namespace, "tokenfleet.dev/inference-service=svc") == ["svc-0", "svc-1"]
        managers = {m["manager"] for m in get_json(cluster, "inferenceservice", "svc", "-n", namespace,
                                                   "--show-managed-fields")["metadata"]["managedFields"]}
        assert any("controller-manager" in m or "horizontal" in m for m in managers), managers
        # the HPA saw the scale subresource's status: the replicas and the pods' selector
        status = get_json(cluster, "hpa", "svc", "-n", namespace)["status"]
        assert status["desiredReplicas"] == 2
        assert obj["status"]["selector"]

        # and down: a maxReplicas below the count is applied the same way, and the replica removed is drained
        apply(cluster, hpa("svc", 1, 1), namespace)
        wait_for("the HPA's maxReplicas in spec.replicas", lambda: get_json(
            cluster, "inferenceservice", "svc", "-n", namespace)["spec"]["replicas"] == 1, 120, op)
        wait_for("the drained replica gone", lambda: names(
            cluster, "slices", namespace, "tokenfleet.dev/inference-service=svc") == ["svc-0"], 120, op)
        wait_for("1 ready replica again", lambda: ready_with(cluster, namespace, "svc", 1), 120, op)
    finally:
        op.stop()
