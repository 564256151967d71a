import pytest

from tokenfleet_operator.api import InferenceServiceSpec, SliceSpec
from tokenfleet_operator.policy import OperatorPolicy
from tokenfleet_operator.validation import check_inference_service, check_slice, runs_bundled_server, topology_size

from harness.operator_samples import isvc_body, slice_body


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
    body = isvc_body(image="example.com/other-server:1")
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


def test_levers_the_bundled_server_builds_pass_and_the_others_are_problems_naming_the_field():
    body = isvc_body()
    body["spec"]["engine"] = {"dtype": "float32", "quantization": "int8",
                              "speculativeDecoding": {"method": "draft", "draftModel": {"path": "/d"}, "numSpeculativeTokens": 3}}
    assert check_inference_service(InferenceServiceSpec.model_validate(body["spec"])) == []
    for method in ("fp8", "awq", "gptq"):
        body["spec"]["engine"] = {"dtype": "bfloat16", "quantization": method,
                                  "speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3}}
        [problem] = check_inference_service(InferenceServiceSpec.model_validate(body["spec"]))
        assert (problem.reason, problem.field) == ("NotInServingImage", "spec.engine.quantization")
        assert f"{method} quantization" in problem.message and "int8" in problem.message
        assert "spec.image" in problem.message
    body["spec"]["image"] = "example.com/other-server:1"                  # another server may implement them
    assert check_inference_service(InferenceServiceSpec.model_validate(body["spec"])) == []


def test_slice_problems():
    spec = SliceSpec.model_validate(slice_body(hosts=3)["spec"])
    assert [p.reason for p in check_slice(spec)] == ["TopologyMismatch"]
    empty = slice_body(template={"spec": {"containers": []}})
    assert [p.field for p in check_slice(SliceSpec.model_validate(empty["spec"]))] == ["spec.template.spec.containers"]
    nameless = slice_body(template={"spec": {"containers": [{"image": "x"}]}})
    assert [p.field for p in check_slice(SliceSpec.model_validate(nameless["spec"]))] == ["spec.template.spec.containers[0]"]


# ---------------------------------------------------------------- issue 19: no privilege of the operator's own

def isvc_spec(**overrides):
    return InferenceServiceSpec.model_validate(isvc_body(**overrides)["spec"])


def slice_spec(**overrides):
    return SliceSpec.model_validate(slice_body(**overrides)["spec"])


def test_host_paths_need_an_administrators_prefix():
    model = {"hostPath": {"path": "/data/models/llama"}, "servedModelNames": ["m"]}
    [problem] = check_inference_service(isvc_spec(model=model))
    assert (problem.reason, problem.field) == ("HostPathNotAllowed", "spec.model.hostPath.path")
    assert "--allow-host-path" in problem.message and "allowed: none" in problem.message
    assert check_inference_service(isvc_spec(model=model), OperatorPolicy.from_flags(["/data/models"])) == []
    assert check_inference_service(isvc_spec(model=model), OperatorPolicy.from_flags(["/"])) == []
    # a sibling that shares the prefix's letters is not below it
    sibling = {"hostPath": {"path": "/data/models-private"}, "servedModelNames": ["m"]}
    assert [p.reason for p in check_inference_service(isvc_spec(model=sibling), OperatorPolicy.from_flags(["/data/models"]))] \
        == ["HostPathNotAllowed"]
    store = {"topologyKey": "tokenfleet.dev/block", "checkpoint": {"store": "hostpath:///var/ck"}}
    assert [p.field for p in check_inference_service(isvc_spec(slicePolicy=store))] == ["spec.slicePolicy.checkpoint.store"]
    on_slice = slice_spec(checkpoint={"store": "hostpath:///var/ck"})
    assert [(p.reason, p.field) for p in check_slice(on_slice)] == [("HostPathNotAllowed", "spec.checkpoint.store")]
    assert check_slice(on_slice, OperatorPolicy.from_flags(["/var/ck/"])) == []
    for store in ("pvc://claim/x", "file:///var/ck"):
        assert check_slice(slice_spec(checkpoint={"store": store})) == [], store


@pytest.mark.parametrize("prefix", ["data", "/data/../etc", "/data/./x"])
def test_host_path_prefixes_must_be_plain_absolute_paths(prefix):
    with pytest.raises(ValueError, match="--allow-host-path"):
        OperatorPolicy.from_flags([prefix])


def test_gang_templates_may_not_bypass_the_gang_scheduler():
    for key, value in (("nodeName", "node-a"), ("schedulerName", "default-scheduler")):
        spec = slice_spec()
        spec.template.spec[key] = value
        assert [(p.reason, p.field) for p in check_slice(spec)] == [("SchedulerBypass", f"spec.template.spec.{key}")]
    cpu = slice_spec(accelerator={"type": "cpu"}, topology=None)
    cpu.template.spec["nodeName"] = "node-a"           # the default scheduler's business: no quota involved
    assert check_slice(cpu) == []


def test_templates_request_no_accelerator_the_gang_scheduler_does_not_count():
    spec = slice_spec()
    spec.template.spec["containers"].append(
        {"name": "side", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 2, "example.com/fpga": 1}}})
    spec.template.spec["initContainers"] = [{"name": "i", "image": "x", "resources": {"requests": {"google.com/tpu": 1}}}]
    problems = check_slice(spec)
    # nvidia.com/gpu is the Slice's own accelerator: counted, allowed
    assert [(p.reason, p.field) for p in problems] == [
        ("UncountedResource", "spec.template.spec.initContainers[0].resources"),
        ("UncountedResource", "spec.template.spec.containers[1].resources")]
    assert "google.com/tpu" in problems[0].message and "example.com/fpga" in problems[1].message
    cpu = slice_spec(accelerator={"type": "cpu"}, topology=None)
    cpu.template.spec["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 1, "cpu": "2"}}
    [problem] = check_slice(cpu)
    assert problem.reason == "UncountedResource" and "not counted against any queue" in problem.message


# ---------------------------------------------------------------- issue 19: the server's own argument rules

def with_extra(*args, **engine):
    return isvc_spec(engine={"dtype": "bfloat16", **engine, "extraArgs": list(args)})


def test_extra_args_the_server_takes_are_fine():
    assert check_inference_service(with_extra("--kv-cache-mb", "1024", "--max-queue=64", "--num-threads", "4")) == []
    assert check_inference_service(with_extra("--dtype", "bfloat16")) == []      # the same value changes nothing


@pytest.mark.parametrize("args, words", [
    (["--bogus"], ["unrecognized arguments: --bogus"]),
    (["--max-queue", "-1"], ["--max-queue", "must be >= 1"]),
    (["--api-key", "k"], ["--api-key is set by the operator"]),
    (["--api", "k"], ["--api-key is set by the operator"]),          # argparse takes unique prefixes
    (["--model=/etc"], ["--model is set by spec.model"]),
    (["--port=9000"], ["--port is set by the operator"]),
    (["--served-model-name", "other"], ["spec.model.servedModelNames"]),
    (["--dtype", "float32"], ["spec.engine.dtype"]),
    (["--no-prefix-caching"], ["spec.engine.enablePrefixCaching"]),
    (["--help"], ["help"]),
    (["--hel"], ["help"]),
    (["-h"], ["help"]),
])
def test_extra_args_the_server_would_refuse_or_that_override_the_spec_are_problems(args, words):
    [problem] = check_inference_service(with_extra(*args))
    assert (problem.reason, problem.field) == ("InvalidEngineArgs", "spec.engine.extraArgs")
    for word in words:
        assert word in problem.message, problem.message


def test_extra_args_of_another_image_are_its_own_business():
    spec = isvc_spec(image="example.com/other-server:1", engine={"extraArgs": ["--enforce-eager", "--api-key", "x"]})
    assert check_inference_service(spec) == []


def test_a_model_name_the_server_refuses_is_a_problem_even_if_stored_before_the_schema_refused_it():
    spec = isvc_spec()
    spec.model.served_model_names[1] = "--api-key"       # the CRD pattern refuses this now; older objects may hold it
    [problem] = check_inference_service(spec)
    assert (problem.reason, problem.field) == ("InvalidEngineArgs", "spec.model.servedModelNames")
    assert "not a valid model name" in problem.message
def test_warm_restart_needs_the_bundled_server():
    from tokenfleet_operator.api import InferenceServiceSpec
    from tokenfleet_operator.validation import check_inference_service

    from harness.operator_samples import isvc_body

    warm = {"warmRestart": {"enabled": True}, "slicePolicy": {"checkpoint": {"store": "pvc://c/x"}}}
    spec = InferenceServiceSpec.model_validate(isvc_body(image="example.com/other-server:1", **warm)["spec"])
    [problem] = [p for p in check_inference_service(spec) if p.field == "spec.warmRestart.enabled"]
    assert problem.reason == "NotInServingImage" and "bundled serving image" in problem.message
    one = {"accelerator": {"type": "nvidia-h100-80gb", "countPerHost": 1}}      # tp > 1 has no warm restart yet
    spec = InferenceServiceSpec.model_validate(isvc_body(**warm, **one)["spec"])
    assert not [p for p in check_inference_service(spec) if p.field == "spec.warmRestart.enabled"]


def test_tool_call_parser_reaches_the_server_and_unknown_ones_are_problems_for_the_bundled_image():
    from tokenfleet_operator.builders.inference_service import engine_args
    from tokenfleet_serving.serve_args import parse_serve_args

    spec = InferenceServiceSpec.model_validate(isvc_body(engine={"toolCallParser": "hermes"})["spec"])
    assert check_inference_service(spec) == []
    assert parse_serve_args(engine_args(spec, "/models")[2:]).tool_call_parser == "hermes"
    spec = InferenceServiceSpec.model_validate(isvc_body(engine={"toolCallParser": "pythonic"})["spec"])
    [problem] = check_inference_service(spec)
    assert (problem.reason, problem.field) == ("NotInServingImage", "spec.engine.toolCallParser")
    assert "hermes, llama3_json, mistral" in problem.message
    other = isvc_body(image="example.com/other-server:1", engine={"toolCallParser": "pythonic"})
    assert check_inference_service(InferenceServiceSpec.model_validate(other["spec"])) == []
    # extraArgs may not change what the field sets
    spec = InferenceServiceSpec.model_validate(
        isvc_body(engine={"toolCallParser": "hermes", "extraArgs": ["--tool-call-parser", "mistral"]})["spec"])
    [problem] = check_inference_service(spec)
    assert problem.reason == "InvalidEngineArgs" and "spec.engine.toolCallParser" in problem.message
