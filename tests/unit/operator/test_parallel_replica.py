"""One replica across every accelerator of its Slice: parallel sizes, the members' command lines, the
rendezvous Service and the checks of sizes and model shapes, built without a cluster."""
import pytest

from tokenfleet_dev.localcluster.launch import expand
from tokenfleet_operator.api import InferenceServiceSpec, SliceSpec
from tokenfleet_operator.builders.inference_service import engine_args, slice_manifest
from tokenfleet_operator.builders.slice_pods import member_pod, rendezvous_service
from tokenfleet_operator.parallelism import ModelShape, ParallelSizes, SizeError, parallel_sizes, split_errors
from tokenfleet_operator.validation import check_slice, parallel_problems

from harness.operator_samples import isvc_body, slice_body


def spec_of(count=2, hosts=2, tp=None, pp=None, **overrides):
    engine = {k: v for k, v in (("tensorParallelSize", tp), ("pipelineParallelSize", pp)) if v is not None}
    accelerator = {"type": "nvidia-h100-80gb", "countPerHost": count, "hostsPerReplica": hosts}
    body = isvc_body(accelerator=accelerator, engine=engine, **overrides)
    return body, InferenceServiceSpec.model_validate(body["spec"])


@pytest.mark.parametrize("count, hosts, tp, pp, expected", [
    (2, 2, None, None, (4, 1)),          # neither set: every accelerator a tensor-parallel rank
    (4, 2, 4, None, (4, 2)),             # pp derived
    (4, 2, None, 2, (4, 2)),             # tp derived
    (2, 2, 2, 2, (2, 2)),
    (1, 1, None, None, (1, 1)),
])
def test_unset_sizes_use_every_accelerator(count, hosts, tp, pp, expected):
    sizes = parallel_sizes(spec_of(count, hosts, tp, pp)[1])
    assert (sizes.tensor, sizes.pipeline) == expected
    assert sizes.world == count * hosts and sizes.ranks_per_host == count


@pytest.mark.parametrize("tp, pp, field", [
    (3, None, "spec.engine.tensorParallelSize"),       # 3 does not divide 4
    (None, 3, "spec.engine.pipelineParallelSize"),
    (2, 1, "spec.engine.tensorParallelSize"),          # 2 ranks for 4 accelerators: two would sit idle
    (4, 2, "spec.engine.tensorParallelSize"),          # 8 ranks for 4 accelerators
])
def test_sizes_that_do_not_use_the_accelerators_exactly_name_the_field(tp, pp, field):
    _, spec = spec_of(2, 2, tp, pp)
    with pytest.raises(SizeError) as e:
        parallel_sizes(spec)
    assert e.value.field == field
    [problem] = parallel_problems(spec)
    assert (problem.reason, problem.field) == ("ParallelSizeMismatch", field)
    assert "4 accelerators" in problem.message


SHAPE = ModelShape(layers=4, attention_heads=8, kv_heads=2, intermediate_size=1024)


@pytest.mark.parametrize("shape, tp, pp, fields", [
    (SHAPE, 4, 1, []),                                      # 2 KV heads replicated over 4 ranks
    (SHAPE, 2, 2, []),
    (SHAPE, 8, 1, []),
    (ModelShape(4, 6, 6, 1024), 4, 1, ["tensorParallelSize", "tensorParallelSize"]),   # heads and KV heads
    (ModelShape(4, 8, 3, 1024), 2, 1, ["tensorParallelSize"]),                        # 3 KV heads: no way
    (ModelShape(4, 8, 8, 1001), 2, 1, ["tensorParallelSize"]),                        # MLP width
    (ModelShape(2, 8, 8, 1024), 1, 4, ["pipelineParallelSize"]),                      # a stage without layers
])
def test_a_model_that_cannot_be_split_names_the_field(shape, tp, pp, fields):
    errors = split_errors(ParallelSizes(tp, pp, 1), shape)
    assert [f.rsplit(".", 1)[1] for f, _ in errors] == fields
    for _, message in errors:
        assert str(tp if "tensor" in message else pp) in message


def test_a_model_the_sizes_cannot_split_is_a_problem_naming_the_field():
    _, spec = spec_of(2, 2)
    [problem] = parallel_problems(spec, ModelShape(2, 6, 2, 512))
    assert (problem.reason, problem.field) == ("ModelNotSplittable", "spec.engine.tensorParallelSize")


def _members(body, spec):
    slice_ = slice_manifest(body, spec, 0)
    slice_["metadata"]["uid"] = "uid-slice"
    slice_spec = SliceSpec.model_validate(slice_["spec"])
    return slice_, slice_spec, [member_pod(slice_, slice_spec, m, attempt=0, revision="r")
                                for m in range(slice_spec.hosts)]


def _argv(pod):
    main = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in main["env"]}
    return [expand(a, env) for a in main["command"]], env       # as the kubelet expands $(VAR)


def _flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_members_of_a_multi_host_replica_form_one_world_around_the_leader():
    body, spec = spec_of(2, 2, topology="2x2")
    slice_, slice_spec, pods = _members(body, spec)
    assert slice_spec.leader_template is not None
    for member, pod in enumerate(pods):
        argv, env = _argv(pod)
        assert pod["spec"]["hostname"] == f"llama-0-{member}" and pod["spec"]["subdomain"] == "llama-0"
        assert env["TOKENFLEET_LEADER_ADDRESS"] == "llama-0-0.llama-0.ns.svc"
        assert _flag(argv, "--tensor-parallel-size") == "4" and _flag(argv, "--pipeline-parallel-size") == "1"
        assert _flag(argv, "--nnodes") == "2" and _flag(argv, "--node-rank") == str(member)
        assert _flag(argv, "--master-addr") == "llama-0-0.llama-0.ns.svc"
        assert _flag(argv, "--master-port") == "29500"
        assert ("--headless" in argv) == (member > 0)            # only the leader serves the API
        probe = pod["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"]
        assert probe == ("/ready" if member == 0 else "/health")
        # one rank per accelerator: the pod requests countPerHost of them, as before
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert pod["metadata"]["labels"]["tokenfleet.dev/leader"] == ("true" if member == 0 else "false")


def test_a_single_host_replica_splits_over_its_accelerators_without_rendezvous():
    body, spec = spec_of(2, 1, topology=None)
    _, slice_spec, [pod] = _members(body, spec)
    argv, env = _argv(pod)
    assert slice_spec.leader_template is None
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert "--nnodes" not in argv and "--headless" not in argv and "--master-addr" not in argv
    assert "hostname" not in pod["spec"] and "TOKENFLEET_LEADER_ADDRESS" not in env
    assert rendezvous_service({"metadata": {"name": "x", "namespace": "ns", "uid": "u"}, "apiVersion": "v",
                               "kind": "Slice"}, slice_spec) is None


def test_one_accelerator_keeps_the_plain_command_line():
    _, spec = spec_of(1, 1, topology=None)
    assert not {"--tensor-parallel-size", "--nnodes", "--headless"} & set(engine_args(spec, "/models"))


def test_the_rendezvous_service_is_headless_publishes_unready_members_and_is_owned_by_the_slice():
    body, spec = spec_of(2, 2, topology="2x2")
    slice_, slice_spec, _ = _members(body, spec)
    service = rendezvous_service(slice_, slice_spec)
    assert service is not None
    assert service["metadata"]["name"] == "llama-0" and service["metadata"]["namespace"] == "ns"
    [ref] = service["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("Slice", "llama-0", "uid-slice", True)
    assert service["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "tokenfleet",
                                             "app.kubernetes.io/component": "rendezvous",
                                             "tokenfleet.dev/slice": "llama-0"}
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"tokenfleet.dev/slice": "llama-0"}


def test_a_leader_template_must_place_like_the_member_template():
    body = slice_body()
    template = body["spec"]["template"]
    leader = {"spec": {**template["spec"], "nodeSelector": {"zone": "a"}}}
    problems = check_slice(SliceSpec.model_validate({**body["spec"], "leaderTemplate": leader}))
    assert [(p.reason, p.field) for p in problems] == [("LeaderTemplateMismatch", "spec.leaderTemplate.spec.nodeSelector")]
    heavier = {"spec": {"containers": [template["spec"]["containers"][0],
                                       {"name": "side", "image": "busybox",
                                        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    problems = check_slice(SliceSpec.model_validate({**body["spec"], "leaderTemplate": heavier}))
    assert [(p.reason, p.field) for p in problems] == [("LeaderTemplateMismatch", "spec.leaderTemplate.spec.containers")]
    assert "5 nvidia.com/gpu" in problems[0].message and "4" in problems[0].message
    no_image = {"spec": {"containers": [{"name": "main"}]}}
    problems = check_slice(SliceSpec.model_validate({**body["spec"], "leaderTemplate": no_image}))
    assert [(p.reason, p.field) for p in problems] == [("InvalidTemplate", "spec.leaderTemplate.spec.containers[0]")]
    assert check_slice(SliceSpec.model_validate({**body["spec"], "leaderTemplate": template})) == []


def test_the_model_shape_pod_mounts_the_model_as_the_replicas_do_and_requests_no_accelerator():
    from tokenfleet_operator.builders.model_shape import model_shape_pod, model_shape_pod_name, needs_model_shape

    body, spec = spec_of(2, 2, topology="2x2", image="tokenfleet/serving:1")
    assert needs_model_shape(spec)
    pod = model_shape_pod(body, spec)
    [container] = pod["spec"]["containers"]
    assert container["command"] == ["tokenfleet", "model-shape", "--model", "/models/llama-8b"]
    assert container["volumeMounts"][0]["mountPath"] == "/models"
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "weights"
    assert "nvidia.com/gpu" not in str(container["resources"])
    assert pod["spec"]["nodeSelector"] == {"tokenfleet.dev/accelerator": "nvidia-h100-80gb"}
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["metadata"]["labels"]["tokenfleet.dev/role"] == "model-shape"
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    # the same model source is read once; another one again
    other = spec.model_copy(update={"model": spec.model.model_copy(update={"pvc": spec.model.pvc.model_copy(
        update={"sub_path": "llama-70b"})})})
    assert model_shape_pod_name("llama", spec) == pod["metadata"]["name"] != model_shape_pod_name("llama", other)
    assert model_shape_pod_name("llama", spec) == model_shape_pod_name(
        "llama", spec.model_copy(update={"replicas": 5}))
    # nothing to check for one rank per replica, nor for an image without the command
    assert not needs_model_shape(spec_of(1, 1, topology=None, image="tokenfleet/serving:1")[1])
    assert not needs_model_shape(spec_of(2, 2, topology="2x2", image="example.com/other:1")[1])


def test_the_model_shape_command_leaves_the_shape_for_the_operator(tmp_path, monkeypatch):
    import json

    from tokenfleet_serving.contract.model_shape import main, shape_in

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 96}))
    log = tmp_path / "termination-log"
    monkeypatch.setenv("TOKENFLEET_TERMINATION_LOG", str(log))
    assert main(["--model", str(tmp_path / "m")]) == 0
    pod = {"status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 0, "message": log.read_text()}}}]}}
    assert shape_in(pod) == {"layers": 3, "attentionHeads": 8, "keyValueHeads": 4, "intermediateSize": 96}
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["num_key_value_heads"]                       # no GQA: as many key/value heads as heads
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert main(["--model", str(tmp_path / "m")]) == 0 and json.loads(log.read_text())["keyValueHeads"] == 8
    assert main(["--model", str(tmp_path / "missing")]) == 2
    assert "config.json" in log.read_text()
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = log.read_text()
    assert shape_in(pod) is None


def test_pipeline_stages_are_refused_for_the_bundled_image_until_it_builds_them():
    _, spec = spec_of(2, 2, tp=2, pp=2, image="tokenfleet/serving:1")
    [problem] = parallel_problems(spec)
    assert (problem.reason, problem.field) == ("NotInServingImage", "spec.engine.pipelineParallelSize")
    _, other = spec_of(2, 2, tp=2, pp=2, image="example.com/other:1")
    assert parallel_problems(other) == []


def test_what_the_bundled_server_refuses_at_tp_above_1_is_refused_before_any_pod_starts(tmp_path):
    from tokenfleet_serving.engine.distributed import ParallelConfig, ParallelConfigError
    from tokenfleet_serving.server.main import build_parser, config_from_args

    with pytest.raises(ParallelConfigError, match="pipeline"):       # the server: exits 2 on it
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2).check()
    args = build_parser().parse_args(["--model", str(tmp_path), "--tensor-parallel-size", "2",
                                      "--prefix-checkpoint-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="warm restart"):
        config_from_args(args)
    _, spec = spec_of(2, 2, image="tokenfleet/serving:1", warmRestart={"enabled": True},
                      slicePolicy={"checkpoint": {"store": "pvc://c/x"}})
    [problem] = parallel_problems(spec)
    assert (problem.reason, problem.field) == ("NotInServingImage", "spec.warmRestart.enabled")
