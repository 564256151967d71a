"""InferenceService -> children, built without a cluster."""
import json

import pytest

from tokenfleet_operator.api import InferenceServiceSpec, SliceSpec
from tokenfleet_operator.builders.inference_service import (
    desired_children,
    engine_args,
    hourly_cost,
    model_storage,
    router_config,
    slice_manifest,
)
from tokenfleet_operator.builders.slice_pods import member_pod

from harness.operator_samples import isvc_body, slice_body


def build(**overrides):
    body = isvc_body(**overrides)
    return body, InferenceServiceSpec.model_validate(body["spec"])


def test_children_are_exactly_the_expected_objects():
    body, spec = build()
    children = desired_children(body, spec)
    names = sorted((m["kind"], m["metadata"]["name"]) for m in (*children.slices, *children.others))
    assert names == [
        ("ConfigMap", "llama-router"),
        ("Deployment", "llama-router"),
        ("NetworkPolicy", "llama-replicas"),
        ("PodDisruptionBudget", "llama-router"),
        ("Service", "llama"),
        ("Service", "llama-engines"),
        ("Slice", "llama-0"),
        ("Slice", "llama-1"),
    ]
    for m in (*children.slices, *children.others):
        assert m["metadata"]["namespace"] == "ns"
        [ref] = m["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "InferenceService", "name": "llama",
                       "uid": "uid-isvc", "controller": True, "blockOwnerDeletion": True}
        assert m["metadata"]["labels"]["tokenfleet.dev/inference-service"] == "llama"
        assert m["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tokenfleet"


def test_building_is_deterministic_and_json_serialisable():
    body, spec = build()
    a, b = desired_children(body, spec), desired_children(body, spec)
    assert a == b
    json.dumps([*a.slices, *a.others])


def test_slice_carries_the_replica_shape():
    body, spec = build()
    s = slice_manifest(body, spec, 1)
    assert s["metadata"]["name"] == "llama-1"
    assert s["metadata"]["labels"]["tokenfleet.dev/replica"] == "1"
    assert s["spec"]["hosts"] == 2 and s["spec"]["topology"] == "2x4"
    assert s["spec"]["accelerator"] == {"type": "nvidia-h100-80gb", "resourceName": "nvidia.com/gpu", "countPerHost": 4}
    assert s["spec"]["topologyKey"] == "tokenfleet.dev/block"
    assert s["spec"]["role"] == "serve"
    # The slice spec must be something the Slice API itself accepts.
    SliceSpec.model_validate(s["spec"])


def test_the_slices_follow_the_count_to_run_not_only_spec_replicas():
    body, spec = build(replicas=1)
    assert len(desired_children(body, spec).slices) == 1
    slices = desired_children(body, spec, replicas=3).slices     # the autoscaler asks for 3
    assert [m["metadata"]["name"] for m in slices] == [f"{body['metadata']['name']}-{i}" for i in range(3)]
    assert desired_children(body, spec, replicas=0).slices == ()


def test_revision_changes_with_the_serving_spec_but_not_with_replicas_or_price_of_router():
    body, spec = build()
    base = desired_children(body, spec).revision
    assert desired_children(*build(replicas=5)).revision == base
    assert desired_children(*build(routing={"policy": "least-load"})).revision == base
    assert desired_children(*build(image="tokenfleet/serving:0.2.0")).revision != base
    assert desired_children(*build(engine={"maxNumSeqs": 64})).revision != base


def test_engine_command_line():
    _, spec = build()
    args = engine_args(spec, "/models/llama-8b")
    assert args[:8] == ["tokenfleet", "serve", "--model", "/models/llama-8b", "--host", "0.0.0.0", "--port", "8000"]
    text = " ".join(args)
    assert "--served-model-name=llama-8b --served-model-name=llama" in text   # one token each: never a flag
    assert "--dtype bfloat16" in text and "--block-size 16" in text and "--max-num-seqs 128" in text
    assert "--max-model-len 8192" in text and "--max-num-batched-tokens 4096" in text
    assert "--no-prefix-caching" not in text and "--quantization" not in text
    assert "--price-per-hour 21" in text  # 8 accelerators * 2.5 + 1.0
    assert "--kv-cache-mb" not in text     # unset: the server's default budget


def test_kv_cache_budget_becomes_the_serve_flag_and_a_new_revision():
    body, spec = build(engine={"kvCacheMb": 24})
    args = engine_args(spec, "/m")
    assert args[args.index("--kv-cache-mb") + 1] == "24"
    assert desired_children(body, spec).revision != desired_children(*build()).revision


def test_engine_flags_for_optional_features():
    _, spec = build(engine={"enablePrefixCaching": False, "quantization": "int8",
                            "speculativeDecoding": {"method": "draft", "draftModel": {"path": "/models/tiny"},
                                                    "numSpeculativeTokens": 3},
                            "extraArgs": ["--kv-cache-mb", "1024"]},
                    price={"acceleratorPerHour": 0})
    args = engine_args(spec, "/m")
    text = " ".join(args)
    assert "--no-prefix-caching" in args
    assert "--quantization int8" in text
    assert "--speculative-method draft --num-speculative-tokens 3 --speculative-draft-model /models/tiny" in text
    assert args[-2:] == ["--kv-cache-mb", "1024"]
    assert "--price-per-hour" not in text
    _, ngram = build(engine={"speculativeDecoding": {"method": "ngram"}})
    assert "--speculative-method ngram --num-speculative-tokens 4" in " ".join(engine_args(ngram, "/m"))
    assert "--speculative-draft-model" not in engine_args(ngram, "/m")


@pytest.mark.parametrize(
    "model, draft, volume, mount",
    [
        # the draft on the model's own claim: one volume, mounted twice
        ({"pvc": {"claimName": "w", "subPath": "big"}, "servedModelNames": ["m"]}, {"pvc": {"claimName": "w", "subPath": "small/"}},
         None, {"name": "model", "mountPath": "/draft-model", "readOnly": True, "subPath": "small"}),
        ({"pvc": {"claimName": "w"}, "servedModelNames": ["m"]}, {"pvc": {"claimName": "d"}},
         {"name": "draft-model", "persistentVolumeClaim": {"claimName": "d", "readOnly": True}},
         {"name": "draft-model", "mountPath": "/draft-model", "readOnly": True}),
        ({"path": "/opt/model", "servedModelNames": ["m"]}, {"hostPath": {"path": "/data/draft"}},
         {"name": "draft-model", "hostPath": {"path": "/data/draft", "type": "Directory"}},
         {"name": "draft-model", "mountPath": "/draft-model", "readOnly": True}),
    ],
)
def test_the_draft_model_is_mounted_and_passed(model, draft, volume, mount):
    body, spec = build(model=model, engine={"speculativeDecoding": {"method": "draft", "draftModel": draft}})
    pod = slice_manifest(body, spec, 0)["spec"]["template"]["spec"]
    [container] = pod["containers"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    assert mount in container["volumeMounts"]
    if volume is not None:
        assert volumes[volume["name"]] == volume
    else:
        assert "draft-model" not in volumes
    assert len(volumes) == len({m["name"] for m in container["volumeMounts"]})       # every mount has its volume
    args = container["command"]
    assert args[args.index("--speculative-draft-model") + 1] == "/draft-model"
    slice_obj = dict(slice_body(), spec=slice_manifest(body, spec, 0)["spec"])   # the Slice controller's pod keeps them
    member = member_pod(slice_obj, SliceSpec.model_validate(slice_obj["spec"]), 0, attempt=0, revision="r")
    assert mount in member["spec"]["containers"][0]["volumeMounts"]
    assert {v["name"] for v in member["spec"]["volumes"]} == set(volumes)


@pytest.mark.parametrize(
    "model, volume, directory",
    [
        ({"path": "/opt/model", "servedModelNames": ["m"]}, None, "/opt/model"),
        ({"pvc": {"claimName": "w"}, "servedModelNames": ["m"]},
         {"persistentVolumeClaim": {"claimName": "w", "readOnly": True}}, "/models"),
        ({"pvc": {"claimName": "w", "subPath": "a/b/"}, "servedModelNames": ["m"]},
         {"persistentVolumeClaim": {"claimName": "w", "readOnly": True}}, "/models/a/b"),
        ({"hostPath": {"path": "/data/m"}, "servedModelNames": ["m"]}, {"hostPath": {"path": "/data/m", "type": "Directory"}}, "/models"),
    ],
)
def test_model_sources(model, volume, directory):
    _, spec = build(model=model)
    volumes, mounts, model_dir = model_storage(spec)
    assert model_dir == directory
    if volume is None:
        assert volumes == [] and mounts == []
    else:
        assert volumes == [{"name": "model", **volume}]
        assert mounts == [{"name": "model", "mountPath": "/models", "readOnly": True}]


def test_serving_container_has_probes_ports_and_resources():
    body, spec = build(resources={"requests": {"cpu": "4", "memory": "32Gi"}})
    container = desired_children(body, spec).slices[0]["spec"]["leaderTemplate"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "32Gi"}}
    assert container["volumeMounts"][0]["mountPath"] == "/models"


def test_router_deployment_config_and_services():
    body, spec = build(routing={"policy": "kv-aware", "replicas": 2, "sessionAffinity": {"enabled": True}})
    cm, deploy, svc, _, engines, _ = desired_children(body, spec).others
    config = json.loads(cm["data"]["router.json"])
    assert config == router_config(body, spec)
    assert config["policy"] == "kv-aware"
    assert config["sessionAffinity"] == {"enabled": True, "header": "x-session-id", "ttlSeconds": 600}
    assert "backends" not in config          # the router reads endpoints.json, not a DNS name
    assert config["models"] == ["llama-8b", "llama"]
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["template"]["spec"]["containers"][0]["command"][:2] == ["tokenfleet", "route"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert engines["spec"]["clusterIP"] == "None"
    assert engines["spec"]["selector"] == {"tokenfleet.dev/inference-service": "llama", "tokenfleet.dev/role": "serve",
                                           "tokenfleet.dev/leader": "true"}


def test_router_rolls_when_its_config_changes():
    a = desired_children(*build()).others[1]["spec"]["template"]["metadata"]["annotations"]
    b = desired_children(*build(routing={"policy": "round-robin"})).others[1]["spec"]["template"]["metadata"]["annotations"]
    assert a != b


def test_hourly_cost():
    _, spec = build()
    assert hourly_cost(spec, 2) == 2 * (8 * 2.5 + 1.0)
    assert hourly_cost(spec, 0) == 0
    _, cpu = build(accelerator={"type": "cpu"}, price={"acceleratorPerHour": 9, "overheadPerHour": 0.5})
    assert hourly_cost(cpu, 3) == 1.5


def test_member_pod_of_a_slice():
    body = slice_body()
    spec = SliceSpec.model_validate(body["spec"])
    pod = member_pod(body, spec, 1, attempt=2, revision="abc")
    assert pod["metadata"]["name"] == "llama-0-1"
    labels = pod["metadata"]["labels"]
    assert labels["app"] == "x"
    assert labels["tokenfleet.dev/slice"] == "llama-0" and labels["tokenfleet.dev/member"] == "1"
    assert labels["tokenfleet.dev/attempt"] == "2" and labels["tokenfleet.dev/revision"] == "abc"
    assert labels["tokenfleet.dev/leader"] == "false" and labels["tokenfleet.dev/role"] == "serve"
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "Slice"
    ps = pod["spec"]
    assert ps["restartPolicy"] == "Never"
    assert ps["nodeSelector"] == {"tokenfleet.dev/accelerator": "nvidia-h100-80gb"}
    main = ps["containers"][0]
    assert main["resources"] == {"requests": {"nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}
    env = {e["name"]: e["value"] for e in main["env"]}
    assert env["A"] == "1"
    assert env["TOKENFLEET_MEMBER_INDEX"] == "1" and env["TOKENFLEET_SLICE_HOSTS"] == "2"
    assert env["TOKENFLEET_LEADER_POD"] == "llama-0-0" and env["TOKENFLEET_TOPOLOGY"] == "2x4"
    term = ps["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "tokenfleet.dev/block"
    # the template itself is not modified
    assert "env" in body["spec"]["template"]["spec"]["containers"][0] and len(spec.template.spec["containers"][0]["env"]) == 1


def test_member_pod_bound_by_a_placer_and_on_cpu():
    body = slice_body(accelerator={"type": "cpu"}, topology="2")
    spec = SliceSpec.model_validate(body["spec"])
    pod = member_pod(body, spec, 0, attempt=0, revision="r", node="kwok-gpu-3")
    assert pod["spec"]["nodeName"] == "kwok-gpu-3"
    assert "affinity" not in pod["spec"] and "nodeSelector" not in pod["spec"]
    assert "resources" not in pod["spec"]["containers"][0]
    assert pod["metadata"]["labels"]["tokenfleet.dev/leader"] == "true"


def test_member_pod_restore_environment_and_checkpoint_volume():
    body = slice_body(role="batch", checkpoint={"store": "pvc://ckpt/run1", "intervalSeconds": 60})
    spec = SliceSpec.model_validate(body["spec"])
    pod = member_pod(body, spec, 0, attempt=1, revision="r", restore_from="pvc://ckpt/run1")
    main = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in main["env"]}
    assert env["TOKENFLEET_CHECKPOINT_STORE"] == "pvc://ckpt/run1"
    assert env["TOKENFLEET_CHECKPOINT_INTERVAL_SECONDS"] == "60"
    assert env["TOKENFLEET_RESTORE_FROM"] == "pvc://ckpt/run1"
    assert env["TOKENFLEET_REVISION"] == "r" and env["TOKENFLEET_ATTEMPT"] == "1"
    assert env["TOKENFLEET_CHECKPOINT_DIR"] == "/var/run/tokenfleet/checkpoints/run1"
    assert {"name": "tokenfleet-checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}} in pod["spec"]["volumes"]
    assert {"name": "tokenfleet-checkpoints", "mountPath": "/var/run/tokenfleet/checkpoints"} in main["volumeMounts"]


@pytest.mark.parametrize("store, volume, directory", [
    ("pvc://claim", {"persistentVolumeClaim": {"claimName": "claim"}}, "/var/run/tokenfleet/checkpoints"),
    ("hostpath:///data/ck", {"hostPath": {"path": "/data/ck", "type": "DirectoryOrCreate"}},
     "/var/run/tokenfleet/checkpoints"),
    ("file:///mnt/shared/ck", None, "/mnt/shared/ck"),
])
def test_checkpoint_stores_on_volumes_are_mounted(store, volume, directory):
    body = slice_body(role="batch", checkpoint={"store": store})
    spec = SliceSpec.model_validate(body["spec"])
    pod = member_pod(body, spec, 1, attempt=0, revision="r")
    main = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in main["env"]}
    assert env.get("TOKENFLEET_CHECKPOINT_DIR") == directory
    mine = [v for v in pod["spec"].get("volumes", []) if v["name"] == "tokenfleet-checkpoints"]
    assert [{k: v for k, v in m.items() if k != "name"} for m in mine] == ([volume] if volume else [])
    assert "TOKENFLEET_RESTORE_FROM" not in env


@pytest.mark.parametrize("store, mounted", [("pvc://cache/llama", True), ("hostpath:///var/cache/tf", True),
                                            ("file:///shared/llama", False)])
def test_warm_restart_passes_the_store_to_every_serving_member(store, mounted):
    from tokenfleet_dev.localcluster.launch import expand
    from tokenfleet_serving.serve_args import argument_error, build_parser

    body, spec = build(warmRestart={"enabled": True, "maxMegabytes": 64},
                       slicePolicy={"checkpoint": {"store": store, "intervalSeconds": 45}})
    slice_ = slice_manifest(body, spec, 1)
    slice_["metadata"]["uid"] = "uid-slice"
    pod = member_pod(slice_, SliceSpec.model_validate(slice_["spec"]), 1, attempt=0, revision="r")
    main = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in main["env"]}
    if mounted:
        assert {"name": "tokenfleet-checkpoints", "mountPath": "/var/run/tokenfleet/checkpoints"} in main["volumeMounts"]
    argv = [expand(a, env) for a in main["command"]]       # as the kubelet expands $(VAR)
    assert argument_error(argv[2:]) is None
    args = build_parser().parse_args(argv[2:])
    assert args.prefix_checkpoint_dir == f"{env['TOKENFLEET_CHECKPOINT_DIR']}/prefix-cache"
    assert args.prefix_checkpoint_name == "llama-1-1"           # the replica's Slice and member: its successor's
    assert (args.prefix_checkpoint_interval, args.prefix_checkpoint_max_mb) == (45, 64)


def test_kv_offload_reaches_the_server_as_its_flags_and_warm_restart_puts_the_disk_tier_in_the_store():
    from tokenfleet_dev.localcluster.launch import expand
    from tokenfleet_serving.serve_args import argument_error, build_parser

    body, spec = build(engine={"kvOffload": {"hostMemory": "8Gi", "diskPath": "/var/cache/kv", "diskSize": "20Gi"}})
    argv = engine_args(spec, "/models")
    assert argument_error(argv[2:]) is None
    args = build_parser().parse_args(argv[2:])
    assert (args.kv_offload_host_mb, args.kv_offload_disk_path, args.kv_offload_disk_mb) == (8192, "/var/cache/kv", 20480)
    # no kvOffload: no tier; warm restart without a diskPath: the server's store is its disk tier (sized here)
    body, spec = build()
    assert not any(a.startswith("--kv-offload") for a in engine_args(spec, "/models"))
    body, spec = build(warmRestart={"enabled": True}, slicePolicy={"checkpoint": {"store": "pvc://cache/llama"}},
                       engine={"kvOffload": {"hostMemory": 500_000_000, "diskSize": "2Gi"}})
    args = build_parser().parse_args([expand(a, {"TOKENFLEET_CHECKPOINT_DIR": "/c", "TOKENFLEET_SLICE": "s",
                                                 "TOKENFLEET_MEMBER_INDEX": "0"}) for a in engine_args(spec, "/m")][2:])
    assert args.kv_offload_disk_path is None and args.prefix_checkpoint_dir == "/c/prefix-cache"
    assert (args.kv_offload_host_mb, args.kv_offload_disk_mb) == (476, 2048)     # 500 MB in whole MiB


def test_kv_offload_is_refused_with_a_condition_for_a_replica_over_several_ranks():
    from tokenfleet_operator.validation import check_inference_service

    _, spec = build(engine={"kvOffload": {"hostMemory": "1Gi"}},
                    accelerator={"type": "nvidia-h100-80gb", "countPerHost": 1})
    assert not [p for p in check_inference_service(spec) if "kvOffload" in p.field]
    _, spec = build(engine={"kvOffload": {"hostMemory": "1Gi"}},
                    accelerator={"type": "nvidia-h100-80gb", "countPerHost": 2})
    [problem] = [p for p in check_inference_service(spec) if p.field == "spec.engine.kvOffload"]
    assert problem.reason == "NotInServingImage" and "2 ranks" in problem.message


def test_no_warm_restart_no_prefix_checkpoint_flags_and_the_migration_limit_reaches_the_router():
    body, spec = build(slicePolicy={"checkpoint": {"store": "pvc://cache/llama"}})
    assert not any(a.startswith("--prefix-checkpoint") for a in engine_args(spec, "/models"))
    body, spec = build(routing={"migrationLimit": 0})
    assert router_config(body, spec)["migrationLimit"] == 0
