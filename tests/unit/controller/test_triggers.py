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
