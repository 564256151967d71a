"""The operator image carries no torch and no vLLM (docs/images.md): every module the operator runs, the
validation of the serving command line and the vLLM runtime's included, must import and work without them."""
import subprocess
import sys
import textwrap
from pathlib import Path

CHECK = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None          # import torch now raises ImportError, as in the operator image
    sys.modules["vllm"] = None           # and so does import vllm
    from harness.operator_samples import isvc_body
    from tokenfleet_operator.api import InferenceServiceSpec
    from tokenfleet_operator.validation import check_inference_service
    import tokenfleet_operator.main, tokenfleet_operator.reconcile.inference_service  # noqa: E401

    levers = {"quantization": "int8", "speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 4},
              "extraArgs": ["--num-speculative-tokens", "4", "--quantization", "int8"]}
    assert check_inference_service(InferenceServiceSpec.model_validate(isvc_body(engine=levers)["spec"])) == []
    refused = check_inference_service(InferenceServiceSpec.model_validate(
        isvc_body(engine={"extraArgs": ["--num-speculative-tokens", "99"]})["spec"]))
    assert [p.reason for p in refused] == ["InvalidEngineArgs"] and "[1, 16]" in refused[0].message, refused
    fp8 = check_inference_service(InferenceServiceSpec.model_validate(isvc_body(engine={"quantization": "fp8"})["spec"]))
    assert [p.reason for p in fp8] == ["NotInServingImage"], fp8
    vllm = isvc_body(image="vllm/vllm-openai:v0.32.0", engine={"runtime": "vllm", "quantization": "fp8",
                                                                "extraArgs": ["--enforce-eager"]})
    assert check_inference_service(InferenceServiceSpec.model_validate(vllm["spec"])) == []
    assert "torch" not in sys.modules or sys.modules["torch"] is None
    assert "vllm" not in sys.modules or sys.modules["vllm"] is None
    print("ok")
""")


def test_the_operator_validates_lever_flags_without_torch():
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
