"""The operator image carries no torch (docs/images.md): every module the operator runs, the validation of the
serving command line included, must import and work without it."""
import subprocess
import sys
import textwrap
from pathlib import Path

CHECK = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None          # import torch now raises ImportError, as in the operator image
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
    assert "torch" not in sys.modules or sys.modules["torch"] is None
    print("ok")
""")


def test_the_operator_validates_lever_flags_without_torch():
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
