"""Valid objects the unit tests start from (and mutate)."""
from __future__ import annotations

import copy
from typing import Any

from tokenfleet_operator.api import API_VERSION


def isvc_body(name: str = "llama", namespace: str = "ns", **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"pvc": {"claimName": "weights", "subPath": "llama-8b"}, "servedModelNames": ["llama-8b", "llama"]},
        "replicas": 2,
        "accelerator": {"type": "nvidia-h100-80gb", "countPerHost": 4, "hostsPerReplica": 2, "topology": "2x4"},
        "engine": {"dtype": "bfloat16", "maxModelLen": 8192, "maxNumBatchedTokens": 4096, "maxNumSeqs": 128},
        "price": {"acceleratorPerHour": 2.5, "overheadPerHour": 1.0},
        "slicePolicy": {"topologyKey": "tokenfleet.dev/block"},
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace, "uid": "uid-isvc", "generation": 3, "resourceVersion": "10"},
        "spec": spec,
    }


def slice_body(name: str = "llama-0", namespace: str = "ns", **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accelerator": {"type": "nvidia-h100-80gb", "resourceName": "nvidia.com/gpu", "countPerHost": 4},
        "hosts": 2,
        "topology": "2x4",
        "topologyKey": "tokenfleet.dev/block",
        "template": {
            "metadata": {"labels": {"app": "x"}},
            "spec": {"containers": [{"name": "main", "image": "busybox", "env": [{"name": "A", "value": "1"}]}]},
        },
        "restartPolicy": {"maxRestarts": 2, "backoffSeconds": 10, "maxBackoffSeconds": 300},
    }
    spec.update(copy.deepcopy(spec_overrides))
    return {
        "apiVersion": API_VERSION,
        "kind": "Slice",
        "metadata": {"name": name, "namespace": namespace, "uid": "uid-slice", "generation": 1, "resourceVersion": "5"},
        "spec": spec,
    }
