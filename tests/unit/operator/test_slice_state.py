"""The Slice state machine, transition by transition."""
import datetime as dt

import pytest

from tokenfleet_operator.api import SliceSpec
from tokenfleet_operator.gang.slice_state import Admission, PodView, backoff_seconds, plan_slice, pod_view, slice_revision

from harness.operator_samples import slice_body

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def setup(**overrides):
    body = slice_body(**overrides)
    spec = SliceSpec.model_validate(body["spec"])
    return body, spec, slice_revision(spec)


def member(i, rev, attempt=0, **kw):
    kw.setdefault("phase", "Running")
    kw.setdefault("ready", True)
    kw.setdefault("node", f"node-{i}")
    return PodView(name=f"llama-0-{i}", member=i, attempt=attempt, revision=rev, **kw)


def with_status(body, plan):
    return {**body, "status": plan.status}


def cond_of(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_new_slice_creates_all_members_and_is_placing():
    body, spec, rev = setup()
    plan = plan_slice(body, spec, [], now=T0)
    assert [p["metadata"]["name"] for p in plan.create] == ["llama-0-0", "llama-0-1"]
    assert plan.delete == [] and not plan.counts_restart
    assert plan.status["phase"] == "Placing"
    assert plan.status["members"] == {"desired": 2, "scheduled": 0, "ready": 0}
    assert plan.status["revision"] == rev and plan.status["observedGeneration"] == 1
    assert cond_of(plan.status, "Admitted")["status"] == "True"
    assert cond_of(plan.status, "Ready")["status"] == "False"


def test_partial_creation_after_a_crash_only_creates_the_missing_member():
    body, spec, rev = setup()
    plan = plan_slice(body, spec, [member(0, rev, ready=False, node=None)], now=T0)
    assert [p["metadata"]["name"] for p in plan.create] == ["llama-0-1"]
    assert plan.delete == []


def test_all_members_ready_is_ready_with_placement():
    body, spec, rev = setup()
    plan = plan_slice(body, spec, [member(0, rev), member(1, rev)], now=T0, node_domains={"node-0": "b0", "node-1": "b0"})
    assert plan.status["phase"] == "Ready" and plan.create == [] and plan.delete == []
    assert plan.status["members"] == {"desired": 2, "scheduled": 2, "ready": 2}
    assert plan.status["placement"] == [{"member": 0, "pod": "llama-0-0", "node": "node-0", "domain": "b0"},
                                        {"member": 1, "pod": "llama-0-1", "node": "node-1", "domain": "b0"}]
    assert cond_of(plan.status, "Ready")["reason"] == "AllMembersReady"
    assert [e.reason for e in plan.events] == ["SliceReady"]


def test_reconciling_a_ready_slice_again_changes_nothing():
    body, spec, rev = setup()
    pods = [member(0, rev), member(1, rev)]
    first = plan_slice(body, spec, pods, now=T0)
    second = plan_slice(with_status(body, first), spec, pods, now=T0 + dt.timedelta(minutes=5))
    assert second.status == first.status
    assert second.create == [] and second.delete == [] and second.events == []


def test_unschedulable_member_is_reported_with_the_schedulers_words():
    body, spec, rev = setup()
    pods = [member(0, rev), member(1, rev, phase="Pending", ready=False, node=None,
                                  unschedulable="0/12 nodes are available: 12 Insufficient nvidia.com/gpu.")]
    plan = plan_slice(body, spec, pods, now=T0)
    placed = cond_of(plan.status, "Placed")
    assert placed["reason"] == "Unschedulable" and "Insufficient nvidia.com/gpu" in placed["message"]
    assert cond_of(plan.status, "Ready")["reason"] == "Unschedulable"


def test_member_not_ready_after_ready_is_degraded_not_restarted():
    body, spec, rev = setup()
    ready = plan_slice(body, spec, [member(0, rev), member(1, rev)], now=T0)
    plan = plan_slice(with_status(body, ready), spec, [member(0, rev), member(1, rev, ready=False)], now=T0)
    assert plan.status["phase"] == "Degraded" and plan.delete == [] and plan.create == []
    assert "llama-0-1" in cond_of(plan.status, "Ready")["message"]


@pytest.mark.parametrize(
    "broken, reason",
    [
        (dict(phase="Failed", ready=False), "MemberFailed"),
        (dict(restarts=1), "ContainerRestarted"),
        (dict(phase="Succeeded", ready=False), "MemberExited"),
    ],
)
def test_a_failed_member_restarts_the_whole_gang(broken, reason):
    body, spec, rev = setup()
    ready = plan_slice(body, spec, [member(0, rev), member(1, rev)], now=T0)
    plan = plan_slice(with_status(body, ready), spec, [member(0, rev), member(1, rev, **broken)], now=T0)
    assert plan.counts_restart
    assert sorted(plan.delete) == ["llama-0-0", "llama-0-1"] and plan.create == []
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1
    assert plan.status["lastRestart"]["reason"] == reason and plan.status["lastRestart"]["member"] == 1
    assert plan.status["restartNotBefore"] == "2026-01-01T00:00:10Z"
    assert plan.requeue_after == 10
    assert [e.reason for e in plan.events] == ["GangRestart"]


def test_a_vanished_member_of_a_ready_gang_is_a_failure_but_not_while_placing():
    body, spec, rev = setup()
    ready = plan_slice(body, spec, [member(0, rev), member(1, rev)], now=T0)
    plan = plan_slice(with_status(body, ready), spec, [member(0, rev)], now=T0)
    assert plan.counts_restart and plan.status["lastRestart"]["reason"] == "MemberLost"
    placing = plan_slice(body, spec, [member(0, rev, ready=False)], now=T0)
    assert not placing.counts_restart and len(placing.create) == 1


def test_full_restart_cycle_backoff_then_next_attempt():
    body, spec, rev = setup()
    ready = plan_slice(body, spec, [member(0, rev), member(1, rev)], now=T0)
    failed = plan_slice(with_status(body, ready), spec, [member(0, rev), member(1, rev, phase="Failed", ready=False)], now=T0)
    body = with_status(body, failed)
    # old pods still terminating: wait
    terminating = [member(0, rev, deleting=True), member(1, rev, deleting=True)]
    plan = plan_slice(body, spec, terminating, now=T0 + dt.timedelta(seconds=20))
    assert plan.create == [] and plan.status["phase"] == "Restarting" and not plan.counts_restart
    # gone, but backoff not over
    plan = plan_slice(body, spec, [], now=T0 + dt.timedelta(seconds=5))
    assert plan.create == [] and plan.status["phase"] == "Restarting" and plan.requeue_after == 5
    assert cond_of(plan.status, "Placed")["reason"] == "BackingOff"
    # backoff over: attempt 1 is created
    plan = plan_slice(body, spec, [], now=T0 + dt.timedelta(seconds=11))
    assert [p["metadata"]["labels"]["tokenfleet.dev/attempt"] for p in plan.create] == ["1", "1"]
    assert plan.status["phase"] == "Placing" and plan.status["restarts"] == 1
    # the old attempt's pods are never counted again, only deleted
    body = with_status(body, plan)
    plan = plan_slice(body, spec, [member(0, rev, attempt=0, phase="Failed"), member(0, rev, attempt=1)], now=T0 + dt.timedelta(seconds=12))
    assert not plan.counts_restart and plan.status["restarts"] == 1


def test_restart_budget_exhausted_fails_the_slice_and_keeps_it_down():
    body, spec, rev = setup(restartPolicy={"maxRestarts": 1, "backoffSeconds": 0, "maxBackoffSeconds": 1})
    status = {"phase": "Ready", "restarts": 1, "revision": rev}
    plan = plan_slice({**body, "status": status}, spec, [member(0, rev, attempt=1), member(1, rev, attempt=1, phase="Failed")], now=T0)
    assert plan.status["phase"] == "Failed" and sorted(plan.delete) == ["llama-0-0", "llama-0-1"]
    assert cond_of(plan.status, "Failed") == {**cond_of(plan.status, "Failed"), "status": "True", "reason": "RestartBudgetExhausted"}
    assert [e.reason for e in plan.events] == ["RestartBudgetExhausted"]
    again = plan_slice(with_status(body, plan), spec, [], now=T0 + dt.timedelta(hours=1))
    assert again.create == [] and again.status["phase"] == "Failed"


def config_error_pod(i, rev, code, attempt=0):
    """A member whose serving container exited ``code`` with tokenfleet serve's one-line reason."""
    status = {"phase": "Failed", "containerStatuses": [{"name": "serving", "restartCount": 0, "state": {"terminated": {
        "exitCode": code, "reason": "Error",
        "message": "tokenfleet serve: error: --draft-model: tokenizer.json differs from the model's"}}}]}
    pod = {"metadata": {"name": f"llama-0-{i}", "labels": {"tokenfleet.dev/member": str(i),
                                                          "tokenfleet.dev/attempt": str(attempt),
                                                          "tokenfleet.dev/revision": rev}},
           "spec": {"nodeName": f"node-{i}"}, "status": status}
    return pod_view(pod)


def test_a_member_that_exits_with_a_configuration_error_fails_the_slice_without_a_restart():
    body, spec, rev = setup()
    assert spec.restart_policy.fail_on_exit_codes is None and spec.restart_policy.permanent_exit_codes == [2]
    pods = [member(0, rev), config_error_pod(1, rev, 2)]
    assert pods[1].exit_code == 2
    plan = plan_slice({**body, "status": {"phase": "Ready", "revision": rev}}, spec, pods, now=T0)
    assert plan.status["phase"] == "Failed" and plan.status["restarts"] == 0 and not plan.counts_restart
    assert sorted(plan.delete) == ["llama-0-0", "llama-0-1"] and plan.create == []
    failed = cond_of(plan.status, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "ConfigurationError"
    assert "exited with code 2" in failed["message"] and "--draft-model: tokenizer.json differs" in failed["message"]
    assert cond_of(plan.status, "Stalled")["status"] == "True"
    assert [e.reason for e in plan.events] == ["ConfigurationError"]
    # it stays down (no new attempt, no event again) until the spec changes
    again = plan_slice(with_status(body, plan), spec, [], now=T0 + dt.timedelta(hours=1))
    assert again.create == [] and again.status["phase"] == "Failed" and again.events == []
    assert cond_of(again.status, "Failed")["reason"] == "ConfigurationError"
    changed_body, changed_spec, _ = setup(restartPolicy={"maxRestarts": 3})
    fresh = plan_slice({**changed_body, "status": again.status}, changed_spec, [], now=T0 + dt.timedelta(hours=2))
    assert fresh.status["phase"] == "Placing" and len(fresh.create) == 2


@pytest.mark.parametrize("code, policy", [(1, None), (2, [])])
def test_other_exit_codes_and_an_empty_fail_on_exit_codes_restart_the_gang(code, policy):
    restart = {"backoffSeconds": 0, "maxBackoffSeconds": 1} | ({"failOnExitCodes": policy} if policy is not None else {})
    body, spec, rev = setup(restartPolicy=restart)
    pods = [member(0, rev), config_error_pod(1, rev, code)]
    plan = plan_slice({**body, "status": {"phase": "Ready", "revision": rev}}, spec, pods, now=T0)
    assert plan.status["phase"] == "Restarting" and plan.counts_restart and plan.status["restarts"] == 1
    assert plan.status["lastRestart"]["reason"] == "MemberFailed"


def test_spec_change_recreates_the_gang_with_a_fresh_budget():
    body, spec, rev = setup()
    old_status = {"phase": "Failed", "restarts": 2, "revision": "old-rev",
                  "lastRestart": {"time": "2026-01-01T00:00:00Z", "reason": "MemberFailed", "message": ""}}
    pods = [member(0, "old-rev", attempt=2, deleting=True)]
    plan = plan_slice({**body, "status": old_status}, spec, pods, now=T0)
    assert plan.status["restarts"] == 0 and "lastRestart" not in plan.status
    assert plan.create == []  # waits for the old pod to go
    assert "SpecChanged" in [e.reason for e in plan.events]
    plan = plan_slice({**body, "status": old_status}, spec, [], now=T0)
    assert len(plan.create) == 2 and plan.status["phase"] == "Placing"


def test_outdated_pods_are_deleted_before_new_ones_are_made():
    body, spec, rev = setup()
    plan = plan_slice({**body, "status": {"phase": "Ready", "revision": rev}}, spec,
                      [member(0, "other"), member(1, "other")], now=T0)
    assert sorted(plan.delete) == ["llama-0-0", "llama-0-1"] and plan.create == []
    assert not plan.counts_restart


def test_invalid_spec_fails_without_pods():
    body, spec, rev = setup(topology="4x4")
    plan = plan_slice(body, spec, [member(0, rev)], now=T0)
    assert plan.status["phase"] == "Failed" and plan.delete == ["llama-0-0"] and plan.create == []
    assert cond_of(plan.status, "Ready")["reason"] == "TopologyMismatch"
    assert [e.reason for e in plan.events] == ["TopologyMismatch"]
    assert plan_slice(with_status(body, plan), spec, [], now=T0).events == []


def test_not_admitted_means_pending_without_pods():
    body, spec, rev = setup()
    plan = plan_slice(body, spec, [], now=T0, admission=Admission(False, None, "InsufficientCapacity", "needs 2 hosts in one block"))
    assert plan.status["phase"] == "Pending" and plan.create == []
    assert cond_of(plan.status, "Admitted") == {**cond_of(plan.status, "Admitted"), "status": "False", "reason": "InsufficientCapacity"}


def test_admission_with_nodes_binds_members():
    body, spec, rev = setup()
    plan = plan_slice(body, spec, [], now=T0, admission=Admission(True, {0: "a", 1: "b"}, "GangPlaced", "block 0"))
    assert [p["spec"].get("nodeName") for p in plan.create] == ["a", "b"]


def test_restart_tells_the_gang_where_to_restore_from():
    body, spec, rev = setup(role="batch", checkpoint={"store": "pvc://ckpt/run"})
    status = {"phase": "Restarting", "restarts": 1, "revision": rev, "checkpoint": {"latest": "step-9"}}
    plan = plan_slice({**body, "status": status}, spec, [], now=T0)
    env = {e["name"]: e["value"] for e in plan.create[0]["spec"]["containers"][0]["env"]}
    # the store, not the last checkpoint the operator saw: the workload finds the newest commit there
    assert env["TOKENFLEET_RESTORE_FROM"] == "pvc://ckpt/run"
    assert plan.status["checkpoint"] == {"latest": "step-9", "restoredAt": "2026-01-01T00:00:00Z"}
    first = plan_slice({**body, "status": {"phase": "Placing", "revision": rev}}, spec, [], now=T0)
    assert "TOKENFLEET_RESTORE_FROM" not in {e["name"] for e in first.create[0]["spec"]["containers"][0]["env"]}
    _, cold, cold_rev = setup(role="batch", checkpoint={"store": "pvc://ckpt/run", "restoreOnRestart": False})
    plan = plan_slice({**body, "status": {**status, "revision": cold_rev}}, cold, [], now=T0)
    assert "TOKENFLEET_RESTORE_FROM" not in {e["name"] for e in plan.create[0]["spec"]["containers"][0]["env"]}


def batch_setup():
    return setup(role="batch", checkpoint={"store": "pvc://ckpt/run"})


def test_a_batch_member_that_finishes_is_done_not_failed():
    body, spec, rev = batch_setup()
    running = {"phase": "Ready", "revision": rev}
    plan = plan_slice({**body, "status": running}, spec, [member(0, rev), member(1, rev, phase="Succeeded", ready=False)],
                      now=T0)
    assert plan.status["phase"] == "Ready" and plan.delete == [] and not plan.counts_restart
    assert plan.status["members"] == {"desired": 2, "scheduled": 2, "ready": 2, "succeeded": 1}
    assert cond_of(plan.status, "Complete")["status"] == "False"
    assert plan.requeue_after == 5.0                     # to read the leader's checkpoint again
    # a serving member that exits is a failure of the gang
    body, spec, rev = setup()
    plan = plan_slice({**body, "status": {"phase": "Ready", "revision": rev}}, spec,
                      [member(0, rev), member(1, rev, phase="Succeeded", ready=False)], now=T0)
    assert plan.status["phase"] == "Restarting" and plan.status["lastRestart"]["reason"] == "MemberExited"


def test_a_batch_slice_whose_members_all_succeed_is_complete_and_stays_so():
    body, spec, rev = batch_setup()
    done = [member(m, rev, attempt=1, phase="Succeeded", ready=False) for m in range(2)]
    plan = plan_slice({**body, "status": {"phase": "Ready", "revision": rev, "restarts": 1}}, spec, done, now=T0)
    assert plan.status["phase"] == "Succeeded" and plan.delete == [] and plan.create == []
    assert cond_of(plan.status, "Complete")["status"] == "True"
    assert cond_of(plan.status, "Ready")["reason"] == "Completed" and cond_of(plan.status, "Failed")["status"] == "False"
    # done is where a GitOps tool wants it: Ready, not Reconciling (kstatus Current), and no SliceReady Event
    assert cond_of(plan.status, "Ready")["status"] == "True" and cond_of(plan.status, "Reconciling")["status"] == "False"
    assert [(e.reason, e.message) for e in plan.events] == [("Completed", "all 2 members exited successfully after 1 gang restarts")]
    assert plan.requeue_after is None
    # its pods going away later changes nothing, and no Event is repeated
    again = plan_slice(with_status(body, plan), spec, [], now=T0)
    assert again.status["phase"] == "Succeeded" and again.create == [] and again.events == []
    # a new spec is a new job
    _, spec2, rev2 = setup(role="batch", checkpoint={"store": "pvc://ckpt/run"}, hosts=1, topology=None)
    fresh = plan_slice(with_status(body, plan), spec2, done, now=T0)
    assert fresh.status["phase"] == "Placing" and fresh.status["revision"] == rev2
    assert sorted(fresh.delete) == ["llama-0-0", "llama-0-1"]        # the old job's pods go first


def test_a_failed_batch_member_restarts_the_whole_gang_even_after_others_finished():
    body, spec, rev = batch_setup()
    pods = [member(0, rev, phase="Failed", ready=False, failure="OOMKilled"), member(1, rev, phase="Succeeded", ready=False)]
    plan = plan_slice({**body, "status": {"phase": "Ready", "revision": rev}}, spec, pods, now=T0)
    assert plan.status["phase"] == "Restarting" and sorted(plan.delete) == ["llama-0-0", "llama-0-1"]
    assert plan.status["lastRestart"]["reason"] == "MemberFailed"


def test_the_leaders_reported_checkpoint_lands_in_status():
    body, spec, rev = batch_setup()
    old = {"phase": "Ready", "revision": rev, "checkpoint": {"latest": "r000001-a", "restoredAt": "2025-12-31T00:00:00Z"}}
    plan = plan_slice({**body, "status": old}, spec, [member(0, rev), member(1, rev)], now=T0,
                      reported_checkpoint={"latest": "r000002-b", "savedAt": "2026-01-01T00:00:00Z"})
    assert plan.status["checkpoint"] == {"latest": "r000002-b", "savedAt": "2026-01-01T00:00:00Z",
                                         "restoredAt": "2025-12-31T00:00:00Z"}
    # nothing read (the leader is gone or not up yet): the last known checkpoint stays
    plan = plan_slice({**body, "status": old}, spec, [member(0, rev), member(1, rev)], now=T0, reported_checkpoint=None)
    assert plan.status["checkpoint"] == old["checkpoint"]


def test_backoff_doubles_and_caps():
    _, spec, _ = setup(restartPolicy={"maxRestarts": 10, "backoffSeconds": 10, "maxBackoffSeconds": 60})
    assert [backoff_seconds(spec, n) for n in range(0, 6)] == [0, 10, 20, 40, 60, 60]
    assert backoff_seconds(spec, 1000) == 60


def test_pod_view_reads_a_real_pod_object():
    pod = {
        "metadata": {"name": "s-1", "labels": {"tokenfleet.dev/member": "1", "tokenfleet.dev/attempt": "3",
                                               "tokenfleet.dev/revision": "r"}, "deletionTimestamp": "x"},
        "spec": {"nodeName": "n1"},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "a", "restartCount": 2, "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}],
        },
    }
    view = pod_view(pod)
    assert view == PodView(name="s-1", member=1, attempt=3, revision="r", phase="Running", ready=True, node="n1",
                           deleting=True, restarts=2, unschedulable=None, failure="container a exited with code 137 (OOMKilled)",
                           exit_code=137)
    bare = pod_view({"metadata": {"name": "x", "labels": {"tokenfleet.dev/member": "zero"}}, "spec": {}})
    assert bare.member is None and bare.phase == "Pending" and not bare.ready


def test_deleting_a_current_member_restarts_the_gang_at_once():
    body, spec, rev = setup()
    ready = plan_slice(body, spec, [member(0, rev), member(1, rev)], now=T0)
    plan = plan_slice(with_status(body, ready), spec, [member(0, rev), member(1, rev, deleting=True)], now=T0)
    assert plan.counts_restart and plan.status["lastRestart"]["reason"] == "MemberDeleted"
    assert plan.delete == ["llama-0-0"]  # the other one is already going


def kstatus_of(status):
    return tuple(cond_of(status, t)["status"] for t in ("Ready", "Reconciling", "Stalled"))


def test_reconciling_and_stalled_follow_the_phase():
    """kstatus reads Reconciling=True as in progress and Stalled=True as failed; Ready=True with neither is current."""
    body, spec, rev = setup(restartPolicy={"maxRestarts": 1, "backoffSeconds": 10, "maxBackoffSeconds": 10})
    placing = plan_slice(body, spec, [], now=T0)
    assert placing.status["phase"] == "Placing" and kstatus_of(placing.status) == ("False", "True", "False")
    assert cond_of(placing.status, "Reconciling")["reason"] == cond_of(placing.status, "Ready")["reason"]
    ready = plan_slice(with_status(body, placing), spec, [member(0, rev), member(1, rev)], now=T0)
    assert ready.status["phase"] == "Ready" and kstatus_of(ready.status) == ("True", "False", "False")
    degraded = plan_slice(with_status(body, ready), spec, [member(0, rev), member(1, rev, ready=False)], now=T0)
    assert degraded.status["phase"] == "Degraded" and kstatus_of(degraded.status) == ("False", "True", "False")
    failing = [member(0, rev), member(1, rev, phase="Failed", ready=False)]
    restarting = plan_slice(with_status(body, ready), spec, failing, now=T0)
    assert restarting.status["phase"] == "Restarting" and kstatus_of(restarting.status) == ("False", "True", "False")
    again = [member(0, rev, attempt=1), member(1, rev, attempt=1, phase="Failed", ready=False)]
    failed = plan_slice({**body, "status": {**ready.status, "restarts": 1}}, spec, again, now=T0)
    assert failed.status["phase"] == "Failed" and kstatus_of(failed.status) == ("False", "False", "True")
    assert cond_of(failed.status, "Stalled")["reason"] == "RestartBudgetExhausted"
    pending = plan_slice(body, spec, [member(0, rev, node=None, ready=False), member(1, rev, node=None, ready=False)],
                         now=T0, admission=Admission(False, reason="InsufficientCapacity", message="no room",
                                                     scheduler_name="tokenfleet"))
    assert pending.status["phase"] == "Pending" and kstatus_of(pending.status) == ("False", "True", "False")
