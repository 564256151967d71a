"""spec.adapters: the adapters file and the pod template (what changes a replica and what does not), the
checks the schema cannot make, and status.adapters from the replicas' readings."""
from __future__ import annotations

import json
from typing import Any

import pytest

from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.builders.adapters import adapters_configmap_name
from tokenfleet_operator.builders.inference_service import desired_children, slice_revision
from tokenfleet_operator.validation import check_inference_service
from tokenfleet_serving.contract.lora_adapters import parse_adapters
from tokenfleet_serving.serve_args import parse_serve_args

from harness.operator_samples import isvc_body

BUNDLED = "tokenfleet/serving:0.1.0"


def spec_with(adapters: list[dict[str, Any]] | None, model: dict[str, Any] | None = None, **over: Any) -> InferenceServiceSpec:
    body = isvc_body(**{"image": BUNDLED, "accelerator": {"type": "nvidia-h100-80gb", "countPerHost": 1}, **over})
    if model is not None:
        body["spec"]["model"] = {**model, "servedModelNames": ["base"]}
    if adapters is not None:
        body["spec"]["adapters"] = adapters
    return InferenceServiceSpec.model_validate(body["spec"])


def children(spec: InferenceServiceSpec):
    return desired_children(isvc_body(), spec)


def adapters_file(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    [cm] = [c for c in children(spec).others if c["metadata"]["name"] == adapters_configmap_name("llama")]
    return json.loads(cm["data"]["adapters.json"])["adapters"]


def pod_spec(spec: InferenceServiceSpec) -> dict[str, Any]:
    return children(spec).slices[0]["spec"]["template"]["spec"]


def revision(spec: InferenceServiceSpec) -> str:
    return slice_revision("llama", spec)


PVC_MODEL = {"pvc": {"claimName": "weights", "subPath": "llama-8b"}}


def test_each_source_becomes_a_volume_and_a_path_inside_it():
    spec = spec_with([
        {"name": "on-model-claim", "pvc": {"claimName": "weights", "subPath": "adapters/a"}, "hot": True},
        {"name": "below-models", "path": "/models/adapters/b"},
        {"name": "in-image", "path": "/opt/adapters/c"},
        {"name": "other-claim", "pvc": {"claimName": "loras"}},
        {"name": "host", "hostPath": {"path": "/data/loras", "subPath": "d"}},
    ], PVC_MODEL)
    entries = {e["name"]: e for e in adapters_file(spec)}
    assert entries["on-model-claim"] == {"name": "on-model-claim", "root": "model", "path": "adapters/a", "hot": True}
    assert entries["below-models"] == {"name": "below-models", "root": "model", "path": "adapters/b"}
    assert entries["in-image"] == {"name": "in-image", "path": "/opt/adapters/c"}
    assert entries["other-claim"]["path"] == "." and entries["other-claim"]["root"].startswith("adapters-pvc-")
    assert entries["host"]["path"] == "d" and entries["host"]["root"].startswith("adapters-host-")

    pod = pod_spec(spec)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[entries["other-claim"]["root"]]["persistentVolumeClaim"] == {"claimName": "loras", "readOnly": True}
    assert volumes[entries["host"]["root"]]["hostPath"] == {"path": "/data/loras", "type": "Directory"}
    assert volumes["adapters-file"]["configMap"]["name"] == "llama-adapters"
    assert [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v] \
        == ["weights", "loras"]                 # the model's claim is mounted once, adapters on it use it

    # the server's own parser reads the flags; every root the file names is given a directory
    argv = pod["containers"][0]["command"][2:]
    args = parse_serve_args(argv)
    assert args.enable_lora and args.lora_modules_file == "/etc/tokenfleet/adapters/adapters.json"
    roots = dict(args.lora_root)
    assert roots["model"] == "/models"
    assert {e.root for e in parse_adapters(json.dumps({"adapters": list(entries.values())})) if e.root} <= set(roots)
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert set(roots.values()) <= mounts


def test_adding_or_removing_adapters_on_mounted_volumes_changes_no_pod():
    one = [{"name": "a", "hostPath": {"path": "/data/loras", "subPath": "a"}}]
    base = revision(spec_with(one, PVC_MODEL))
    same_volume = one + [{"name": "b", "hostPath": {"path": "/data/loras", "subPath": "b"}}]
    by_path = one + [{"name": "c", "path": "/models/adapters/c"}, {"name": "d", "path": "/opt/d", "hot": True}]
    on_model = one + [{"name": "e", "pvc": {"claimName": "weights", "subPath": "e"}}]
    for adapters in (same_volume, by_path, on_model, list(reversed(same_volume))):
        assert revision(spec_with(adapters, PVC_MODEL)) == base, adapters
    assert revision(spec_with([], PVC_MODEL)) != base            # the host volume goes: a roll, documented
    assert revision(spec_with(one + [{"name": "f", "pvc": {"claimName": "new"}}], PVC_MODEL)) != base
    # the file itself does change
    assert adapters_file(spec_with(same_volume, PVC_MODEL)) != adapters_file(spec_with(one, PVC_MODEL))


def test_lora_is_on_while_the_list_is_set_even_empty():
    assert "--enable-lora" not in pod_spec(spec_with(None))["containers"][0]["command"]
    assert not [c for c in children(spec_with(None)).others if c["metadata"]["name"] == "llama-adapters"]
    empty = spec_with([])
    assert "--enable-lora" in pod_spec(empty)["containers"][0]["command"] and adapters_file(empty) == []
    assert revision(empty) == revision(spec_with([{"name": "x", "path": "/opt/x"}]))
    # the ConfigMap is applied before the Slices' pods need it
    assert children(empty).others[0]["metadata"]["name"] == "llama-adapters"


@pytest.mark.parametrize("adapters, field, words", [
    ([{"name": "base", "path": "/opt/a"}], "spec.adapters[0].name", "served model name"),
    ([{"name": "a", "path": "/opt/a"}, {"name": "a", "path": "/opt/b"}], "spec.adapters[1].name", "twice"),
])
def test_adapter_names_are_checked(adapters, field, words):
    [problem] = check_inference_service(spec_with(adapters, PVC_MODEL))
    assert (problem.reason, problem.field) == ("InvalidAdapter", field) and words in problem.message


def test_adapters_on_a_split_replica_are_refused_naming_the_field():
    spec = spec_with([{"name": "a", "path": "/opt/a"}], accelerator={"type": "nvidia-h100-80gb", "countPerHost": 2})
    [problem] = check_inference_service(spec)
    assert (problem.reason, problem.field) == ("NotInServingImage", "spec.adapters")
    assert "tensorParallelSize" in problem.message and "2 ranks" in problem.message


def test_adapters_need_the_bundled_image():
    spec = spec_with([{"name": "a", "path": "/opt/a"}], image="example.com/other-server:1")
    [problem] = check_inference_service(spec)
    assert (problem.reason, problem.field) == ("NotInServingImage", "spec.adapters")


def test_extra_args_may_bound_adapters_but_not_move_the_file():
    ok = spec_with([{"name": "a", "path": "/opt/a"}], engine={"extraArgs": ["--max-lora-rank", "32"]})
    assert check_inference_service(ok) == []
    bad = spec_with([{"name": "a", "path": "/opt/a"}], engine={"extraArgs": ["--lora-modules-file", "/x.json"]})
    [problem] = check_inference_service(bad)
    assert problem.field == "spec.engine.extraArgs" and "spec.adapters" in problem.message


# ---- status.adapters ---------------------------------------------------------------------------------------
REPLICA_TEXT = """\
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="base"} 400.0
# TYPE tokenfleet:lora_generation_tokens counter
tokenfleet:lora_generation_tokens_total{adapter="sql",engine="0",model_name="base"} 100.0
tokenfleet:lora_generation_tokens_total{adapter="poem",engine="0",model_name="base"} 0.0
# TYPE tokenfleet:lora_prompt_tokens counter
tokenfleet:lora_prompt_tokens_total{adapter="sql",engine="0",model_name="base"} 30.0
# TYPE tokenfleet:lora_adapter_loaded gauge
tokenfleet:lora_adapter_loaded{adapter="sql",engine="0",model_name="base"} 1.0
tokenfleet:lora_adapter_loaded{adapter="poem",engine="0",model_name="base"} 0.0
# TYPE tokenfleet:lora_adapter_error_info gauge
tokenfleet:lora_adapter_error_info{adapter="bad",engine="0",field="r",file="/a/bad/adapter_config.json",\
model_name="base",reason="rank 64 exceeds --max-lora-rank 16"} 1.0
"""


def test_a_replicas_adapters_are_read_from_its_metrics():
    from tokenfleet_operator.pod_metrics import adapters_from_metrics

    r = adapters_from_metrics(REPLICA_TEXT)
    assert dict(r.loaded) == {"sql": True, "poem": False}
    assert dict(r.generation_tokens) == {"sql": 100, "poem": 0} and dict(r.prompt_tokens) == {"sql": 30}
    assert r.all_generation_tokens == 400
    assert r.refused == (("bad", "/a/bad/adapter_config.json", "r", "rank 64 exceeds --max-lora-rank 16"),)
    assert adapters_from_metrics("not metrics {") == adapters_from_metrics("")


def test_status_adapters_split_the_cost_by_tokens_and_name_a_refused_adapter():
    from tokenfleet_operator.adapter_status import adapters_status
    from tokenfleet_operator.pod_metrics import ReplicaAdapters, adapters_from_metrics

    spec = spec_with([{"name": "sql", "path": "/a/sql", "hot": True}, {"name": "poem", "path": "/a/poem"},
                      {"name": "bad", "path": "/a/bad"}])
    one = adapters_from_metrics(REPLICA_TEXT)
    other = ReplicaAdapters(loaded=(("poem", True), ("sql", True)), generation_tokens=(("poem", 50), ("sql", 50)),
                            all_generation_tokens=200, refused=(("bad", "/a/bad/adapter_config.json", "r", "too big"),))
    gone = ReplicaAdapters(loaded=(("sql", True),), all_generation_tokens=10_000)     # not ready: left out
    adapters, condition = adapters_status(spec, {"svc-0-0": one, "svc-1-0": other, "svc-2-0": gone},
                                          {"svc-0-0", "svc-1-0"}, dollars_per_hour=6.0)
    by_name = {a["name"]: a for a in adapters}
    assert by_name["sql"] == {"name": "sql", "replicas": ["svc-0-0", "svc-1-0"], "servingReplicas": 2,
                              "promptTokens": 30, "generationTokens": 150, "tokenShare": 0.25, "dollarsPerHour": 1.5}
    assert by_name["poem"]["replicas"] == ["svc-1-0"] and by_name["poem"]["servingReplicas"] == 2
    assert by_name["poem"]["dollarsPerHour"] == pytest.approx(6.0 * 50 / 600)
    assert by_name["bad"]["servingReplicas"] == 0 and "adapter_config.json: r:" in by_name["bad"]["refused"]
    assert (condition.type, condition.status, condition.reason) == ("AdaptersReady", "False", "AdapterRefused")
    assert "'bad' (spec.adapters[2])" in condition.message and "svc-0-0, svc-1-0" in condition.message
    assert "/a/bad/adapter_config.json: r:" in condition.message

    fine = spec_with([{"name": "sql", "path": "/a/sql"}, {"name": "poem", "path": "/a/poem"}])
    _, condition = adapters_status(fine, {"svc-0-0": one, "svc-1-0": other}, {"svc-0-0", "svc-1-0"}, 6.0)
    assert (condition.status, condition.reason) == ("True", "AdaptersServed")
    _, condition = adapters_status(fine, {"svc-0-0": ReplicaAdapters(loaded=(("sql", True),)), "svc-1-0": other},
                                   {"svc-0-0", "svc-1-0"}, 6.0)
    assert (condition.status, condition.reason) == ("False", "AdaptersLoading") and "poem (1/2" in condition.message
    adapters, condition = adapters_status(fine, {}, set(), 6.0)
    assert condition.status == "Unknown" and "tokenShare" not in adapters[0]
    assert adapters_status(spec_with(None), {"svc-0-0": one}, {"svc-0-0"}, 6.0) == (None, None)


def test_the_condition_goes_with_spec_adapters():
    from tokenfleet_operator.inference_service_status import AdapterReports, compute_status

    spec = spec_with([{"name": "sql", "path": "/a/sql"}])
    reports = AdapterReports({"llama-0-0": adapters_from(REPLICA_TEXT)}, frozenset({"llama-0-0"}))
    status = compute_status(isvc_body(), spec, "r", [], 0, adapter_reports=reports)
    assert {c["type"] for c in status["conditions"]} >= {"AdaptersReady"} and status["adapters"][0]["name"] == "sql"
    later = compute_status(isvc_body(), spec_with(None), "r", [], 0, old_status=status)
    assert "AdaptersReady" not in {c["type"] for c in later["conditions"]} and "adapters" not in later


def adapters_from(text: str):
    from tokenfleet_operator.pod_metrics import adapters_from_metrics

    return adapters_from_metrics(text)
