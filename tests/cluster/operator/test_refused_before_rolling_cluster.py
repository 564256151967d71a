"""Issue 48, items 5 and 6, on the real local plane: InferenceServices that every replica used to refuse at start
(adapters beside warm restart, kvCacheMemory: 1Pi, --structured-output-timeout 1e300 in extraArgs) get
Ready=False with a reason naming the field and a Warning Event before any Slice or pod exists. (The object
stores the API server refuses are in test_api_cluster.py.)"""
from __future__ import annotations

import functools
import json

import pytest

from harness.operator_cluster import Operator, condition, install, isvc, isvc_obj, names, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SERVING_IMAGE = "tokenfleet/serving:0.1.0"
ONE_H100 = {"type": "nvidia-h100-80gb", "countPerHost": 1}
POLICY = {"topologyKey": "tokenfleet.dev/block", "restartPolicy": {"backoffSeconds": 1}}

CASES = [
    ("adapters-warm",
     {"adapters": [{"name": "sql", "path": "/opt/adapters/sql"}], "warmRestart": {"enabled": True},
      "slicePolicy": {**POLICY, "checkpoint": {"store": "pvc://cache/llama"}}},
     "NotInServingImage", ["spec.adapters", "warmRestart"]),
    ("adapters-disk",
     {"adapters": [{"name": "sql", "path": "/opt/adapters/sql"}],
      "engine": {"kvOffload": {"diskPath": "/var/cache/kv"}}},
     "NotInServingImage", ["spec.adapters", "kvOffload.diskPath"]),
    ("kv-1pi", {"engine": {"kvCacheMemory": "1Pi"}},
     "KVCacheTooLarge", ["spec.engine.kvCacheMemory", "1 PiB", "80 GiB"]),
    ("so-timeout", {"engine": {"extraArgs": ["--structured-output-timeout", "1e300"]}},
     "InvalidEngineArgs", ["spec.engine.extraArgs", "--structured-output-timeout", "86400"]),
]


def events(cluster, namespace, name):
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                          "-o", "json")
    return [(e["type"], e["reason"], e["message"]) for e in json.loads(out.stdout)["items"]]


def warned(cluster, namespace, name, event):
    return event in events(cluster, namespace, name)


def refused_with(cluster, namespace, name, reason):
    ready = condition(isvc_obj(cluster, namespace, name), "Ready")
    return ready if ready.get("reason") == reason else None


def test_specs_every_replica_would_refuse_are_refused_before_anything_rolls(cluster, namespace, tmp_path):
    install(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log", router_image=SERVING_IMAGE).start()
    try:
        for name, spec, _, _ in CASES:
            body = isvc(name, replicas=1, image=SERVING_IMAGE, accelerator=ONE_H100, **{"slicePolicy": POLICY, **spec})
            # as JSON: in YAML, an unquoted 1e300 is a number, which the schema refuses before the operator sees it
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
        for name, _, reason, words in CASES:
            ready = wait_for(f"{name}: Ready=False {reason}",
                             functools.partial(refused_with, cluster, namespace, name, reason), 90, op)
            assert ready["status"] == "False"
            assert all(w in ready["message"] for w in words), ready["message"]
            assert wait_for(f"{name}: a Warning Event", functools.partial(
                warned, cluster, namespace, name, ("Warning", reason, ready["message"])), 30, op)
            selector = f"tokenfleet.dev/inference-service={name}"
            assert names(cluster, "slices", namespace, selector) == []
            assert names(cluster, "pods", namespace, selector) == []
    finally:
        op.stop()
