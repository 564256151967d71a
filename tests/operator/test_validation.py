from tokenfleet_operator.api import InferenceServiceSpec, SliceSpec
from tokenfleet_operator.validation import check_inference_service, check_slice, runs_bundled_server, topology_size

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
    body = isvc_body(image="vllm/vllm-openai:v0.11.0")
    body["spec"]["engine"] = {"maxModelLen": 16, "speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 16}}
    [problem] = check_inference_service(InferenceServiceSpec.model_validate(body["spec"]))
    assert problem.reason == "SpeculationLongerThanContext"


def test_the_bundled_image_is_recognised_under_any_registry_tag_or_digest():
    for image in ("tokenfleet/serving:0.1.0", "tokenfleet/serving", "registry.local:5000/tokenfleet/serving:dev",
                  "ghcr.io/acme/tokenfleet/serving@sha256:" + "0" * 64):
        assert runs_bundled_server(image), image
    for image in ("vllm/vllm-openai:v0.11.0", "acme/tokenfleet-serving:1", "tokenfleet/serving-extra:1",
                  "registry.local:5000/serving:1"):
        assert not runs_bundled_server(image), image


def test_levers_the_bundled_server_lacks_are_problems_naming_the_field():
    body = isvc_body()
    body["spec"]["engine"] = {"dtype": "bfloat16", "quantization": "int8",
                              "speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3}}
    problems = check_inference_service(InferenceServiceSpec.model_validate(body["spec"]))
    assert [(p.reason, p.field) for p in problems] == [("NotInServingImage", "spec.engine.quantization"),
                                                        ("NotInServingImage", "spec.engine.speculativeDecoding")]
    assert "int8 quantization" in problems[0].message and "spec.image" in problems[0].message
    body["spec"]["image"] = "vllm/vllm-openai:v0.11.0"                   # another server may implement them
    assert check_inference_service(InferenceServiceSpec.model_validate(body["spec"])) == []


def test_slice_problems():
    spec = SliceSpec.model_validate(slice_body(hosts=3)["spec"])
    assert [p.reason for p in check_slice(spec)] == ["TopologyMismatch"]
    empty = slice_body(template={"spec": {"containers": []}})
    assert [p.field for p in check_slice(SliceSpec.model_validate(empty["spec"]))] == ["spec.template.spec.containers"]
    nameless = slice_body(template={"spec": {"containers": [{"image": "x"}]}})
    assert [p.field for p in check_slice(SliceSpec.model_validate(nameless["spec"]))] == ["spec.template.spec.containers[0]"]
