"""The Slice state machine when the gang scheduler places the members."""
import datetime as dt

from tokenfleet_operator.api import SliceSpec
from tokenfleet_operator.gang.plan import SCHEDULER_NAME
from tokenfleet_operator.gang.slice_state import Admission, PodView, plan_slice, slice_revision

from harness.gang_objects import slice_obj

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
WAIT = Admission(False, reason="InsufficientCapacity",
                 message="needs 16 × nvidia.com/gpu (2 hosts × 8) in one tokenfleet.dev/block; the best has 6 free",
                 scheduler_name=SCHEDULER_NAME)


def setup(status=None):
    body = slice_obj("g", status=status)
    spec = SliceSpec.model_validate(body["spec"])
    return body, spec, slice_revision(spec)


def pod(i, rev, node=None, **kw):
    kw.setdefault("phase", "Running" if node else "Pending")
    return PodView(name=f"g-{i}", member=i, attempt=0, revision=rev, node=node, **kw)


def cond(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_waiting_gang_creates_unbound_members_for_the_gang_scheduler_and_says_why():
    body, spec, rev = setup()
    plan = plan_slice(body, spec, [], now=T0, admission=WAIT)
    assert [p["metadata"]["name"] for p in plan.create] == ["g-0", "g-1"]
    assert all(p["spec"]["schedulerName"] == SCHEDULER_NAME and "nodeName" not in p["spec"] for p in plan.create)
    assert plan.status["phase"] == "Pending"
    admitted = cond(plan.status, "Admitted")
    assert (admitted["status"], admitted["reason"]) == ("False", "InsufficientCapacity")
    assert "best has 6 free" in admitted["message"]
    assert plan.status["admission"] == {"queuedAt": "2030-01-01T00:00:00Z"}


def test_waiting_status_does_not_churn():
    body, spec, rev = setup({"admission": {"queuedAt": "2030-01-01T00:00:00Z"}})
    later = T0 + dt.timedelta(minutes=5)
    plan = plan_slice(body, spec, [pod(0, rev), pod(1, rev)], now=later, admission=WAIT)
    assert plan.create == [] and plan.delete == []
    assert plan.status["admission"] == {"queuedAt": "2030-01-01T00:00:00Z"}


def test_requeue_state_is_shown_while_held_back():
    body, spec, rev = setup({"admission": {"queuedAt": "2030-01-01T00:00:00Z"}})
    held = Admission(False, reason="RequeueBackoff", message="held back", scheduler_name=SCHEDULER_NAME,
                     requeues=2, requeue_at="2030-01-01T00:10:00Z")
    plan = plan_slice(body, spec, [pod(0, rev), pod(1, rev)], now=T0, admission=held)
    assert plan.status["admission"] == {"queuedAt": "2030-01-01T00:00:00Z", "requeues": 2, "requeueAt": "2030-01-01T00:10:00Z"}


def test_partly_bound_gang_is_admitted_and_binding():
    body, spec, rev = setup()
    plan = plan_slice(body, spec, [pod(0, rev, node="n0"), pod(1, rev)], now=T0, admission=WAIT)
    assert plan.status["phase"] == "Admitted"
    assert cond(plan.status, "Placed")["reason"] == "Binding"


def test_fully_bound_gang_is_placed_and_records_its_wait():
    body, spec, rev = setup({"admission": {"queuedAt": "2030-01-01T00:00:00Z"}})
    placed = Admission(True, reason="Placed", message="placed 2 members in tokenfleet.dev/block b: g-0→n0, g-1→n1",
                       scheduler_name=SCHEDULER_NAME)
    now = T0 + dt.timedelta(seconds=42)
    plan = plan_slice(body, spec, [pod(0, rev, node="n0"), pod(1, rev, node="n1")], now=now, admission=placed,
                      node_domains={"n0": "b", "n1": "b"})
    assert plan.status["phase"] == "Placing"
    assert cond(plan.status, "Admitted")["reason"] == "Placed" and "g-1→n1" in cond(plan.status, "Admitted")["message"]
    assert cond(plan.status, "Placed")["status"] == "True"
    assert plan.status["admission"] == {"queuedAt": "2030-01-01T00:00:00Z", "admittedAt": "2030-01-01T00:00:42Z",
                                        "waitSeconds": 42}
    # without the scheduler's message (e.g. after an operator restart) the domain is named from the nodes
    plan = plan_slice(body, spec, [pod(0, rev, node="n0"), pod(1, rev, node="n1")], now=now, admission=WAIT,
                      node_domains={"n0": "b", "n1": "b"})
    assert cond(plan.status, "Admitted")["message"] == "all 2 members bound by the gang scheduler in tokenfleet.dev/block b"


def test_rollback_of_a_partly_bound_gang_costs_no_restart():
    body, spec, rev = setup()
    pods = [pod(0, rev, node="n0", deleting=True), pod(1, rev, deleting=True)]
    plan = plan_slice(body, spec, pods, now=T0, admission=WAIT)
    assert not plan.counts_restart and plan.status["restarts"] == 0
    assert plan.create == []  # waits for the old pods to go
    plan = plan_slice(body, spec, [], now=T0, admission=WAIT)
    assert [p["metadata"]["name"] for p in plan.create] == ["g-0", "g-1"] and plan.status["restarts"] == 0


def test_losing_a_member_of_a_fully_bound_gang_is_a_restart():
    body, spec, rev = setup({"phase": "Placing"})
    pods = [pod(0, rev, node="n0", deleting=True), pod(1, rev, node="n1")]
    plan = plan_slice(body, spec, pods, now=T0, admission=WAIT)
    assert plan.counts_restart and plan.status["restarts"] == 1
    assert plan.status["lastRestart"]["reason"] == "MemberDeleted"


def test_preempted_gang_gives_its_members_back_without_a_restart():
    body, spec, rev = setup({"phase": "Ready", "admission": {"queuedAt": "2030-01-01T00:00:00Z",
                                                              "admittedAt": "2030-01-01T00:00:05Z", "waitSeconds": 5}})
    pre = Admission(False, reason="Queued", message="", scheduler_name=SCHEDULER_NAME, preempted_by="ns/high")
    pods = [pod(0, rev, node="n0", ready=True), pod(1, rev, node="n1", ready=True, deleting=True)]
    plan = plan_slice(body, spec, pods, now=T0 + dt.timedelta(minutes=1), admission=pre)
    assert plan.delete == ["g-0"] and not plan.counts_restart and plan.status["restarts"] == 0
    assert plan.status["phase"] == "Pending" and cond(plan.status, "Admitted")["reason"] == "Preempted"
    assert "ns/high" in cond(plan.status, "Admitted")["message"]
    assert plan.status["admission"] == {"queuedAt": "2030-01-01T00:01:00Z"}
    # once they are gone the gang is made again, unbound, and queues
    plan = plan_slice({**body, "status": plan.status}, spec, [], now=T0 + dt.timedelta(minutes=2), admission=pre)
    assert len(plan.create) == 2 and plan.status["phase"] == "Pending" and not plan.counts_restart


def test_cpu_slices_keep_the_default_scheduler():
    body = slice_obj("c", accel="cpu", per_host=1)
    spec = SliceSpec.model_validate(body["spec"])
    plan = plan_slice(body, spec, [], now=T0, admission=Admission())
    assert len(plan.create) == 2 and all("schedulerName" not in p["spec"] for p in plan.create) and plan.status["phase"] == "Placing"
