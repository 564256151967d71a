"""Which reconciles a watch event asks for."""
from tokenfleet_operator.controller.triggers import GANG_PASS, triggers

SVC, SLICE = "tokenfleet.dev/inference-service", "tokenfleet.dev/slice"


def obj(name, ns="ns", labels=None, spec=None):
    return {"metadata": {"name": name, "namespace": ns, "labels": labels or {}}, "spec": spec or {}}


def test_owner_and_gang_pass_follow_from_labels_and_accelerators():
    assert triggers("InferenceService", obj("llama")) == [("InferenceService", "ns", "llama")]
    gang = obj("llama-0", labels={SVC: "llama"}, spec={"accelerator": {"type": "nvidia-h100-80gb"}})
    assert triggers("Slice", gang) == [("Slice", "ns", "llama-0"), ("InferenceService", "ns", "llama"), GANG_PASS]
    cpu = obj("c-0", spec={"accelerator": {"type": "cpu"}})
    assert triggers("Slice", cpu) == [("Slice", "ns", "c-0")]
    member = obj("llama-0-0", labels={SLICE: "llama-0", SVC: "llama"})
    assert triggers("Pod", member) == [("Slice", "ns", "llama-0"), GANG_PASS, ("InferenceService", "ns", "llama")]
    assert triggers("Deployment", obj("llama-router", labels={SVC: "llama"})) == [("InferenceService", "ns", "llama")]
    assert triggers("ConfigMap", obj("x")) == []
    assert triggers("Node", obj("n", ns=None)) == [GANG_PASS]
    assert triggers("SliceQueue", obj("q", ns=None)) == [GANG_PASS]


def node(allocatable="8", ready="True", heartbeat="2026-01-01T00:00:00Z", unschedulable=False, labels=None):
    return {"metadata": {"name": "n1", "labels": labels or {"zone": "a"}},
            "spec": {"unschedulable": unschedulable},
            "status": {"allocatable": {"nvidia.com/gpu": allocatable},
                       "conditions": [{"type": "Ready", "status": ready, "lastHeartbeatTime": heartbeat}]}}


def member(node_name=None, phase="Pending", ready="False", deleting=False):
    meta = {"name": "s-0-0", "namespace": "ns", "labels": {SLICE: "s-0"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"schedulerName": "tokenfleet", **({"nodeName": node_name} if node_name else {})},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}}


def test_only_updates_that_move_capacity_or_binding_ask_for_the_gang_pass():
    from tokenfleet_operator.controller.triggers import changes_placement
    assert changes_placement("Node", None, node())                                  # first sight
    assert not changes_placement("Node", node(), node(heartbeat="2026-01-01T00:05:00Z"))   # a heartbeat
    assert changes_placement("Node", node(), node(allocatable="4"))
    assert changes_placement("Node", node(), node(ready="False"))
    assert changes_placement("Node", node(), node(unschedulable=True))
    assert changes_placement("Node", node(), node(labels={"zone": "b"}))
    assert changes_placement("Pod", member(), member(node_name="n1"))               # bound
    assert not changes_placement("Pod", member("n1", "Running", "False"), member("n1", "Running", "True"))  # ready
    assert changes_placement("Pod", member("n1", "Running"), member("n1", "Failed"))        # frees its node
    assert changes_placement("Pod", member("n1", "Running"), member("n1", "Running", deleting=True))
    assert changes_placement("SliceQueue", {"metadata": {}}, {"metadata": {}})             # other kinds: always


def test_a_slice_update_asks_for_the_gang_pass_only_when_it_changes_what_placement_reads():
    from tokenfleet_operator.controller.triggers import changes_placement
    from tokenfleet_operator.gang.decision import ANNOTATION, GangDecision

    def gang(**status):
        return {"metadata": {"name": "s", "namespace": "ns", "uid": "u1", "generation": 1},
                "spec": {"hosts": 2, "accelerator": {"type": "nvidia-h100-80gb"}},
                "status": {"phase": "Placing", "revision": "r1", "restarts": 0,
                           "admission": {"queuedAt": "2026-01-01T00:00:00Z"}, **status}}
    base = gang()
    ready = gang(conditions=[{"type": "Ready", "status": "True"}], readyHosts=2, observedGeneration=1)
    assert not changes_placement("Slice", base, ready)                  # conditions, counts: nothing placement reads
    assert changes_placement("Slice", base, gang(phase="Failed"))         # frees its members' capacity
    assert changes_placement("Slice", base, gang(restarts=1))             # a new attempt
    assert changes_placement("Slice", base, gang(revision="r2"))
    assert changes_placement("Slice", base, gang(admission={"queuedAt": "2026-01-01T00:00:00Z",
                                                            "admittedAt": "2026-01-01T00:00:05Z"}))
    respec = gang()
    respec["spec"] = {**respec["spec"], "hosts": 3}
    assert changes_placement("Slice", base, respec)
    deleting = gang()
    deleting["metadata"] = {**deleting["metadata"], "deletionTimestamp": "2026-01-01T00:01:00Z"}
    assert changes_placement("Slice", base, deleting)
    decided = gang()
    decided["metadata"] = {**decided["metadata"], "annotations": {ANNOTATION: GangDecision(True, "Placed", "ok").to_annotation()}}
    assert changes_placement("Slice", base, decided)
    noted = gang()
    noted["metadata"] = {**noted["metadata"], "annotations": {"team": "x"}}
    assert not changes_placement("Slice", base, noted)
