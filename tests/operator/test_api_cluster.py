"""The CRDs on the real API server: they install, teach kubectl explain, and
reject invalid objects with a message that names the field."""
from __future__ import annotations

import copy

import pytest

from operator_cluster import REPO, apply, install, isvc

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def installed(cluster):
    install(cluster)
    return cluster


def slice_manifest(**spec):
    body = {
        "accelerator": {"type": "nvidia-h100-80gb", "countPerHost": 4},
        "hosts": 2,
        "topology": "2x4",
        "template": {"spec": {"containers": [{"name": "main", "image": "busybox"}]}},
    }
    body.update(spec)
    return {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "Slice", "metadata": {"name": "gang"}, "spec": body}


def with_engine(**engine):
    return isvc("svc", engine=engine)


INVALID = [
    # (manifest, words the API server's message must contain)
    (isvc("svc", replicas=-1), ["spec.replicas"]),
    (isvc("svc", accelerator={"type": "nvidia-h100-80gb", "countPerHost": 0}), ["spec.accelerator.countPerHost"]),
    (with_engine(kvBlockSize=12), ["spec.engine.kvBlockSize", "Unsupported value"]),
    (with_engine(dtype="int4"), ["spec.engine.dtype"]),
    (isvc("svc", routing={"policy": "random"}), ["spec.routing.policy"]),
    (isvc("svc", model={"servedModelNames": ["m"]}), ["spec.model", "exactly one of model.path, model.pvc or model.hostPath"]),
    (isvc("svc", model={"path": "/m", "pvc": {"claimName": "w"}, "servedModelNames": ["m"]}), ["exactly one of"]),
    (isvc("svc", minReplicas=3, maxReplicas=2, replicas=2), ["spec.minReplicas", "minReplicas must not exceed maxReplicas"]),
    (isvc("svc", maxReplicas=2, replicas=3), ["spec.replicas", "replicas must not exceed maxReplicas"]),
    (with_engine(maxNumSeqs=256, maxNumBatchedTokens=128), ["spec.engine.maxNumBatchedTokens", "at least maxNumSeqs"]),
    (with_engine(quantization="awq", dtype="float32"), ["spec.engine.dtype", "quantized weights"]),
    (with_engine(speculativeDecoding={"method": "draft"}), ["spec.engine.speculativeDecoding.draftModel", "draftModel"]),
    (isvc("Bad_Name"), ["metadata.name"]),
    (isvc("svc", accelerator={"type": "nvidia-h100-80gb", "topology": "two"}), ["spec.accelerator.topology"]),
    (isvc("svc", price={"acceleratorPerHour": -2}), ["spec.price.acceleratorPerHour"]),
    (isvc("svc", resources={"requests": {"memory": "lots"}}), ["spec.resources.requests.memory"]),
    (slice_manifest(restartPolicy={"backoffSeconds": 600, "maxBackoffSeconds": 60}),
     ["spec.restartPolicy.backoffSeconds", "must not exceed maxBackoffSeconds"]),
    (slice_manifest(role="batch"), ["spec.checkpoint", "checkpoint.store"]),
    (slice_manifest(role="train"), ["spec.role"]),
    (slice_manifest(template=None), ["spec.template", "Required value"]),
    (slice_manifest(checkpoint={"store": "ftp://x"}), ["spec.checkpoint.store"]),
]


@pytest.mark.parametrize("manifest, words", INVALID, ids=[f"{i}-{w[0]}" for i, (_, w) in enumerate(INVALID)])
def test_api_server_rejects_invalid_objects_naming_the_field(installed, namespace, manifest, words):
    manifest = copy.deepcopy(manifest)
    if manifest["spec"].get("template", "") is None:
        del manifest["spec"]["template"]
    out = apply(installed, manifest, namespace, check=False)
    assert out.returncode != 0, f"accepted: {manifest}"
    for word in words:
        assert word in out.stderr, out.stderr


def test_valid_objects_are_accepted_and_defaulted(installed, namespace):
    apply(installed, isvc("svc"), namespace)
    apply(installed, slice_manifest(), namespace)
    import json
    svc = json.loads(installed.kubectl("get", "tfis", "svc", "-n", namespace, "-o", "json").stdout)
    assert svc["spec"]["engine"]["kvBlockSize"] == 16
    assert svc["spec"]["routing"]["policy"] == "prefix-aware"
    assert svc["spec"]["slicePolicy"]["restartPolicy"]["maxRestarts"] == 3
    gang = json.loads(installed.kubectl("get", "tfslice", "gang", "-n", namespace, "-o", "json").stdout)
    assert gang["spec"]["restartPolicy"] == {"maxRestarts": 3, "backoffSeconds": 10, "maxBackoffSeconds": 300}
    listing = installed.kubectl("get", "tokenfleet", "-n", namespace).stdout
    assert "inferenceservice.tokenfleet.dev/svc" in listing and "slice.tokenfleet.dev/gang" in listing


def test_samples_are_valid(installed, namespace):
    out = installed.kubectl("apply", "--dry-run=server", "-n", namespace, "-k", str(REPO / "manifests" / "samples"))
    assert "created (server dry run)" in out.stdout


def test_kubectl_explain_teaches_the_api(installed):
    out = installed.kubectl("explain", "inferenceservices.spec.engine.kvBlockSize").stdout
    assert "Tokens per KV-cache block" in out
    out = installed.kubectl("explain", "slices.status.phase").stdout
    assert "Restarting" in out


def test_applying_the_manifests_twice_changes_nothing(installed):
    base = str(REPO / "manifests" / "base")
    versions = lambda: installed.kubectl("get", "-k", base, "-o", "jsonpath={.items[*].metadata.resourceVersion}").stdout  # noqa: E731
    before = versions()
    out = installed.kubectl("apply", "--server-side", "-k", base).stdout
    assert versions() == before, "a second apply changed an object"
    assert all(line.endswith("serverside-applied") for line in out.strip().splitlines()), out
    diff = installed.kubectl("diff", "--server-side", "-k", base, check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr
