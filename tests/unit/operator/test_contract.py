"""The operator and the serving image share one definition of what passes between them: every key the
operator writes is one the other side reads."""
from __future__ import annotations

import ast
import json
from pathlib import Path

from tokenfleet_operator.api import InferenceServiceSpec, SliceSpec
from tokenfleet_operator.builders.inference_service import desired_children, endpoints_config, router_config
from tokenfleet_operator.builders.slice_pods import member_env
from tokenfleet_serving.contract.pod_env import BATCH_WORKER, WORKLOAD_ONLY, PodEnv
from tokenfleet_serving.contract.router_files import parse_endpoints, parse_router_config, router_config_json

from harness.operator_samples import isvc_body, slice_body

REPO = Path(__file__).resolve().parents[3]


def test_router_json_round_trips_and_every_written_key_is_read():
    body = isvc_body(slo={"timeToFirstTokenMs": 400, "timePerOutputTokenMs": 40, "percentile": 99},
                     routing={"sessionAffinity": {"enabled": True, "header": "X-User", "ttlSeconds": 30},
                              "loadFactor": 2.5, "loadSlack": 3})
    spec = InferenceServiceSpec.model_validate(body["spec"])
    written = router_config(body, spec)
    config = parse_router_config(written)              # strict: a key it does not read would be refused
    assert router_config_json(config) == written       # and everything it read is what was written
    assert (config.slo.ttft_ms, config.slo.tpot_ms, config.slo.percentile) == (400, 40, 99.0)
    assert config.session_affinity.header == "x-user" and config.session_affinity.ttl_seconds == 30
    assert (config.load_factor, config.load_slack) == (2.5, 3)
    cm = desired_children(body, spec).others[0]
    assert json.loads(cm["data"]["router.json"]) == written


def test_endpoints_json_round_trips():
    pod = {"metadata": {"name": "llama-0-0", "labels": {"tokenfleet.dev/slice": "llama-0"}},
           "status": {"podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}]}}
    written = endpoints_config([pod])
    [ep] = parse_endpoints(written)
    assert (ep.pod, ep.slice, ep.ip, ep.port, ep.ready) == ("llama-0-0", "llama-0", "10.1.2.3", 8000, True)


def _env_names_read_by(path: Path) -> set[str]:
    """PodEnv members a module refers to (PodEnv.X), found in its syntax tree."""
    tree = ast.parse(path.read_text())
    return {PodEnv[n.attr].value for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "PodEnv"
            and n.attr in PodEnv.__members__}


def test_every_pod_variable_the_operator_sets_is_declared_and_read():
    spec = SliceSpec.model_validate(slice_body(checkpoint={"store": "pvc://ckpt/run1"}, topology="2x2")["spec"])
    written = {e["name"] for e in member_env("s", "ns", spec, 0, 1, "pvc://ckpt/run1", "rev")}
    assert written == {v.value for v in PodEnv}                         # nothing undeclared, nothing forgotten
    worker = REPO / "serving-image" / "tokenfleet_serving" / "batch" / "main.py"
    assert _env_names_read_by(worker) == {v.value for v in BATCH_WORKER}   # the bundled worker reads its share
    docs = (REPO / "docs" / "api.md").read_text()
    assert all(v.value in docs for v in WORKLOAD_ONLY)                  # the rest is documented for workloads
