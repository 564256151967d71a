"""The runtime contract (operator/tokenfleet_operator/runtimes/): what a vLLM replica runs, built from the same
spec fields as the bundled engine's; extraArgs that collide with a flag the operator sets; fields a runtime
cannot honour; and the router, which runs from the operator's image whatever the replicas run."""
from __future__ import annotations

import json

import pytest

from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.builders.auth import NO_WIRING, Wiring
from tokenfleet_operator.builders.inference_service import desired_children, slice_manifest
from tokenfleet_operator.runtimes import RUNTIMES, runtime_of
from tokenfleet_operator.runtimes import vllm as vllm_runtime
from tokenfleet_operator.runtimes.vllm import OWNED_FLAGS, extra_args_collision
from tokenfleet_operator.validation import check_inference_service

from harness.operator_samples import isvc_body

VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"


def vllm_spec(body=None, **overrides):
    body = body or isvc_body(**overrides)
    body["spec"].setdefault("image", VLLM_IMAGE)
    body["spec"].setdefault("engine", {})["runtime"] = "vllm"
    return body, InferenceServiceSpec.model_validate(body["spec"])


def one_host(**overrides):
    return vllm_spec(isvc_body(accelerator={"type": "nvidia-h100-80gb", "countPerHost": 1}, **overrides))


def containers(body, spec, wiring=NO_WIRING):
    manifest = slice_manifest(body, spec, 0, wiring)["spec"]
    leader = (manifest.get("leaderTemplate") or manifest["template"])["spec"]["containers"][0]
    return leader, manifest["template"]["spec"]["containers"][0]


def test_the_default_runtime_is_the_bundled_engine():
    body = isvc_body()
    spec = InferenceServiceSpec.model_validate(body["spec"])
    assert spec.engine.runtime == "tokenfleet"
    assert containers(body, spec)[0]["command"][:2] == ["tokenfleet", "serve"]


def test_vllm_serve_is_built_from_every_engine_field():
    body, spec = one_host(engine={
        "dtype": "bfloat16", "maxModelLen": 8192, "maxNumSeqs": 64, "maxNumBatchedTokens": 2048,
        "kvBlockSize": 32, "kvCacheMb": 2048, "enablePrefixCaching": False, "quantization": "fp8",
        "toolCallParser": "hermes", "speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3},
        "extraArgs": ["--enforce-eager"]})
    leader, _ = containers(body, spec)
    assert leader["command"] == [
        "vllm", "serve", "/models/llama-8b", "--host", "0.0.0.0", "--port", "8000",
        "--served-model-name", "llama-8b", "llama",
        "--dtype", "bfloat16", "--block-size", "32", "--max-num-seqs", "64",
        "--max-model-len", "8192", "--max-num-batched-tokens", "2048",
        "--kv-cache-memory-bytes", str(2048 * 1024 * 1024), "--no-enable-prefix-caching",
        "--quantization", "fp8",
        '--speculative-config={"method":"ngram","num_speculative_tokens":3}',
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        '--kv-events-config={"buffer_steps":10000,"enable_kv_cache_events":true,"endpoint":"tcp://*:5557",'
            '"publisher":"zmq","replay_endpoint":"tcp://*:5558","topic":"kv"}',
        "--enforce-eager"]
    assert leader["image"] == VLLM_IMAGE


def test_vllm_gets_its_key_from_the_secret_and_never_on_its_command_line():
    body, spec = one_host()
    leader, _ = containers(body, spec)
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") or e["value"] for e in leader["env"]}
    assert env["VLLM_API_KEY"] == {"name": "llama-replica-key", "key": "api-key"}
    assert env["HOME"] == "/tmp" and {"name": "tmp", "mountPath": "/tmp"} in leader["volumeMounts"]
    assert "--api-key" not in leader["command"]
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health"
    assert leader["livenessProbe"]["httpGet"]["path"] == "/health"
    assert leader["startupProbe"]["failureThreshold"] * leader["startupProbe"]["periodSeconds"] >= 1800
    assert leader["terminationMessagePolicy"] == "FallbackToLogsOnError"      # its last log line, if it exits


def test_a_draft_model_and_int8_reach_vllm_under_its_names():
    body, spec = one_host(engine={"quantization": "int8", "speculativeDecoding": {
        "method": "draft", "numSpeculativeTokens": 5, "draftModel": {"pvc": {"claimName": "weights", "subPath": "d"}}}})
    command = containers(body, spec)[0]["command"]
    assert command[command.index("--quantization") + 1] == "int8_per_channel_weight_only"
    [config] = [a for a in command if a.startswith("--speculative-config=")]
    assert json.loads(config.split("=", 1)[1]) == {
        "method": "draft_model", "model": "/draft-model", "num_speculative_tokens": 5,
        "quantization": "int8_per_channel_weight_only"}


def test_a_multi_host_vllm_replica_runs_vllms_multi_node_mode_over_the_slices_headless_service():
    body, spec = vllm_spec(engine={"tensorParallelSize": 4, "pipelineParallelSize": 2})   # 2 hosts of 4
    leader, worker = containers(body, spec)
    tail = ["--nnodes", "2", "--master-addr", "$(TOKENFLEET_LEADER_ADDRESS)", "--master-port", "29500"]
    for container, rank in ((leader, "0"), (worker, "$(TOKENFLEET_MEMBER_INDEX)")):
        c = container["command"]
        assert c[c.index("--tensor-parallel-size") + 1] == "4" and c[c.index("--pipeline-parallel-size") + 1] == "2"
        assert c[c.index("--node-rank") + 1] == rank
        assert all(c[c.index(flag) + 1] == value for flag, value in zip(tail[::2], tail[1::2], strict=True))
    assert "--headless" in worker["command"] and "--headless" not in leader["command"]
    # a headless vLLM serves no HTTP: no probe may kill or hold it
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(worker)


def test_the_multi_host_switch_refuses_several_hosts_with_a_condition(monkeypatch):
    _, spec = vllm_spec()
    assert check_inference_service(spec) == []
    monkeypatch.setattr(vllm_runtime, "MULTI_HOST", False)
    [problem] = check_inference_service(spec)
    assert (problem.reason, problem.field) == ("NotSupportedByRuntime", "spec.accelerator.hostsPerReplica")


@pytest.mark.parametrize("extra, flag", [
    (["--port", "9000"], "--port"),
    (["--port=9000"], "--port"),
    (["--max_model_len", "10"], "--max-model-len"),
    (["-tp", "2"], "--tensor-parallel-size"),
    (["--speculative-config.method=ngram"], "--speculative-config"),
    (["--no-enable-prefix-caching"], "--enable-prefix-caching"),
    (["--max-model", "5"], "--max-model-len"),                 # argparse takes a unique prefix
    (["--config", "/etc/vllm.yaml"], "--config"),
    (["--enforce-eager", "--api-key", "k"], "--api-key"),
    (["--model", "/other"], "--model"),
    (["-dp", "2"], "--data-parallel-size"),
    (['--kv-events-config={"enable_kv_cache_events":true}'], "--kv-events-config"),
])
def test_extra_args_that_collide_with_an_owned_flag_are_refused_naming_it(extra, flag):
    _, spec = one_host(engine={"extraArgs": extra})
    [problem] = check_inference_service(spec)
    assert (problem.reason, problem.field) == ("ExtraArgsCollision", "spec.engine.extraArgs")
    assert flag in problem.message and "extraArgs may add vLLM flags" in problem.message


@pytest.mark.parametrize("extra", [
    ["--enforce-eager"], ["--gpu-memory-utilization", "0.9"], ["--kv-cache-dtype", "fp8"],
    ["--max-loras=4"], ["--generation-config", "vllm"],
])
def test_other_vllm_flags_pass_through_unchecked(extra):
    body, spec = one_host(engine={"extraArgs": extra})
    assert check_inference_service(spec) == []
    assert containers(body, spec)[0]["command"][-len(extra):] == extra


def test_a_help_flag_is_refused_rather_than_printed_by_every_replica():
    _, spec = one_host(engine={"extraArgs": ["--help=cache"]})
    [problem] = check_inference_service(spec)
    assert problem.field == "spec.engine.extraArgs" and "help" in problem.message


@pytest.mark.parametrize("overrides, field", [
    ({"warmRestart": {"enabled": True}, "slicePolicy": {"checkpoint": {"store": "pvc://cache/x"}}},
     "spec.warmRestart.enabled"),
    ({"image": "tokenfleet/serving:0.1.0"}, "spec.image"),
    ({"engine": {"kvOffload": {"hostMemory": "1Gi"}}}, "spec.engine.kvOffload"),
    ({"image": "registry.example.com/tokenfleet/serving@sha256:" + "a" * 64}, "spec.image"),
])
def test_fields_vllm_cannot_honour_are_a_condition_naming_the_field(overrides, field):
    _, spec = one_host(**overrides)
    problems = check_inference_service(spec)
    assert (problems[0].reason, problems[0].field) == ("NotSupportedByRuntime", field), problems
    assert "runtime vllm" in problems[0].message


def test_a_tool_call_parser_the_bundled_engine_lacks_is_vllms_to_judge():
    _, spec = one_host(engine={"toolCallParser": "pythonic"})
    assert check_inference_service(spec) == []


def test_the_router_runs_from_the_operators_image_told_which_runtime_the_replicas_speak():
    wiring = Wiring(router_image="registry.example.com/tokenfleet/serving:0.1.0")
    for runtime, backend in (("vllm", ["--backend-runtime", "vllm"]), ("tokenfleet", [])):
        body, spec = one_host() if runtime == "vllm" else (isvc_body(), None)
        spec = spec or InferenceServiceSpec.model_validate(body["spec"])
        deployment = next(c for c in desired_children(body, spec, wiring=wiring).others if c["kind"] == "Deployment")
        [router] = deployment["spec"]["template"]["spec"]["containers"]
        assert router["image"] == "registry.example.com/tokenfleet/serving:0.1.0"
        assert router["command"][:2] == ["tokenfleet", "route"]
        assert [a for a in router["command"][2:] if a == "--backend-runtime" or a in RUNTIMES] == backend
        assert runtime_of(spec).router_backend == runtime


def test_kv_events_as_the_prefix_source_reach_vllm_the_router_and_the_network_policy():
    wiring = Wiring(router_image="registry.example.com/tokenfleet/serving:0.1.0")
    for source in (None, "routed", "kvEvents"):
        body, spec = one_host(routing={"prefixSource": source} if source else {})
        assert check_inference_service(spec) == []
        leader, _ = containers(body, spec, wiring)
        children = desired_children(body, spec, wiring=wiring).others
        router_json = json.loads(next(c for c in children if c["kind"] == "ConfigMap"
                                      and "router.json" in c["data"])["data"]["router.json"])
        policy = next(c for c in children if c["kind"] == "NetworkPolicy" and c["metadata"]["name"].endswith("-replicas"))
        router_ports = [p["port"] for p in policy["spec"]["ingress"][0]["ports"]]
        flags = [a for a in leader["command"] if a.startswith("--kv-events-config")]
        if source == "routed":
            assert flags == [] and "prefixSource" not in router_json and router_ports == [8000]
            assert [p["name"] for p in leader["ports"]] == ["http"]
            continue
        [flag] = flags
        config = json.loads(flag.split("=", 1)[1])
        assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                          "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "topic": "kv"}
        assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in leader["ports"]
        assert {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"} in leader["ports"]
        assert (router_json["prefixSource"], router_json["kvEventsPort"], router_json["kvEventsReplayPort"]) == \
            ("kvEvents", 5557, 5558)
        assert router_ports == [8000, 5557, 5558]


@pytest.mark.parametrize("source", ["routed", "kvEvents"])
def test_a_prefix_source_on_the_bundled_engine_is_a_condition_naming_the_field(source):
    spec = InferenceServiceSpec.model_validate(isvc_body(routing={"prefixSource": source})["spec"])
    [problem] = check_inference_service(spec)
    assert (problem.reason, problem.field) == ("NotSupportedByRuntime", "spec.routing.prefixSource")
    assert "/cache/blocks" in problem.message


def test_every_owned_flag_is_named_once():
    names = [n for owned in OWNED_FLAGS for n in (owned.flag, *owned.aliases)]
    assert len(names) == len(set(names))
    assert extra_args_collision(["--enforce-eager", "8", "-O3"]) is None


def test_a_vllm_replica_that_exits_on_its_arguments_fails_its_slice_at_once_with_vllms_last_line():
    import datetime as dt

    from tokenfleet_operator.api import SliceSpec
    from tokenfleet_operator.gang.slice_state import plan_slice, pod_view, slice_revision

    body, spec = one_host(engine={"extraArgs": ["--bogus-flag", "1"]})
    manifest = slice_manifest(body, spec, 0)
    slice_spec = SliceSpec.model_validate(manifest["spec"])
    rev = slice_revision(slice_spec)
    # what the kubelet reports for vllm 0.32.0 given an unknown flag: exit 2, and (FallbackToLogsOnError) the
    # end of its log, argparse's usage first and its error last
    log_tail = ("usage: vllm [-h] [-v]\n            {chat,complete,serve,...}\n"
                "vllm: error: unrecognized arguments: --bogus-flag 1\n")
    pod = pod_view({"metadata": {"name": "llama-0-0", "labels": {"tokenfleet.dev/member": "0",
                                                                 "tokenfleet.dev/attempt": "0",
                                                                 "tokenfleet.dev/revision": rev}},
                    "spec": {"nodeName": "node-0"},
                    "status": {"phase": "Failed", "containerStatuses": [{"name": "engine", "restartCount": 0, "state": {
                        "terminated": {"exitCode": 2, "reason": "Error", "message": log_tail}}}]}})
    plan = plan_slice({**manifest, "status": {"phase": "Placing", "revision": rev}}, slice_spec, [pod],
                      now=dt.datetime(2026, 12, 1, tzinfo=dt.UTC))
    assert plan.status["phase"] == "Failed" and not plan.counts_restart and plan.create == []
    failed = next(c for c in plan.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "ConfigurationError"
    assert failed["message"].endswith("vllm: error: unrecognized arguments: --bogus-flag 1; a configuration error, "
                                      "so no restart: the slice stays down until its spec changes")


def test_vllm_ranks_sharing_a_host_get_a_memory_backed_dev_shm():
    body, spec = vllm_spec()                                  # 4 ranks on each of 2 hosts
    manifest = slice_manifest(body, spec, 0)["spec"]
    for template in (manifest["leaderTemplate"], manifest["template"]):
        pod = template["spec"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    one_body, one = one_host()
    assert "dshm" not in json.dumps(slice_manifest(one_body, one, 0))
    assert "dshm" not in json.dumps(slice_manifest(body, InferenceServiceSpec.model_validate(isvc_body()["spec"]), 0))


def test_every_engine_field_is_a_vllm_flag_or_refused_for_vllm():
    from tokenfleet_operator.api.inference_service import EngineSpec
    fields = set(EngineSpec.model_fields)
    assert fields == vllm_runtime.FLAG_FIELDS | vllm_runtime.REFUSED_FIELDS, (
        "an engine field vLLM neither gets as a flag nor refuses: "
        f"{sorted(fields - vllm_runtime.FLAG_FIELDS - vllm_runtime.REFUSED_FIELDS)}")


@pytest.mark.parametrize("image", ["vllm/vllm-openai:v0.32.0", "docker.io/vllm/vllm-openai@sha256:" + "b" * 64,
                                   "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"])
def test_a_vllm_image_left_on_the_default_runtime_is_a_condition_naming_the_image(image):
    spec = InferenceServiceSpec.model_validate(isvc_body(image=image)["spec"])
    [problem] = check_inference_service(spec)
    assert (problem.reason, problem.field) == ("NotSupportedByRuntime", "spec.image")
    assert "set spec.engine.runtime to vllm" in problem.message
    for other in ("tokenfleet/serving:0.1.0", "example.com/mine/server:1", "example.com/vllmish:1"):
        assert check_inference_service(InferenceServiceSpec.model_validate(isvc_body(image=other)["spec"])) == []
