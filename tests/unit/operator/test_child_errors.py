"""Refused children and dead containers, as the owner's conditions show them (issue 19, defects 7 and 9)."""
from __future__ import annotations

import datetime as dt

import pytest

from tokenfleet_operator.api import SliceSpec
from tokenfleet_operator.gang.slice_state import plan_slice, pod_view
from tokenfleet_operator.kube import KubeError
from tokenfleet_operator.pod_failure import container_failure, last_words
from tokenfleet_operator.reconcile.child_errors import news, refusal_of, router_pods_refusal, with_refusals

from harness.operator_samples import slice_body

T = "2030-01-01T00:00:00Z"
FORBIDDEN = KubeError(403, "POST /api/v1/namespaces/ns/pods: 403 ...", reason="Forbidden",
                      detail='pods "s-0" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true')


def test_refusals_carry_the_api_servers_reason_and_message():
    r = refusal_of("Pod", "s-0", FORBIDDEN)
    assert r.reason == "PodForbidden"
    assert r.message == ('the API server refused Pod s-0 (403 Forbidden): pods "s-0" is forbidden: violates PodSecurity '
                         '"restricted:latest": runAsNonRoot != true')
    invalid = refusal_of("Deployment", "svc-router", KubeError(422, "x", reason="Invalid", detail="bad image"))
    assert invalid.reason == "DeploymentInvalid"
    assert refusal_of("Pod", "x", KubeError(400, "x")).reason == "PodBadRequest"      # no Status body: by code


@pytest.mark.parametrize("status", [0, 404, 409, 429, 500, 503])
def test_hiccups_and_conflicts_are_not_refusals(status):
    assert refusal_of("Pod", "x", KubeError(status, "x", reason="Whatever")) is None


def test_router_pods_refused_by_the_replicaset():
    deploy = {"metadata": {"name": "svc-router"}, "status": {"conditions": [
        {"type": "Available", "status": "False"},
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
         "message": 'pods "svc-router-x" is forbidden: violates PodSecurity "restricted:latest"'}]}}
    r = router_pods_refusal(deploy)
    assert r.reason == "RouterPodsRefused" and "FailedCreate" in r.message and "violates PodSecurity" in r.message
    deploy["status"]["conditions"][1]["status"] = "False"
    assert router_pods_refusal(deploy) is None and router_pods_refusal(None) is None


def conditions(**by_type):
    return [{"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": T} for t, (s, r, m) in by_type.items()]


def test_refusals_replace_their_condition_and_ready_in_place():
    status = {"observedGeneration": 4, "conditions": conditions(
        Ready=("False", "SlicesNotReady", "0/1"), SlicesReady=("False", "SlicesNotReady", "0/1"),
        RouterReady=("True", "RouterAvailable", "1/1"), Degraded=("False", "AsExpected", ""))}
    old = status["conditions"]
    r = refusal_of("Deployment", "svc-router", KubeError(422, "x", reason="Invalid", detail="spec.x: bad"))
    out = with_refusals(status, old, [("RouterReady", r)], now="2030-01-02T00:00:00Z")
    assert [c["type"] for c in out["conditions"]] == ["Ready", "SlicesReady", "RouterReady", "Degraded"]
    ready, _, router, _ = out["conditions"]
    assert (ready["status"], ready["reason"], ready["lastTransitionTime"]) == ("False", "DeploymentInvalid", T)  # still False
    assert (router["status"], router["reason"], router["lastTransitionTime"]) == ("False", "DeploymentInvalid",
                                                                                  "2030-01-02T00:00:00Z")
    assert router["observedGeneration"] == 4 and "spec.x: bad" in router["message"]
    assert with_refusals(status, old, []) is status


def test_each_new_refusal_is_one_event():
    r = refusal_of("Pod", "s-0", FORBIDDEN)
    assert news(conditions(Ready=("False", "MembersNotReady", "0/2")), [("Ready", r)]) == [r]
    shown = conditions(Ready=("False", r.reason, r.message))
    assert news(shown, [("Ready", r)]) == []                      # already on the owner: no second Event
    # when Ready turns False with it, the owner's own transition Event says it
    serving = conditions(Ready=("True", "Serving", ""), RouterReady=("True", "RouterAvailable", ""))
    written = conditions(Ready=("False", r.reason, r.message), RouterReady=("False", r.reason, r.message))
    assert news(serving, [("RouterReady", r)], written) == []


def test_the_slice_shows_a_refused_member_pod():
    body = slice_body()
    spec = SliceSpec.model_validate(body["spec"])
    plan = plan_slice(body, spec, [], now=dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    assert len(plan.create) == 2
    r = refusal_of("Pod", plan.create[0]["metadata"]["name"], FORBIDDEN)
    status = with_refusals(plan.status, None, [("Ready", r)])
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "PodForbidden") and "violates PodSecurity" in ready["message"]
    assert status["phase"] == plan.status["phase"]


def terminated(code, message=None, reason="Error"):
    term = {"exitCode": code, "reason": reason}
    if message is not None:
        term["message"] = message
    return {"terminated": term}


def test_a_dead_containers_last_words_reach_the_failure_text():
    status = {"phase": "Failed", "containerStatuses": [
        {"name": "engine", "state": terminated(2, "tokenfleet serve: error: unrecognized arguments: --bogus")}]}
    assert container_failure(status) == ("container engine exited with code 2 (Error): tokenfleet serve: error: "
                                         "unrecognized arguments: --bogus")
    # FallbackToLogsOnError: the end of the log; its last line is the exception
    log_tail = "Traceback (most recent call last):\n  File \"x\", line 1\n\nRuntimeError: CUDA out of memory\n\n"
    status["containerStatuses"][0]["state"] = terminated(1, log_tail)
    assert container_failure(status).endswith("(Error): RuntimeError: CUDA out of memory")
    status["containerStatuses"][0]["state"] = terminated(137, reason="OOMKilled")
    assert container_failure(status) == "container engine exited with code 137 (OOMKilled)"
    assert container_failure({"phase": "Running"}) == ""
    assert len(last_words("x" * 5000)) == 400


def test_the_failed_container_is_named_not_a_finished_one():
    status = {"initContainerStatuses": [{"name": "fetch", "state": terminated(0, reason="Completed")}],
              "containerStatuses": [{"name": "engine", "state": {"waiting": {}}, "lastState": terminated(1, "model failed")}]}
    assert container_failure(status) == "container engine exited with code 1 (Error): model failed"


def test_a_crash_s_message_is_in_the_slices_restart_and_conditions():
    body = slice_body(restartPolicy={"maxRestarts": 0, "backoffSeconds": 1, "maxBackoffSeconds": 10})
    spec = SliceSpec.model_validate(body["spec"])
    now = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    first = plan_slice(body, spec, [], now=now)
    body["status"] = first.status
    pods = []
    for pod in first.create:
        pod["spec"]["nodeName"] = "n"
        pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        pods.append(pod)
    pods[0]["status"] = {"phase": "Failed", "containerStatuses": [
        {"name": "main", "state": terminated(1, "tokenfleet serve: loading the model failed: /m/config.json: not found")}]}
    plan = plan_slice(body, spec, [pod_view(p) for p in pods], now=now)
    failed = next(c for c in plan.status["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and "loading the model failed: /m/config.json: not found" in failed["message"]
    assert any("loading the model failed" in e.message for e in plan.events)
