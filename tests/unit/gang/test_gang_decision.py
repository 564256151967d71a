"""The gang scheduler's decision survives its trip through a Slice annotation, and becomes the Slice
controller's admission input."""
from tokenfleet_operator.api import SliceSpec
from tokenfleet_operator.gang.decision import ANNOTATION, GangDecision, admission_for
from tokenfleet_operator.gang.slice_state import PodView

from harness.gang_objects import slice_obj


def annotated(decision):
    obj = slice_obj("g")
    obj["metadata"]["annotations"] = {ANNOTATION: decision.to_annotation()}
    return obj


def test_every_decision_round_trips_through_the_annotation():
    for decision in (GangDecision(False, "DomainTooSmall", "never fits"),
                     GangDecision(True, "Placed", "placed 2 members"),
                     GangDecision(False, "QueueTimeout", "held back", requeues=2, requeue_at="2030-01-01T00:00:00Z"),
                     GangDecision(False, "Preempted", "evicted", preempted_by="ns/high")):
        assert GangDecision.from_object(annotated(decision)) == decision


def test_a_missing_or_mangled_annotation_counts_as_no_decision_yet():
    obj = slice_obj("g")
    assert GangDecision.from_object(obj) is None
    obj["metadata"]["annotations"] = {ANNOTATION: "{not json"}
    assert GangDecision.from_object(obj) is None


def test_admission_follows_the_decision_and_the_members_bound():
    obj = annotated(GangDecision(True, "Placed", "placed 2 members"))
    spec = SliceSpec.model_validate(obj["spec"])
    bound = [PodView(f"g-{i}", i, 0, "r", node=f"n{i}") for i in range(2)]
    assert admission_for(obj, spec, bound).admitted
    half = [bound[0], PodView("g-1", 1, 0, "r")]
    assert admission_for(obj, spec, half).reason == "Queued"          # placed, but not every member bound yet
    waiting = admission_for(annotated(GangDecision(False, "InsufficientCapacity", "6 free")), spec, [])
    assert (waiting.admitted, waiting.reason, waiting.message) == (False, "InsufficientCapacity", "6 free")
    assert admission_for(slice_obj("g"), spec, []).reason == "Queued"
