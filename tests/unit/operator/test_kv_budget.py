"""The KV-cache budget (issue 34, item 1): the pure arithmetic, the flags the operator gives the server for each
field, and the refusal of a maxModelLen the budget cannot hold once (condition KVCacheTooSmall)."""
from __future__ import annotations

import pytest

from tokenfleet_operator.api import InferenceServiceSpec
from tokenfleet_operator.builders.inference_service import engine_args
from tokenfleet_operator.builders.model_shape import needs_model_shape
from tokenfleet_operator.kv_budget import kv_budget, kv_budget_error
from tokenfleet_operator.parallelism import ModelShape
from tokenfleet_operator.validation import check_inference_service
from tokenfleet_serving.contract.kv_budget import ACCELERATOR_MEMORY_GIB, budget_from_memory, context_bytes, shortfall, tokens_that_fit
from tokenfleet_serving.contract.levers import kv_bytes_per_token
from tokenfleet_serving.contract.model_shape import shape_in
from tokenfleet_serving.serve_args import argument_error

from harness.operator_samples import isvc_body

GIB = 1 << 30
# Llama 3 8B: 32 layers, 32 heads, 8 KV heads, head_dim 128, 16 GB of bf16 weights
LLAMA3_8B = ModelShape(layers=32, attention_heads=32, kv_heads=8, intermediate_size=14336, head_dim=128,
                       dtype_bytes=2, weight_bytes=16_060_000_000)


def one_h100(**engine) -> InferenceServiceSpec:
    body = isvc_body(accelerator={"type": "nvidia-h100-80gb", "countPerHost": 1},
                     engine={"dtype": "bfloat16", "maxModelLen": 8192, **engine})
    return InferenceServiceSpec.model_validate(body["spec"])


def test_bytes_per_token_and_what_fits():
    per_token = kv_bytes_per_token(32, 8, 128, 2)
    assert per_token == 128 * 1024                                   # 128 KiB per token in bf16
    assert context_bytes(8192, per_token, 16) == GIB
    assert context_bytes(8193, per_token, 16) == GIB + 16 * per_token  # whole blocks
    assert tokens_that_fit(512 << 20, per_token, 16) == 4096          # the old default held 4,096 tokens
    assert tokens_that_fit(-5, per_token, 16) == 0
    assert budget_from_memory(80 * GIB, 0.9, 16 * GIB, GIB) == int(72 * GIB) - 17 * GIB
    assert shortfall(GIB, 8192, 32, 8, 128, 2, "auto", 16) is None
    why = shortfall(512 << 20, 8192, 32, 8, 128, 2, "auto", 16)
    assert why is not None and "1,024 MiB" in why and "4,096 tokens" in why
    assert shortfall(512 << 20, 8192, 32, 8, 128, 2, "int8", 16) is not None        # 520 MiB with the scales
    assert shortfall(540 << 20, 8192, 32, 8, 128, 2, "int8", 16) is None


def test_the_memory_table_knows_the_common_accelerators():
    for name in ("nvidia-h100-80gb", "nvidia-h200", "nvidia-a100-40gb", "nvidia-l4", "tpu-v5e"):
        assert ACCELERATOR_MEMORY_GIB[name] > 0


@pytest.mark.parametrize("engine, accelerator, flags", [
    ({"kvCacheMemory": "20Gi"}, {}, ["--kv-cache-memory-bytes", str(20 * GIB)]),
    ({"kvCacheMb": 2048}, {}, ["--kv-cache-mb", "2048"]),
    ({"acceleratorMemoryUtilization": 0.8}, {}, ["--gpu-memory-utilization", "0.8", "--accelerator-memory-bytes",
                                                 str(80 * GIB)]),
    ({}, {}, ["--gpu-memory-utilization", "0.9", "--accelerator-memory-bytes", str(80 * GIB)]),
    ({}, {"memoryPerDevice": "94Gi"}, ["--gpu-memory-utilization", "0.9", "--accelerator-memory-bytes",
                                       str(94 * GIB)]),
    ({}, {"type": "acme-npu"}, ["--gpu-memory-utilization", "0.9"]),          # not in the table: the server reads it
    ({"extraArgs": ["--kv-cache-mb", "64"]}, {}, []),                          # extraArgs replace the default
])
def test_each_field_becomes_the_servers_flags(engine, accelerator, flags):
    body = isvc_body(accelerator={"type": "nvidia-h100-80gb", "countPerHost": 1, **accelerator},
                     engine={"dtype": "bfloat16", **engine})
    spec = InferenceServiceSpec.model_validate(body["spec"])
    assert list(kv_budget(spec).flags) == flags
    args = engine_args(spec, "/models")
    assert all(f in args for f in flags)
    assert argument_error(args[2:]) is None                                  # the server takes them


def test_cpu_sizes_from_the_memory_limit_or_keeps_the_servers_default():
    cpu = isvc_body(accelerator={"type": "cpu"}, engine={"dtype": "float32"})
    assert kv_budget(InferenceServiceSpec.model_validate(cpu["spec"])).flags == ()
    cpu["spec"]["resources"] = {"limits": {"memory": "16Gi"}}
    budget = kv_budget(InferenceServiceSpec.model_validate(cpu["spec"]))
    assert budget.flags == ("--gpu-memory-utilization", "0.9") and budget.memory_bytes == 16 * GIB


def test_kv_cache_dtype_is_passed_and_fp8_is_refused_for_the_bundled_image():
    args = engine_args(one_h100(kvCacheDtype="int8"), "/models")
    assert args[args.index("--kv-cache-dtype") + 1] == "int8"
    assert "--kv-cache-dtype" not in engine_args(one_h100(), "/models")
    [problem] = [p for p in check_inference_service(one_h100(kvCacheDtype="fp8")) if p.reason == "NotInServingImage"]
    assert problem.field == "spec.engine.kvCacheDtype" and "fp8" in problem.message


def test_a_max_model_len_the_budget_cannot_hold_is_refused_naming_the_fields():
    spec = one_h100(kvCacheMemory="512Mi")                # what the sample had: 4,096 tokens of 8,192
    field, message = kv_budget_error(spec, LLAMA3_8B)
    assert field == "spec.engine.maxModelLen"
    assert "spec.engine.kvCacheMemory" in message and "kvCacheDtype int8" in message and "8192" in message
    [problem] = [p for p in check_inference_service(spec, shape=LLAMA3_8B) if p.reason == "KVCacheTooSmall"]
    assert problem.field == "spec.engine.maxModelLen"
    assert kv_budget_error(one_h100(kvCacheMemory="1Gi"), LLAMA3_8B) is None
    assert kv_budget_error(one_h100(kvCacheMemory="600Mi", kvCacheDtype="int8"), LLAMA3_8B) is None
    # the default on an H100: 0.9 x 80 GiB less 16 GB of weights and 1 GiB: room for ~440k tokens
    assert kv_budget_error(one_h100(), LLAMA3_8B) is None
    assert kv_budget_error(one_h100(maxModelLen=1048576), LLAMA3_8B) is not None
    # an L4 (24 GiB) at utilization 0.8: 19.2 - 15 - 1 GiB = ~3.2 GiB, 25k tokens; 32k do not fit
    l4 = isvc_body(accelerator={"type": "nvidia-l4", "countPerHost": 1},
                   engine={"dtype": "bfloat16", "maxModelLen": 32768, "acceleratorMemoryUtilization": 0.8})
    assert kv_budget_error(InferenceServiceSpec.model_validate(l4["spec"]), LLAMA3_8B) is not None
    l4["spec"]["engine"]["kvCacheDtype"] = "int8"
    assert kv_budget_error(InferenceServiceSpec.model_validate(l4["spec"]), LLAMA3_8B) is None


def test_tensor_parallel_ranks_each_hold_their_share_of_the_kv_heads():
    body = isvc_body(accelerator={"type": "nvidia-h100-80gb", "countPerHost": 2},
                     engine={"dtype": "bfloat16", "maxModelLen": 8192, "kvCacheMemory": "512Mi"})
    assert kv_budget_error(InferenceServiceSpec.model_validate(body["spec"]), LLAMA3_8B) is None   # 512 MiB per rank


def test_nothing_is_refused_without_the_shape_or_a_budget_the_operator_can_size():
    assert kv_budget_error(one_h100(kvCacheMemory="1Mi"), None) is None
    assert kv_budget_error(one_h100(kvCacheMemory="1Mi"), ModelShape(32, 32, 8, 14336)) is None   # no head_dim
    other = isvc_body(accelerator={"type": "acme-npu", "countPerHost": 1}, engine={"maxModelLen": 8192})
    assert kv_budget_error(InferenceServiceSpec.model_validate(other["spec"]), LLAMA3_8B) is None


def test_the_shape_is_read_for_a_single_rank_replica_whose_budget_the_operator_checks():
    assert needs_model_shape(one_h100())                                        # accelerator: checked
    cpu = isvc_body(accelerator={"type": "cpu"}, engine={"dtype": "float32", "maxModelLen": 512})
    assert not needs_model_shape(InferenceServiceSpec.model_validate(cpu["spec"]))     # the server checks
    cpu["spec"]["engine"]["kvCacheMemory"] = "64Mi"
    assert needs_model_shape(InferenceServiceSpec.model_validate(cpu["spec"]))


def test_the_model_shape_pod_reports_what_the_check_needs(tmp_path):
    import json

    from tokenfleet_serving.contract.model_shape import shape_of

    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "hidden_size": 4096, "torch_dtype": "bfloat16"}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    shape = shape_of(tmp_path)
    assert shape | {} == {"layers": 32, "attentionHeads": 32, "keyValueHeads": 8, "intermediateSize": 14336,
                          "headDim": 128, "dtypeBytes": 2, "weightBytes": 1000}
    pod = {"status": {"containerStatuses": [{"state": {"terminated": {"message": json.dumps(shape)}}}]}}
    assert shape_in(pod) == shape
    older = {k: shape[k] for k in ("layers", "attentionHeads", "keyValueHeads", "intermediateSize")}
    assert shape_in({"status": {"containerStatuses": [{"state": {"terminated": {"message": json.dumps(older)}}}]}}) == older


def test_the_shipped_sample_fits_its_context_and_the_old_default_would_not():
    from pathlib import Path

    import yaml

    sample = yaml.safe_load((Path(__file__).parents[3] / "manifests/samples/inferenceservice.yaml").read_text())
    spec = InferenceServiceSpec.model_validate(sample["spec"])
    assert spec.engine.max_model_len == 8192
    assert [p for p in check_inference_service(spec, shape=LLAMA3_8B) if p.reason == "KVCacheTooSmall"] == []
    old = spec.model_copy(update={"engine": spec.engine.model_copy(update={"accelerator_memory_utilization": None,
                                                                              "kv_cache_mb": 512})})
    assert kv_budget_error(old, LLAMA3_8B) is not None


def test_the_vllm_runtime_takes_the_budget_fields_as_vllms_flags_and_refuses_an_int8_kv_cache():
    def vllm(**engine):
        body = isvc_body(accelerator={"type": "nvidia-h100-80gb", "countPerHost": 1},
                         image="vllm/vllm-openai:v0.11.0", engine={"runtime": "vllm", "dtype": "bfloat16", **engine})
        return InferenceServiceSpec.model_validate(body["spec"])

    args = engine_args(vllm(acceleratorMemoryUtilization=0.85, kvCacheDtype="fp8"), "/models")
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.85" and args[args.index("--kv-cache-dtype") + 1] == "fp8"
    args = engine_args(vllm(kvCacheMemory="20Gi"), "/models")
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(20 * GIB)
    assert "--gpu-memory-utilization" not in engine_args(vllm(), "/models")      # vLLM's own default
    assert any(p.field == "spec.engine.kvCacheDtype" for p in check_inference_service(vllm(kvCacheDtype="int8")))
    both = vllm(acceleratorMemoryUtilization=0.8, extraArgs=["--gpu-memory-utilization", "0.9"])
    assert any(p.reason == "ExtraArgsCollision" for p in check_inference_service(both))
    assert check_inference_service(vllm(extraArgs=["--gpu-memory-utilization", "0.9"])) == []
