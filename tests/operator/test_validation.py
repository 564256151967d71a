from tokenfleet_operator.api import InferenceServiceSpec, SliceSpec
from tokenfleet_operator.validation import check_inference_service, check_slice, topology_size

from operator_samples import isvc_body, slice_body


def test_topology_size():
    assert topology_size("1") == 1
    assert topology_size("2x4") == 8
    assert topology_size("4x4x8") == 128


def test_valid_specs_have_no_problems():
    assert check_inference_service(InferenceServiceSpec.model_validate(isvc_body()["spec"])) == []
    assert check_slice(SliceSpec.model_validate(slice_body()["spec"])) == []


def test_topology_that_does_not_match_the_hosts_is_a_problem():
    body = isvc_body(accelerator={"type": "nvidia-h100-80gb", "countPerHost": 4, "hostsPerReplica": 2, "topology": "4x4"})
    [problem] = check_inference_service(InferenceServiceSpec.model_validate(body["spec"]))
    assert problem.reason == "TopologyMismatch"
    assert problem.field == "spec.accelerator.topology"
    assert "16" in problem.message and "8" in problem.message


def test_cpu_with_several_accelerators_is_a_problem():
    body = isvc_body(accelerator={"type": "cpu", "countPerHost": 2})
    [problem] = check_inference_service(InferenceServiceSpec.model_validate(body["spec"]))
    assert problem.reason == "CpuAcceleratorCount"


def test_speculation_longer_than_the_context_is_a_problem():
    body = isvc_body()
    body["spec"]["engine"] = {"maxModelLen": 16, "speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 16}}
    [problem] = check_inference_service(InferenceServiceSpec.model_validate(body["spec"]))
    assert problem.reason == "SpeculationLongerThanContext"


def test_slice_problems():
    spec = SliceSpec.model_validate(slice_body(hosts=3)["spec"])
    assert [p.reason for p in check_slice(spec)] == ["TopologyMismatch"]
    empty = slice_body(template={"spec": {"containers": []}})
    assert [p.field for p in check_slice(SliceSpec.model_validate(empty["spec"]))] == ["spec.template.spec.containers"]
    nameless = slice_body(template={"spec": {"containers": [{"image": "x"}]}})
    assert [p.field for p in check_slice(SliceSpec.model_validate(nameless["spec"]))] == ["spec.template.spec.containers[0]"]
