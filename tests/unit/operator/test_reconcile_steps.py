"""The pure parts of reconcile_inference_service's steps (operator/tokenfleet_operator/reconcile/
inference_service.py); the steps that write are exercised against the real control plane in
tests/cluster/operator/."""
from __future__ import annotations

import inspect

import pytest

from tokenfleet_operator.kube import KubeError
from tokenfleet_operator.reconcile import inference_service as rec


def slice_(name, revision="r1", ready=True):
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": {"name": name, "labels": {"tokenfleet.dev/revision": revision}},
            "status": {"phase": "Ready" if ready else "Pending", "conditions": conditions}}


def test_the_pass_is_a_short_list_of_named_steps():
    source = inspect.getsource(rec.reconcile_inference_service)
    body = source.split('"""')[2]          # after the docstring
    calls = [line for line in body.splitlines() if line.strip() and not line.strip().startswith(("return", "if"))]
    assert "nonlocal" not in inspect.getsource(rec)
    assert len(calls) <= 12, calls
    for step in ("start_pass", "accept_spec", "model_claims_exist", "observe_replicas", "replica_key",
                 "apply_router_children", "apply_slices", "delete_surplus_slices", "write_service_status",
                 "export_service_metrics", "next_pass"):
        assert f"{step}(" in body and callable(getattr(rec, step))


def test_replicas_are_indexed_by_slice_name_with_their_leader_pods():
    slices = [slice_("svc-0"), slice_("svc-2"), slice_("other-1"), slice_("svc-x")]
    pods = [{"metadata": {"name": "svc-0-0"}}, {"metadata": {"name": "svc-2-1"}}]
    indexed = rec.index_replicas("svc", slices, pods)
    assert [(i, s["metadata"]["name"], p and p["metadata"]["name"]) for i, s, p in indexed] == [
        (0, "svc-0", "svc-0-0"), (2, "svc-2", None)]


def test_the_rollout_plan_replaces_outdated_replicas_within_max_unavailable_and_drops_extra_ones():
    from tokenfleet_operator.api.inference_service import InferenceServiceSpec

    from harness.operator_samples import isvc_body
    spec = InferenceServiceSpec.model_validate(isvc_body(rollout={"maxUnavailable": 1})["spec"])
    plan = rec.rollout_plan("llama", spec, 2, "r2", (slice_("llama-0", "r1"), slice_("llama-1", "r1"),
                                                     slice_("llama-2", "r1")))
    assert plan.delete == ("llama-2",)
    assert len(plan.apply) == 1 and plan.waiting       # one outdated replica at a time


def test_refused_writes_are_collected_by_condition_and_other_errors_raised():
    refusals = rec.Refusals("svc")
    invalid = KubeError(422, "invalid", reason="Invalid", detail="spec.template: bad")
    refusals.refuse("Deployment", "svc-router", invalid)
    refusals.refuse("Slice", "svc-0", KubeError(403, "forbidden", reason="Forbidden"))
    assert [(c, r.reason) for c, r in refusals.items] == [("RouterReady", "DeploymentInvalid"),
                                                          ("SlicesReady", "SliceForbidden")]
    assert refusals.first_error is invalid
    with pytest.raises(KubeError):
        refusals.refuse("ConfigMap", "svc-router", KubeError(500, "boom"))      # not a refusal: retried
