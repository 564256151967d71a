from tokenfleet_operator.api import InferenceServiceSpec
from tokenfleet_operator.inference_service_status import SliceState, compute_status, invalid_status, slice_state
from tokenfleet_operator.validation import Problem

from harness.operator_samples import isvc_body


def status_for(slices, router_ready=1, **overrides):
    body = isvc_body(**overrides)
    spec = InferenceServiceSpec.model_validate(body["spec"])
    return compute_status(body, spec, "new", slices, router_ready, now="2026-01-01T00:00:00Z")


def conds(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_ready():
    s = status_for([SliceState("llama-0", "new", "Ready", True), SliceState("llama-1", "new", "Ready", True)])
    assert (s["replicas"], s["readyReplicas"], s["updatedReplicas"]) == (2, 2, 2)
    assert conds(s) == {"Ready": ("True", "Serving"), "SlicesReady": ("True", "AllSlicesReady"),
                        "RouterReady": ("True", "RouterAvailable"), "Degraded": ("False", "AsExpected"),
                        "Reconciling": ("False", "Serving"), "Stalled": ("False", "AsExpected")}
    assert s["url"] == "http://llama.ns.svc"
    assert s["selector"] == "tokenfleet.dev/inference-service=llama,tokenfleet.dev/leader=true,tokenfleet.dev/role=serve"
    assert s["cost"] == {"dollarsPerHour": 42.0}
    assert s["slices"] == [{"name": "llama-0", "phase": "Ready", "ready": True, "updated": True},
                           {"name": "llama-1", "phase": "Ready", "ready": True, "updated": True}]


def test_starting_up():
    s = status_for([SliceState("llama-0", "new", "Placing", False, "Unschedulable", "no room")], router_ready=0)
    c = conds(s)
    assert c["SlicesReady"] == ("False", "SlicesNotReady")
    assert c["Ready"] == ("False", "SlicesNotReady")
    assert c["RouterReady"] == ("False", "RouterUnavailable")
    msg = next(x for x in s["conditions"] if x["type"] == "SlicesReady")["message"]
    assert "llama-0: Placing (Unschedulable: no room)" in msg and "1 slices not created yet" in msg


def test_router_down_is_the_reason_when_slices_are_fine():
    s = status_for([SliceState("llama-0", "new", "Ready", True), SliceState("llama-1", "new", "Ready", True)], router_ready=0)
    assert conds(s)["Ready"] == ("False", "RouterUnavailable")


def test_failed_slice_degrades_the_service():
    s = status_for([SliceState("llama-0", "new", "Ready", True),
                    SliceState("llama-1", "new", "Failed", False, "RestartBudgetExhausted", "x")])
    c = conds(s)
    assert c["Degraded"] == ("True", "SliceFailed") and c["SlicesReady"] == ("False", "SliceFailed")


def test_rolling_update_still_serves():
    s = status_for([SliceState("llama-0", "new", "Ready", True), SliceState("llama-1", "old", "Ready", True)])
    assert conds(s)["Ready"] == ("True", "RollingUpdate") and s["updatedReplicas"] == 1


def test_slices_beyond_replicas_are_not_counted():
    s = status_for([SliceState("llama-0", "new", "Ready", True), SliceState("llama-5", "new", "Ready", True)], replicas=1)
    assert s["replicas"] == 1 and [x["name"] for x in s["slices"]] == ["llama-0"]


def test_scaled_to_zero():
    s = status_for([], replicas=0)
    assert conds(s)["SlicesReady"] == ("True", "ScaledToZero") and s["cost"]["dollarsPerHour"] == 0


def test_slice_state_requires_the_controller_to_have_caught_up():
    obj = {"metadata": {"name": "a", "generation": 2, "labels": {"tokenfleet.dev/revision": "r"}},
           "status": {"phase": "Ready", "observedGeneration": 1}}
    assert not slice_state(obj).ready
    obj["status"]["observedGeneration"] = 2
    assert slice_state(obj).ready and slice_state(obj).revision == "r"


def test_invalid_status_keeps_the_last_known_numbers():
    body = isvc_body()
    old = {"replicas": 2, "readyReplicas": 1, "conditions": []}
    s = invalid_status(body, Problem("TopologyMismatch", "spec.accelerator.topology", "bad"), old)
    assert s["replicas"] == 2 and s["readyReplicas"] == 1 and s["observedGeneration"] == 3
    assert conds(s)["Ready"] == ("False", "TopologyMismatch")
    ready = next(c for c in s["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "spec.accelerator.topology: bad"


# kstatus: Reconciling while the operator works toward the spec, Stalled when only a new spec helps.
def test_kstatus_conditions_follow_the_service_through_its_states():
    new = lambda i, phase, ready, *r: SliceState(f"llama-{i}", "new", phase, ready, *r)  # noqa: E731
    progressing = conds(status_for([new(0, "Ready", True), new(1, "Placing", False)]))
    assert progressing["Reconciling"] == ("True", "SlicesNotReady") and progressing["Stalled"][0] == "False"
    rolling = conds(status_for([new(0, "Ready", True), SliceState("llama-1", "old", "Ready", True)]))
    assert rolling["Ready"] == ("True", "RollingUpdate") and rolling["Reconciling"] == ("True", "RollingUpdate")
    degraded = conds(status_for([new(0, "Ready", True), new(1, "Restarting", False, "Restarting", "restart 1/3")]))
    assert degraded["Degraded"][0] == "True" and degraded["Reconciling"][0] == "True" and degraded["Stalled"][0] == "False"
    failed = status_for([new(0, "Ready", True), new(1, "Failed", False, "RestartBudgetExhausted", "budget of 3 spent")])
    c = conds(failed)
    assert c["Stalled"] == ("True", "SliceFailed") and c["Reconciling"] == ("False", "SliceFailed")
    stalled = next(x for x in failed["conditions"] if x["type"] == "Stalled")
    assert "llama-1: RestartBudgetExhausted: budget of 3 spent" in stalled["message"]
    scaled_to_zero = conds(status_for([], replicas=0, minReplicas=0))
    assert scaled_to_zero["Reconciling"][0] == "False" and scaled_to_zero["Stalled"][0] == "False"


def test_an_invalid_spec_stalls_but_a_missing_model_claim_is_waited_for():
    body = isvc_body()
    invalid = conds(invalid_status(body, Problem("TopologyMismatch", "spec.accelerator.topology", "2x4 is 8"), None))
    assert invalid["Stalled"] == ("True", "TopologyMismatch") and invalid["Reconciling"][0] == "False"
    waiting = conds(invalid_status(body, Problem("ModelSourceNotFound", "spec.model.pvc.claimName", "create it"), None))
    assert waiting["Stalled"][0] == "False" and waiting["Reconciling"] == ("True", "ModelSourceNotFound")


def test_a_replica_lost_after_serving_degrades_but_a_first_start_does_not():
    slices = [SliceState("llama-0", "new", "Ready", True), SliceState("llama-1", "new", "Placing", False)]
    body = isvc_body()
    spec = InferenceServiceSpec.model_validate(body["spec"])
    starting = compute_status(body, spec, "new", slices, 1, old_status={}, now="2026-01-01T00:00:00Z")
    assert conds(starting)["Degraded"] == ("False", "AsExpected")
    assert conds(starting)["Reconciling"][0] == "True"
    serving = {"conditions": [{"type": "Ready", "status": "True", "reason": "Serving", "message": "",
                               "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    lost = compute_status(body, spec, "new", slices, 1, old_status=serving, now="2026-01-01T00:01:00Z")
    assert conds(lost)["Degraded"] == ("True", "ReplicasUnavailable")
