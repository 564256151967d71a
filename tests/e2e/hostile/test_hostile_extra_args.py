"""The hostile layer's extraArgs family (issue 48): every flag a user may add to a replica's command line through
``engine.extraArgs``, given hostile values. The operator's check must refuse a value naming the field and the
flag, or the real ``tokenfleet serve`` must take it: here every value the check accepts goes, all at once, onto
one server's command line, which must start and answer plain and structured requests without a 5xx (``--
structured-output-timeout 1e300`` was accepted, and every structured request was a 500)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from tokenfleet_operator.api import InferenceServiceSpec
from tokenfleet_operator.validation import OPERATOR_SERVE_FLAGS, check_inference_service
from tokenfleet_serving.serve_args import ServeArgs, argument_error, flag_name

from harness.operator_samples import isvc_body
from harness.server import API_KEY, MODEL_NAME, ProcessServer, http

pytestmark = pytest.mark.slow

# Flags whose values name files this test does not make (each has its own tests), or that switch on what
# needs them.
NEEDS_FILES = {"speculative_draft_model", "lora_modules", "lora_modules_file", "lora_root", "kv_offload_disk_path"}
FLOATS = ["1e300", "inf", "-inf", "nan", "-1", "0", "1e20", "86400"]
INTS = ["99999999999999999999", str(2**63), str(2**50), "-1", "0"]
TEXTS = ["", "-", "x", "../../etc", "A" * 256]          # the schema bounds each argument to 256 characters


def hostile_cases() -> list[tuple[str, str]]:
    cases = []
    for f in dataclasses.fields(ServeArgs):
        if f.name in OPERATOR_SERVE_FLAGS or f.name in NEEDS_FILES or f.metadata.get("action") == "store_true":
            continue
        kind = "float" if "float" in str(f.type) else "int" if "int" in str(f.type) else "str"
        values = FLOATS if kind == "float" else INTS if kind == "int" else TEXTS
        cases += [(flag_name(f.name), v) for v in values]
    return cases


def problems(extra: list[str]) -> list[Any]:
    body = isvc_body(image="tokenfleet/serving:0.1.0", accelerator={"type": "cpu", "countPerHost": 1},
                     resources={"limits": {"memory": "4Gi"}}, engine={"extraArgs": extra})
    return check_inference_service(InferenceServiceSpec.model_validate(body["spec"]))


def test_every_extra_args_value_is_refused_naming_the_flag_or_taken_by_the_server(tiny_model):
    accepted: dict[str, str] = {}
    for flag, value in hostile_cases():
        found = problems([flag, value])
        if found:
            assert found[0].field == "spec.engine.extraArgs" and flag in found[0].message, (flag, value, found)
        else:
            assert argument_error(["--model", "m", flag, value]) is None, (flag, value)
            accepted.setdefault(flag, value)        # the first accepted: the most extreme (the lists run down)
    assert {"--structured-output-timeout", "--header-timeout", "--body-timeout", "--engine-stall-timeout"} <= \
        {flag for flag, _ in hostile_cases()}
    assert accepted.get("--structured-output-timeout") == "86400"       # 1e300 is refused
    extra = [token for flag, value in accepted.items() for token in (flag, value)]
    srv = ProcessServer(tiny_model, "--api-key", API_KEY, *extra)
    try:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        plain = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
        status, _, body = http("POST", f"{srv.base_url}/v1/completions", plain, headers=auth)
        assert status == 200, body
        structured = {**plain, "max_tokens": 8, "response_format": {"type": "json_object"}}
        status, _, body = http("POST", f"{srv.base_url}/v1/completions", structured, headers=auth)
        assert status < 500, (status, body)
        assert status == 200 or json.loads(body)["error"]["code"] == status
    finally:
        srv.close()
