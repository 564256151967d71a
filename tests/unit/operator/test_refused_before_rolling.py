"""Issue 48, items 5 and 6: what the operator accepted and every replica then refused at start is a condition
naming the field before anything rolls (or a schema refusal where it is a shape rule): adapters beside a KV disk
tier, a KV cache larger than a rank's memory, extraArgs values the server's parser refuses, and checkpoint
stores nothing can use."""
from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tokenfleet_operator.api import InferenceServiceSpec, SliceSpec
from tokenfleet_operator.controller.errors import InvalidSpec
from tokenfleet_operator.reconcile.inference_service import _parse_spec
from tokenfleet_operator.validation import check_inference_service
from tokenfleet_serving.serve_args import argument_error

from harness.operator_samples import isvc_body, slice_body

BUNDLED = "tokenfleet/serving:0.1.0"
ADAPTERS = [{"name": "sql", "path": "/opt/adapters/sql"}]
WARM = {"warmRestart": {"enabled": True}, "slicePolicy": {"checkpoint": {"store": "pvc://cache/llama"}}}


def spec(accelerator: dict[str, Any] | None = None, **over: Any) -> InferenceServiceSpec:
    body = isvc_body(**{"image": BUNDLED, "accelerator": accelerator or {"type": "nvidia-h100-80gb", "countPerHost": 1},
                        **over})
    return InferenceServiceSpec.model_validate(body["spec"])


def only(problems):
    assert len(problems) == 1, problems
    return problems[0]


def first(problems):
    """The problem the condition and the Event show (the server's parser may name the same conflict after it)."""
    assert problems, problems
    return problems[0]


# ---- adapters beside a KV disk tier (the engine refuses them: engine.py, _attach_offload) ----------------
def test_adapters_with_warm_restart_are_refused_naming_both_fields():
    problem = first(check_inference_service(spec(adapters=ADAPTERS, **WARM)))
    assert (problem.reason, problem.field) == ("NotInServingImage", "spec.adapters")
    assert "warmRestart" in problem.message
    assert check_inference_service(spec(**WARM)) == [] and check_inference_service(spec(adapters=ADAPTERS)) == []


def test_adapters_with_a_disk_tier_are_refused_and_with_a_host_tier_are_not():
    disk = spec(adapters=ADAPTERS, engine={"kvOffload": {"diskPath": "/var/cache/kv"}})
    problem = first(check_inference_service(disk))
    assert (problem.reason, problem.field) == ("NotInServingImage", "spec.adapters")
    assert "kvOffload.diskPath" in problem.message
    assert check_inference_service(spec(adapters=ADAPTERS, engine={"kvOffload": {"hostMemory": "1Gi"}})) == []


def test_lora_switched_on_through_extra_args_beside_warm_restart_is_refused():
    problem = only(check_inference_service(spec(engine={"extraArgs": ["--enable-lora"]}, **WARM)))
    assert (problem.reason, problem.field) == ("InvalidEngineArgs", "spec.engine.extraArgs")
    assert "--enable-lora" in problem.message and "disk tier" in problem.message


def test_the_servers_parser_refuses_lora_beside_a_disk_tier():
    assert "disk tier" in argument_error(["--model", "m", "--enable-lora", "--kv-offload-disk-path", "/kv"])
    assert "disk tier" in argument_error(["--model", "m", "--enable-lora", "--prefix-checkpoint-dir", "/ck"])
    assert argument_error(["--model", "m", "--enable-lora", "--kv-offload-host-mb", "64"]) is None


# ---- a KV cache larger than a rank's memory ----------------------------------------------------------------
@pytest.mark.parametrize("accelerator, resources, engine, field", [
    ({"type": "nvidia-h100-80gb", "countPerHost": 1}, None, {"kvCacheMemory": "1Pi"}, "spec.engine.kvCacheMemory"),
    ({"type": "nvidia-h100-80gb", "countPerHost": 1}, None, {"kvCacheMb": 16777216}, "spec.engine.kvCacheMb"),
    ({"type": "acme-npu", "countPerHost": 1, "memoryPerDevice": "16Gi"}, None, {"kvCacheMemory": "20Gi"},
     "spec.engine.kvCacheMemory"),
    ({"type": "cpu", "countPerHost": 1}, {"limits": {"memory": "8Gi"}}, {"kvCacheMemory": "1Pi"},
     "spec.engine.kvCacheMemory"),
])
def test_a_kv_cache_larger_than_the_ranks_memory_is_refused(accelerator, resources, engine, field):
    over: dict[str, Any] = {"engine": engine}
    if resources is not None:
        over["resources"] = resources
    problem = only(check_inference_service(spec(accelerator, **over)))
    assert (problem.reason, problem.field) == ("KVCacheTooLarge", field)
    assert "more than a rank has" in problem.message


@pytest.mark.parametrize("accelerator, resources, engine", [
    ({"type": "nvidia-h100-80gb", "countPerHost": 1}, None, {"kvCacheMemory": "40Gi"}),
    ({"type": "cpu", "countPerHost": 1}, {"limits": {"memory": "8Gi"}}, {"kvCacheMemory": "2Gi"}),
    ({"type": "cpu", "countPerHost": 1}, None, {"kvCacheMemory": "1Pi"}),       # memory unknown: the server checks
    ({"type": "acme-npu", "countPerHost": 1}, None, {"kvCacheMemory": "1Pi"}),
])
def test_a_kv_cache_that_fits_or_whose_memory_is_unknown_passes(accelerator, resources, engine):
    over: dict[str, Any] = {"engine": engine}
    if resources is not None:
        over["resources"] = resources
    assert check_inference_service(spec(accelerator, **over)) == []


# ---- extraArgs values the server would refuse ---------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--structured-output-timeout", "--header-timeout", "--body-timeout",
                                  "--engine-stall-timeout", "--drain-timeout", "--distributed-timeout-seconds"])
@pytest.mark.parametrize("value", ["1e300", "inf", "nan", "86401"])
def test_extra_args_durations_the_server_cannot_wait_are_refused_naming_the_flag(flag, value):
    problem = only(check_inference_service(spec(engine={"extraArgs": [flag, value]})))
    assert (problem.reason, problem.field) == ("InvalidEngineArgs", "spec.engine.extraArgs")
    assert flag in problem.message and "86400" in problem.message


def test_extra_args_durations_within_a_day_pass():
    assert check_inference_service(spec(engine={"extraArgs": ["--structured-output-timeout", "30",
                                                              "--drain-timeout", "0"]})) == []


def test_extra_args_speculative_flags_without_a_method_are_refused():
    problem = only(check_inference_service(spec(engine={"extraArgs": ["--num-speculative-tokens", "3"]})))
    assert problem.field == "spec.engine.extraArgs" and "--speculative-method" in problem.message


# ---- checkpoint stores ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("store", ["s3://bucket/ck", "s3://bucket/../other", "gs://bucket/ck"])
def test_object_store_checkpoints_are_refused_naming_the_field_and_the_stores_there_are(store):
    with pytest.raises(ValidationError, match="pvc://CLAIM"):
        SliceSpec.model_validate(slice_body(checkpoint={"store": store})["spec"])
    body = isvc_body(slicePolicy={"checkpoint": {"store": store}})
    with pytest.raises(InvalidSpec) as refused:        # a stored object the schema let through before: its condition
        _parse_spec(body)
    problem = refused.value.problem
    assert (problem.reason, problem.field) == ("InvalidSpec", "spec.slicePolicy.checkpoint.store")
    assert "s3:// and gs:// are not supported" in problem.message and "file:///PATH" in problem.message


@pytest.mark.parametrize("extra, flag", [
    (["--log-level", "loud"], "--log-level"),                 # logging.basicConfig raised at start
    (["--device", "x"], "--device"),                          # torch.device raised at start
    (["--num-threads", "99999999999999999999"], "--num-threads"),
    (["--kv-offload-host-mb", "99999999999999999999"], "--kv-offload-host-mb"),
    (["--kv-offload-disk-mb", "99999999999999999999"], "--kv-offload-disk-mb"),
    (["--kv-cache-mb", "99999999999999999999"], "--kv-cache-mb"),
])
def test_extra_args_values_that_could_only_fail_at_start_are_refused_naming_the_flag(extra, flag):
    problem = only(check_inference_service(spec(engine={"extraArgs": extra})))
    assert (problem.reason, problem.field) == ("InvalidEngineArgs", "spec.engine.extraArgs")
    assert flag in problem.message


def test_a_kv_budget_or_host_tier_in_extra_args_is_held_to_the_ranks_memory():
    budget = only(check_inference_service(spec(engine={"extraArgs": ["--kv-cache-mb", "1048576"]})))   # 1 TiB
    assert (budget.reason, budget.field) == ("KVCacheTooLarge", "spec.engine.extraArgs")
    assert check_inference_service(spec(engine={"extraArgs": ["--kv-cache-mb", "4096"]})) == []
    cpu = {"type": "cpu", "countPerHost": 1}
    host = only(check_inference_service(spec(cpu, resources={"limits": {"memory": "4Gi"}},
                                             engine={"kvOffload": {"hostMemory": "8Gi"}})))
    assert (host.reason, host.field) == ("KVCacheTooLarge", "spec.engine.kvOffload.hostMemory")
    extra = only(check_inference_service(spec(cpu, resources={"limits": {"memory": "4Gi"}},
                                              engine={"extraArgs": ["--kv-offload-host-mb", "8192"]})))
    assert (extra.reason, extra.field) == ("KVCacheTooLarge", "spec.engine.extraArgs")
    assert check_inference_service(spec(cpu, resources={"limits": {"memory": "4Gi"}},
                                        engine={"kvOffload": {"hostMemory": "1Gi"}})) == []
