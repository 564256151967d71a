"""Whether an idle gang pass can be skipped: only when every gang Slice is placed with all members bound."""
from tokenfleet_operator.gang.decision import ANNOTATION, GangDecision
from tokenfleet_operator.gang.waiting import gang_work_waiting

SLICE = "tokenfleet.dev/slice"


def slice_(name="s", hosts=2, decision=None, accelerator="nvidia-h100-80gb", phase="Ready", deleting=False):
    meta = {"name": name, "namespace": "ns", "annotations": {}}
    if decision is not None:
        meta["annotations"][ANNOTATION] = decision.to_annotation()
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"hosts": hosts, "accelerator": {"type": accelerator}}, "status": {"phase": phase}}


def pod(slice_name, i, node="n1", phase="Running", scheduler="tokenfleet"):
    return {"metadata": {"name": f"{slice_name}-{i}", "namespace": "ns", "labels": {SLICE: slice_name}},
            "spec": {"schedulerName": scheduler, **({"nodeName": node} if node else {})}, "status": {"phase": phase}}


PLACED = GangDecision(True, "Placed", "all members bound")
WAITS = GangDecision(False, "InsufficientCapacity", "needs 16 GPUs")


def test_a_placed_fleet_with_every_member_bound_has_nothing_waiting():
    assert not gang_work_waiting([slice_(decision=PLACED)], [pod("s", 0), pod("s", 1)])
    assert not gang_work_waiting([], [])
    assert not gang_work_waiting([slice_("c", accelerator="cpu")], [pod("c", 0, node=None, scheduler="default-scheduler")])
    assert not gang_work_waiting([slice_(decision=None, phase="Succeeded")], [])       # a finished batch Slice
    assert not gang_work_waiting([slice_(decision=None, deleting=True)], [])           # going away


def test_anything_the_pass_must_still_do_counts_as_waiting():
    assert gang_work_waiting([slice_(decision=None)], [])                             # never decided
    assert gang_work_waiting([slice_(decision=WAITS)], [])                            # waits for capacity
    assert gang_work_waiting([slice_(decision=PLACED)], [pod("s", 0)])                # a member is missing
    assert gang_work_waiting([slice_(decision=PLACED)], [pod("s", 0), pod("s", 1, node=None)])   # one unbound
    assert gang_work_waiting([slice_(decision=PLACED)], [pod("s", 0), pod("s", 1), pod("x", 0, node=None)])
    # a failed member holds nothing: the Slice has one member short until it is made again
    assert gang_work_waiting([slice_(decision=PLACED)], [pod("s", 0), pod("s", 1, phase="Failed")])
