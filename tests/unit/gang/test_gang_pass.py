"""The gang scheduler's pass, pure: snapshot dicts in, binds/rollbacks/evictions/reasons out."""
from __future__ import annotations

import pytest

from tokenfleet_operator.api.slice import SliceSpec
from tokenfleet_operator.gang.plan import NOT_GANG, PARTIAL, PENDING, RUNNING, SCHEDULER_NAME, SETTLING, classify, plan_pass, queued_at
from tokenfleet_operator.gang.snapshot import (
    admission_timeline,
    extended_resources,
    node_from_object,
    pod_requests,
    queue_from_object,
    slice_request,
)

from harness.gang_objects import T0_S, members, node, other_pod, queue_obj, slice_obj, two_blocks


def spec_of(obj):
    return SliceSpec.model_validate(obj["spec"])


# ---------------------------------------------------------------- classify

def test_classify_states():
    s = slice_obj("s")
    assert classify(s, spec_of(s), members(s)) == PENDING
    assert classify(s, spec_of(s), members(s)[:1]) == SETTLING  # a member is still missing
    assert classify(s, spec_of(s), members(s, nodes=["a0", "a1"])) == RUNNING
    assert classify(s, spec_of(s), members(s, nodes=["a0", None])) == PARTIAL
    deleting = members(s)
    deleting[1]["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:01Z"
    assert classify(s, spec_of(s), deleting) == SETTLING
    cpu = slice_obj("c", accel="cpu")
    assert classify(cpu, spec_of(cpu), []) == NOT_GANG
    # pods of an older attempt are not placed: the Slice controller replaces them first
    assert classify(s, spec_of(s), members(s, attempt=1)) == SETTLING
    # pods made for the default scheduler are never touched
    foreign = members(s)
    for p in foreign:
        p["spec"].pop("schedulerName")
    assert classify(s, spec_of(s), foreign) == NOT_GANG
    # a finished batch job holds nothing and waits for nothing
    done = members(s, nodes=["a0", "a1"])
    for p in done:
        p["status"] = {"phase": "Succeeded"}
    assert classify(s, spec_of(s), done) == SETTLING                  # until the operator records it
    assert classify({**s, "status": {"phase": "Succeeded"}}, spec_of(s), done) == NOT_GANG


def test_member_pods_carry_the_scheduler_name_and_no_colocation_affinity():
    pods = members(slice_obj("s"))
    assert all(p["spec"]["schedulerName"] == SCHEDULER_NAME for p in pods)
    assert all("affinity" not in p["spec"] and "nodeName" not in p["spec"] for p in pods)


# ---------------------------------------------------------------- conversions

def test_node_and_pod_conversion_keeps_only_whole_extended_resources():
    n = node_from_object(node("a0", "a", 0, taints=[{"key": "team", "value": "x", "effect": "NoSchedule"}], ready=False))
    assert dict(n.allocatable) == {"nvidia.com/gpu": 8} and not n.ready and n.taints[0].key == "team"
    assert extended_resources({"cpu": "4", "example.com/x": "500m", "nvidia.com/gpu": "2", "hugepages-2Mi": "1"}) == {
        "nvidia.com/gpu": 2}
    pod = {"spec": {"containers": [
        {"resources": {"limits": {"nvidia.com/gpu": "2"}}},
        {"resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}}]}}
    assert pod_requests(pod) == {"nvidia.com/gpu": 3}


def test_slice_request_carries_selector_tolerations_priority_and_queue():
    s = slice_obj("s", priority=7, queue="team", topology="2x8")
    s["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "p1"}
    s["spec"]["template"]["spec"]["tolerations"] = [{"key": "team", "operator": "Exists", "effect": "NoSchedule"}]
    r = slice_request(s, spec_of(s), created=5.0)
    assert (r.key, r.resource, r.per_host, r.hosts, r.topology, r.priority, r.queue, r.created) == (
        "ns/s", "nvidia.com/gpu", 8, 2, "2x8", 7, "team", 5.0)
    assert dict(r.node_selector) == {"pool": "p1", "tokenfleet.dev/accelerator": "h100"}
    assert r.domain_label == "tokenfleet.dev/block" and r.tolerations[0].key == "team"


def test_queue_conversion_and_errors_name_the_queue():
    q = queue_from_object(queue_obj("team", quota={"nvidia.com/gpu": 16}, queueingStrategy="StrictFIFO",
                                    preemption="LowerPriority", admissionTimeoutSeconds=30,
                                    requeue={"baseSeconds": 5, "maxSeconds": 40}))
    assert dict(q.queue.quota) == {"nvidia.com/gpu": 16} and q.queue.strategy == "StrictFIFO"
    assert (q.admission_timeout, q.requeue_base, q.requeue_cap) == (30.0, 5.0, 40.0)
    with pytest.raises(ValueError, match="SliceQueue bad"):
        queue_from_object(queue_obj("bad", quota={"nvidia.com/gpu": -1}))
    with pytest.raises(ValueError, match="SliceQueue bad2: spec.requeue.baseSeconds"):
        queue_from_object(queue_obj("bad2", requeue={"baseSeconds": 100, "maxSeconds": 10}))


# ---------------------------------------------------------------- admission timeline

def test_admission_timeline_replays_timeouts_and_backoff():
    # timeout 10, base 5, cap 20: wait [0,10) hold [10,15) wait [15,25) hold [25,35) wait [35,45) hold [45,65) ...
    at = lambda now: admission_timeline(0.0, now, 10, 5, 20)  # noqa: E731
    assert at(9.9) == (0, 0.0, None) or at(9.9).requeues == 0
    assert (at(9.9).requeues, at(9.9).held_until) == (0, None)
    assert (at(10).requeues, at(10).held_until) == (1, 15)
    assert (at(15).requeues, at(15).queued_since, at(15).held_until) == (1, 15, None)
    assert (at(30).requeues, at(30).held_until) == (2, 35)
    assert (at(50).requeues, at(50).held_until) == (3, 65)
    assert (at(70).requeues, at(70).queued_since) == (3, 65)
    # after the cap is reached the periods are 30 s long; a far-away now is computed without a long loop
    far = admission_timeline(0.0, 65 + 30 * 1_000_000 + 12, 10, 5, 20)
    assert far.requeues == 3 + 1_000_000 + 1 and far.held_until == 65 + 30 * 1_000_000 + 30
    assert admission_timeline(0.0, 1e9, None).requeues == 0


def test_queued_at_prefers_status_then_oldest_member():
    s = slice_obj("s", status={"admission": {"queuedAt": "2030-01-01T00:01:00Z"}})
    assert queued_at(s, members(s)) == T0_S + 60
    again = slice_obj("s", status={"admission": {"queuedAt": "2030-01-01T00:01:00Z", "admittedAt": "2030-01-01T00:02:00Z"}})
    assert queued_at(again, members(again, created="2030-01-01T01:00:00Z")) == T0_S + 3600


# ---------------------------------------------------------------- plan_pass

def test_fitting_slice_is_bound_whole_in_one_block():
    s = slice_obj("s")
    plan = plan_pass(two_blocks(), members(s), [s], [], now=T0_S + 1)
    assert len(plan.binds) == 1 and not plan.waiting
    bind = plan.binds[0]
    assert [p.name for p, _ in bind.members] == ["s-0", "s-1"]
    assert [p.uid for p, _ in bind.members] == ["pod-uid-s-0", "pod-uid-s-1"]
    nodes = [n for _, n in bind.members]
    assert len(set(nodes)) == 2 and {n[0] for n in nodes} in ({"a"}, {"b"})
    assert "placed 2 members in tokenfleet.dev/block" in bind.message


def test_slice_that_cannot_fit_binds_nothing_and_says_why_with_numbers():
    s = slice_obj("big", hosts=3)
    plan = plan_pass(two_blocks(), members(s), [s], [], now=T0_S)
    assert not plan.binds
    wait = plan.waiting["ns/big"]
    assert wait.code == "DomainTooSmall" and "24" in wait.message and "2 matching hosts" in wait.message


def test_used_capacity_is_counted_and_insufficient_capacity_reports_the_best_block():
    s = slice_obj("s")
    hogs = [other_pod("a0", 4, name="h1"), other_pod("b1", 6, name="h2")]
    plan = plan_pass(two_blocks(), members(s) + hogs, [s], [], now=T0_S)
    wait = plan.waiting["ns/s"]
    assert wait.code == "InsufficientCapacity"
    assert "needs 16 × nvidia.com/gpu (2 hosts × 8)" in wait.message and "1 host with ≥8 free" in wait.message


def test_two_competing_slices_never_share_capacity_and_priority_wins():
    low = slice_obj("low", priority=0, created="2030-01-01T00:00:00Z")
    high = slice_obj("high", priority=10, created="2030-01-01T00:05:00Z")
    one_block = [node(f"a{i}", "a", i) for i in range(2)]
    plan = plan_pass(one_block, members(low) + members(high), [low, high], [], now=T0_S + 400)
    assert [b.slice_key for b in plan.binds] == ["ns/high"]
    assert plan.waiting["ns/low"].code == "InsufficientCapacity"


def test_fifo_within_a_priority():
    first = slice_obj("z-first", created="2030-01-01T00:00:00Z")
    second = slice_obj("a-second", created="2030-01-01T00:00:05Z")
    one_block = [node(f"a{i}", "a", i) for i in range(2)]
    pods = members(first, created="2030-01-01T00:00:00Z") + members(second, created="2030-01-01T00:00:05Z")
    plan = plan_pass(one_block, pods, [second, first], [], now=T0_S + 10)
    assert [b.slice_key for b in plan.binds] == ["ns/z-first"]


def test_running_gangs_hold_capacity_and_partial_gangs_are_rolled_back():
    running = slice_obj("run")
    partial = slice_obj("half")
    waiting = slice_obj("wait")
    pods = members(running, nodes=["a0", "a1"]) + members(partial, nodes=["b0", None]) + members(waiting)
    plan = plan_pass(two_blocks(), pods, [running, partial, waiting], [], now=T0_S)
    assert [r.slice_key for r in plan.rollbacks] == ["ns/half"]
    assert {p.name for p in plan.rollbacks[0].pods} == {"half-0", "half-1"}
    assert "1 of 2 members were bound" in plan.rollbacks[0].reason
    # b0 is still held by the partial member (it is deleted in this pass, not yet gone): nothing fits
    assert not plan.binds and plan.waiting["ns/wait"].code == "InsufficientCapacity"
    assert plan.states == {"ns/run": RUNNING, "ns/half": PARTIAL, "ns/wait": PENDING}


def test_quota_of_a_slice_queue_and_queue_status():
    q = queue_obj("team", quota={"nvidia.com/gpu": 16})
    a = slice_obj("a", queue="team", created="2030-01-01T00:00:00Z")
    b = slice_obj("b", queue="team", created="2030-01-01T00:00:01Z")
    pods = members(a, created="2030-01-01T00:00:00Z") + members(b, created="2030-01-01T00:00:01Z")
    plan = plan_pass(two_blocks(), pods, [a, b], [q], now=T0_S + 5)
    assert [x.slice_key for x in plan.binds] == ["ns/a"]
    assert plan.waiting["ns/b"].code == "QuotaExceeded" and "16 of its quota of 16" in plan.waiting["ns/b"].message
    counts = {k: plan.queue_status["team"][k] for k in ("pendingSlices", "admittedSlices", "usage")}
    assert counts == {"pendingSlices": 1, "admittedSlices": 1, "usage": {"nvidia.com/gpu": 16}}
    assert plan.pending_by_queue == {"team": 1}


def test_queue_status_carries_kstatus_conditions_that_keep_their_transition_time():
    q = {**queue_obj("team", quota={"nvidia.com/gpu": 16}), "metadata": {"name": "team", "generation": 3}}
    broken = {**queue_obj("bad", quota={"nvidia.com/gpu": 16}, requeue={"baseSeconds": 9, "maxSeconds": 1}),
              "metadata": {"name": "bad", "generation": 1}}
    a = slice_obj("a", queue="team")
    c = slice_obj("c", queue="bad")
    plan = plan_pass(two_blocks(), members(a) + members(c), [a, c], [q, broken], now=T0_S)
    team, bad = plan.queue_status["team"], plan.queue_status["bad"]
    by_type = lambda status: {x["type"]: (x["status"], x["reason"]) for x in status["conditions"]}  # noqa: E731
    assert team["observedGeneration"] == 3 and by_type(team) == {"Ready": ("True", "QueueActive"),
                                                                "Stalled": ("False", "QueueActive")}
    assert bad["observedGeneration"] == 1 and by_type(bad) == {"Ready": ("False", "QueueInvalid"),
                                                              "Stalled": ("True", "QueueInvalid")}
    assert bad["pendingSlices"] == 1 and plan.waiting["ns/c"].code == "QueueInvalid"
    # a later pass with the same outcome writes the same status: nothing churns
    later = plan_pass(two_blocks(), members(a) + members(c), [a, c], [q, {**broken, "status": bad}], now=T0_S + 60)
    assert later.queue_status["bad"] == bad


def test_missing_queue_and_default_queue():
    lost = slice_obj("lost", queue="nope")
    dflt = slice_obj("d")
    plan = plan_pass(two_blocks(), members(lost) + members(dflt), [lost, dflt], [queue_obj("team")], now=T0_S)
    assert plan.waiting["ns/lost"].code == "QueueNotFound"
    assert [b.slice_key for b in plan.binds] == ["ns/d"]  # 'default' exists implicitly, unlimited


def test_admission_timeout_holds_the_slice_back_then_requeues_it_at_the_back():
    q = queue_obj("team", quota={"nvidia.com/gpu": 100}, admissionTimeoutSeconds=60, requeue={"baseSeconds": 30, "maxSeconds": 120})
    big = slice_obj("big", queue="team", hosts=2)
    hogs = [other_pod("a0", 8, name="h1"), other_pod("b0", 8, name="h2")]
    held = plan_pass(two_blocks(), members(big) + hogs, [big], [q], now=T0_S + 70)
    wait = held.waiting["ns/big"]
    assert wait.code == "RequeueBackoff" and wait.requeues == 1 and wait.requeue_at == "2030-01-01T00:01:30Z"
    assert "waited 60s" in wait.message
    back = plan_pass(two_blocks(), members(big) + hogs, [big], [q], now=T0_S + 95)
    assert back.waiting["ns/big"].code == "InsufficientCapacity" and back.waiting["ns/big"].requeues == 1
    # what the stuck-in-queue alert reads: the wait counts from the attempt's first queueing, across requeues
    assert held.oldest_wait_by_queue == {"team": 70.0} and back.oldest_wait_by_queue == {"team": 95.0}
    assert back.admission_timeouts == {"team": 60.0}


def test_requeued_slice_goes_behind_newer_slices_of_its_priority():
    q = queue_obj("team", quota={"nvidia.com/gpu": 100}, admissionTimeoutSeconds=60, requeue={"baseSeconds": 30, "maxSeconds": 120})
    old = slice_obj("old", queue="team")
    new = slice_obj("new", queue="team", created="2030-01-01T00:01:00Z")
    one_block = [node(f"a{i}", "a", i) for i in range(2)]
    pods = members(old) + members(new, created="2030-01-01T00:01:00Z")
    # old waited 60 s, was held 30 s, re-entered at t=90 > new's 60: new goes first
    plan = plan_pass(one_block, pods, [old, new], [q], now=T0_S + 95)
    assert [b.slice_key for b in plan.binds] == ["ns/new"]


def test_preemption_evicts_whole_lower_priority_gangs():
    q = queue_obj("prod", quota={"nvidia.com/gpu": 1000}, preemption="LowerPriority")
    low = slice_obj("low", priority=0, queue="prod")
    high = slice_obj("high", priority=100, queue="prod")
    one_block = [node(f"a{i}", "a", i) for i in range(2)]
    plan = plan_pass(one_block, members(low, nodes=["a0", "a1"]) + members(high), [low, high], [q], now=T0_S)
    assert [(e.victim, e.preemptor) for e in plan.evictions] == [("ns/low", "ns/high")]
    assert {p.name for p in plan.evictions[0].pods} == {"low-0", "low-1"}
    assert plan.waiting["ns/high"].code == "Preempting" and not plan.binds


def test_plan_is_the_same_for_any_input_order():
    slices = [slice_obj(f"s{i}", hosts=1 + i % 2, per_host=4, priority=i % 3) for i in range(6)]
    pods = [p for s in slices for p in members(s)]
    nodes = two_blocks()
    a = plan_pass(nodes, pods, slices, [], now=T0_S)
    b = plan_pass(list(reversed(nodes)), list(reversed(pods)), list(reversed(slices)), [], now=T0_S)
    assert a.binds == b.binds and a.waiting == b.waiting


# ---------------------------------------------------------------- every container counts (issue 19, defect 5)

def with_extra_gpus(obj, *, sidecar=0, init=0, restartable_init=0):
    """A Slice whose template also requests GPUs outside the main container (the operator sets countPerHost
    on the main one)."""
    pod_spec = obj["spec"]["template"]["spec"]
    if sidecar:
        pod_spec["containers"].append({"name": "side", "image": "x", "resources": {
            "requests": {"nvidia.com/gpu": sidecar}, "limits": {"nvidia.com/gpu": sidecar}}})
    inits = []
    if restartable_init:
        inits.append({"name": "always", "image": "x", "restartPolicy": "Always", "resources": {
            "limits": {"nvidia.com/gpu": str(restartable_init)}}})
    if init:
        inits.append({"name": "warm", "image": "x", "resources": {"limits": {"nvidia.com/gpu": str(init)}}})
    if inits:
        pod_spec["initContainers"] = inits
    return obj


def test_pods_count_every_container_and_init_container_as_the_kubelet_does():
    pod = {"spec": {"initContainers": [{"resources": {"limits": {"nvidia.com/gpu": 2}}, "restartPolicy": "Always"},
                                       {"resources": {"limits": {"nvidia.com/gpu": 7}}}],
                    "containers": [{"resources": {"limits": {"nvidia.com/gpu": 1}}},
                                   {"resources": {"requests": {"nvidia.com/gpu": "3"}}}]}}
    # running: sidecar 2 + 1 + 3 = 6; the plain init container runs with the sidecar: 7 + 2 = 9
    assert pod_requests(pod) == {"nvidia.com/gpu": 9}
    pod["spec"]["initContainers"][1]["resources"]["limits"]["nvidia.com/gpu"] = 1
    assert pod_requests(pod) == {"nvidia.com/gpu": 6}


def test_a_second_container_s_accelerators_count_toward_the_node_and_the_quota():
    # countPerHost 8 on 8-GPU nodes plus 6 more in a second container: 14 per node cannot fit anywhere
    greedy = with_extra_gpus(slice_obj("greedy", hosts=1, per_host=8), sidecar=6)
    assert slice_request(greedy, spec_of(greedy), created=0.0).per_host == 14
    plan = plan_pass(two_blocks(), members(greedy), [greedy], [], now=T0_S)
    assert not plan.binds and plan.waiting["ns/greedy"].code in ("DomainTooSmall", "InsufficientCapacity")
    # 4 + 4 fits a node, and the queue counts 8 per member, not 4
    q = queue_obj("team", quota={"nvidia.com/gpu": 12})
    a = with_extra_gpus(slice_obj("a", hosts=1, per_host=4, queue="team"), init=4, restartable_init=0)
    a = with_extra_gpus(a, sidecar=4)
    b = slice_obj("b", hosts=1, per_host=8, queue="team", created="2030-01-01T00:00:01Z")
    plan = plan_pass(two_blocks(), members(a) + members(b, created="2030-01-01T00:00:01Z"), [a, b], [q], now=T0_S + 5)
    assert [x.slice_key for x in plan.binds] == ["ns/a"]
    assert plan.queue_status["team"]["usage"] == {"nvidia.com/gpu": 8}
    assert plan.waiting["ns/b"].code == "QuotaExceeded"
    # once bound, the second container holds its GPUs on the node: a 1-GPU pod more does not fit a0
    running = members(a, nodes=["a0"])
    small = slice_obj("small", hosts=1, per_host=1, created="2030-01-01T00:00:02Z")
    filled = [other_pod(n, 8, name=f"hog-{n}") for n in ("a1", "b0", "b1")]
    plan = plan_pass(two_blocks(), running + filled + members(small, created="2030-01-01T00:00:02Z"),
                     [a, small], [], now=T0_S + 5)
    assert not plan.binds and plan.waiting["ns/small"].code == "InsufficientCapacity"


def test_what_a_pass_derives_from_a_spec_is_reused_only_while_its_generation_lasts():
    """Passes over the cache remember each Slice's validated spec and accelerator count per (uid, generation)
    and each pod's requests per (uid, resourceVersion); a spec change (a new generation) is read afresh."""
    s = slice_obj("memo-s", per_host=8)
    s["metadata"]["generation"] = 1
    pods = members(s)
    for p in pods:
        p["metadata"]["resourceVersion"] = "7"
    assert [len(b.members) for b in plan_pass(two_blocks(), pods, [s], [], now=T0_S + 1).binds] == [2]
    s["spec"] = {**s["spec"], "hosts": 3}                # the spec changed without a new generation: the API
    assert [len(b.members) for b in plan_pass(two_blocks(), pods, [s], [], now=T0_S + 1).binds] == [2]  # never does so
    s["metadata"]["generation"] = 2                      # with one, the pass reads the new spec
    plan = plan_pass(two_blocks(), pods, [s], [], now=T0_S + 1)
    assert not plan.binds                                # 2 members of a 3-host gang: it waits for the third
    # a pod's requests are remembered per resourceVersion: a resized pod is counted anew
    hog = other_pod("a0", 8)
    hog["metadata"]["resourceVersion"] = "1"
    small = slice_obj("memo-t", hosts=1, per_host=8)
    small["metadata"]["generation"] = 1
    plan = plan_pass([node("a0", "a", 0)], [hog, *members(small)], [small], [], now=T0_S + 1)
    assert not plan.binds
    hog = {**hog, "metadata": {**hog["metadata"], "resourceVersion": "2"},
           "spec": {**hog["spec"], "containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": "0"}}}]}}
    plan = plan_pass([node("a0", "a", 0)], [hog, *members(small)], [small], [], now=T0_S + 1)
    assert [b.slice_key for b in plan.binds] == ["ns/memo-t"]
