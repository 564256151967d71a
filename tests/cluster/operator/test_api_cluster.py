"""The CRDs on the real API server: they install, teach kubectl explain, and
reject invalid objects with a message that names the field."""
from __future__ import annotations

import copy

import pytest

from harness.operator_cluster import REPO, apply, install, isvc

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
    # issue 32: sglang is a runtime to come, not one the operator builds yet
    (with_engine(runtime="sglang"), ["spec.engine.runtime", "Unsupported value", '"tokenfleet"', '"vllm"']),
    (isvc("svc", routing={"policy": "random"}), ["spec.routing.policy"]),
    (isvc("svc", model={"servedModelNames": ["m"]}), ["spec.model", "exactly one of path, pvc or hostPath"]),
    (isvc("svc", model={"path": "/m", "pvc": {"claimName": "w"}, "servedModelNames": ["m"]}), ["exactly one of"]),
    (isvc("svc", minReplicas=3, maxReplicas=2, replicas=2), ["spec.minReplicas", "minReplicas must not exceed maxReplicas"]),
    (isvc("svc", maxReplicas=2, replicas=3), ["spec.replicas", "replicas must not exceed maxReplicas"]),
    (with_engine(maxNumSeqs=256, maxNumBatchedTokens=128), ["spec.engine.maxNumBatchedTokens", "at least maxNumSeqs"]),
    (with_engine(quantization="awq", dtype="float32"), ["spec.engine.dtype", "quantized weights"]),
    (with_engine(speculativeDecoding={"method": "draft"}), ["spec.engine.speculativeDecoding.draftModel", "draftModel"]),
    (with_engine(speculativeDecoding={"method": "ngram", "draftModel": {"path": "/d"}}),
     ["spec.engine.speculativeDecoding.draftModel", "method ngram takes no draftModel"]),
    (with_engine(speculativeDecoding={"method": "draft", "draftModel": {}}),
     ["spec.engine.speculativeDecoding.draftModel", "exactly one of path, pvc or hostPath"]),
    (with_engine(speculativeDecoding={"method": "ngram", "numSpeculativeTokens": 17}),
     ["spec.engine.speculativeDecoding.numSpeculativeTokens"]),
    (isvc("Bad_Name"), ["metadata.name"]),
    (isvc("svc", accelerator={"type": "nvidia-h100-80gb", "topology": "two"}), ["spec.accelerator.topology"]),
    (isvc("svc", price={"acceleratorPerHour": -2}), ["spec.price.acceleratorPerHour"]),
    (isvc("svc", price={"overheadPerHour": -0.5}), ["spec.price.overheadPerHour"]),
    (isvc("svc", slo={"percentile": 0}), ["spec.slo.percentile", "greater than 0"]),
    (isvc("svc", slo={"percentile": 100.5}), ["spec.slo.percentile", "less than or equal to 100"]),
    (isvc("svc", maxReplicas=4, autoscaling={"targetKvCacheUsage": 1.5}), ["spec.autoscaling.targetKvCacheUsage"]),
    (isvc("svc", maxReplicas=4, autoscaling={"targetRequestsPerReplica": 0}), ["spec.autoscaling.targetRequestsPerReplica"]),
    # issue 37, defect 2: targets the autoscaler's arithmetic cannot take
    (isvc("svc", maxReplicas=4, autoscaling={"targetRequestsPerReplica": 5e-324}),
     ["spec.autoscaling.targetRequestsPerReplica", "0.01"]),
    (isvc("svc", maxReplicas=4, autoscaling={"targetKvCacheUsage": 5e-324}), ["spec.autoscaling.targetKvCacheUsage", "0.01"]),
    (isvc("svc", maxReplicas=4, autoscaling={"targetWaitingPerReplica": 0.005}),
     ["spec.autoscaling.targetWaitingPerReplica", "0.01"]),
    (isvc("svc", resources={"requests": {"memory": "lots"}}), ["spec.resources.requests.memory"]),
    (slice_manifest(restartPolicy={"backoffSeconds": 600, "maxBackoffSeconds": 60}),
     ["spec.restartPolicy.backoffSeconds", "must not exceed maxBackoffSeconds"]),
    (slice_manifest(role="batch"), ["spec.checkpoint", "checkpoint.store"]),
    (slice_manifest(role="train"), ["spec.role"]),
    (slice_manifest(template=None), ["spec.template", "Required value"]),
    (slice_manifest(checkpoint={"store": "ftp://x"}), ["spec.checkpoint.store"]),
    (isvc("svc", warmRestart={"enabled": True}), ["spec.warmRestart.enabled", "needs slicePolicy.checkpoint.store"]),
    (isvc("svc", warmRestart={"enabled": True}, slicePolicy={"checkpoint": {"store": "s3://bucket/llama"}}),
     ["spec.slicePolicy.checkpoint.store", "must be a file system store"]),
    (slice_manifest(checkpoint={"store": "s3://bucket/../other"}), ["spec.checkpoint.store", "s3:// and gs:// are not"]),
    (slice_manifest(checkpoint={"store": "gs://bucket/ck"}), ["spec.checkpoint.store", "pvc://CLAIM[/PATH]"]),
    (isvc("svc", warmRestart={"enabled": True}, slicePolicy={"checkpoint": {"store": "pvc://cache/llama"}},
          engine={"enablePrefixCaching": False}), ["spec.engine.enablePrefixCaching", "restores the prefix cache"]),
    (isvc("svc", warmRestart={"enabled": True, "maxMegabytes": 0},
          slicePolicy={"checkpoint": {"store": "pvc://cache/llama"}}), ["spec.warmRestart.maxMegabytes"]),
    (isvc("svc", routing={"migrationLimit": 11}), ["spec.routing.migrationLimit"]),
    (isvc("svc", routing={"loadFactor": 0.5}), ["spec.routing.loadFactor", "greater than or equal to 1"]),
    (isvc("svc", routing={"loadSlack": -1}), ["spec.routing.loadSlack"]),
    (isvc("svc", maxReplicas=4, autoscaling={"metricWindowSeconds": 601}), ["spec.autoscaling.metricWindowSeconds"]),
]


def template(**pod_spec):
    return slice_manifest(template={"spec": {"containers": [{"name": "main", "image": "busybox"}], **pod_spec}})


def container(**fields):
    return {"name": "main", "image": "busybox", **fields}


def labelled(labels):
    m = slice_manifest()
    m["spec"]["template"]["metadata"] = {"labels": labels}
    return m


# Issue 19: what the API server refused only when the operator created the pods, or let through to the
# operator's privilege, is refused with the object itself now.
HARDENED = [
    # defect 5: no path climbs out of its mount, no host root, no gang template that bypasses the gang scheduler
    (isvc("svc", model={"pvc": {"claimName": "w", "subPath": "../../etc"}, "servedModelNames": ["m"]}),
     ["spec.model.pvc.subPath"]),
    (isvc("svc", model={"hostPath": {"path": "/"}, "servedModelNames": ["m"]}), ["spec.model.hostPath.path"]),
    (isvc("svc", model={"hostPath": {"path": "/data/../etc"}, "servedModelNames": ["m"]}), ["spec.model.hostPath.path"]),
    (isvc("svc", model={"path": "/models/../etc", "servedModelNames": ["m"]}), ["spec.model.path"]),
    # issue 37, defect 1: the draft model is a model source like the model, with the same paths refused
    (with_engine(speculativeDecoding={"method": "draft", "draftModel": {"path": "/models/../etc"}}),
     ["spec.engine.speculativeDecoding.draftModel.path"]),
    (with_engine(speculativeDecoding={"method": "draft", "draftModel": {"path": "/"}}),
     ["spec.engine.speculativeDecoding.draftModel.path"]),
    (with_engine(speculativeDecoding={"method": "draft", "draftModel": {"hostPath": {"path": "/"}}}),
     ["spec.engine.speculativeDecoding.draftModel.hostPath.path"]),
    (with_engine(speculativeDecoding={"method": "draft", "draftModel": {"hostPath": {"path": "/var/../etc"}}}),
     ["spec.engine.speculativeDecoding.draftModel.hostPath.path"]),
    (with_engine(speculativeDecoding={"method": "draft", "draftModel": {"pvc": {"claimName": "w", "subPath": "../x"}}}),
     ["spec.engine.speculativeDecoding.draftModel.pvc.subPath"]),
    (slice_manifest(checkpoint={"store": "hostpath:///"}), ["spec.checkpoint.store"]),
    (slice_manifest(checkpoint={"store": "pvc://claim/../../x"}), ["spec.checkpoint.store"]),
    (slice_manifest(checkpoint={"store": "file:///data/../../etc"}), ["spec.checkpoint.store"]),
    (template(nodeName="kwok-gpu-0"), ["spec.template.spec.nodeName", "gang scheduler"]),
    (template(schedulerName="default-scheduler"), ["spec.template.spec.schedulerName", "gang scheduler"]),
    # defect 7: quantities, requests and limits, resource names, images, container names, label values
    (isvc("svc", resources={"requests": {"cpu": "-1"}}), ["spec.resources.requests.cpu"]),
    (isvc("svc", resources={"requests": {"cpu": -2}}), ["spec.resources.requests.cpu", "greater than or equal to 0"]),
    (isvc("svc", resources={"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}),
     ["spec.resources.requests", "at most its limit"]),
    (isvc("svc", routing={"resources": {"requests": {"cpu": 4}, "limits": {"cpu": "2"}}}),
     ["spec.routing.resources.requests", "at most its limit"]),
    (isvc("svc", resources={"requests": {"foo": "1"}}), ["spec.resources.requests", "resource names"]),
    (isvc("svc", resources={"limits": {"nvidia.com/gpu": "8"}}), ["spec.resources.limits", "spec.accelerator"]),
    (isvc("svc", image="tokenfleet/serving:0.1.0 "), ["spec.image"]),
    (template(containers=[container(name="Bad_Name")]), ["spec.template.spec.containers[0].name"]),
    (template(containers=[container(), container()]), ["spec.template.spec.containers[1]", "Duplicate value"]),
    (template(initContainers=[container()]), ["spec.template.spec.initContainers", "unique"]),
    (template(containers=[container(image="busybox ")]), ["spec.template.spec.containers[0].image"]),
    (template(containers=[container(resources={"requests": {"memory": "-1Gi"}})]),
     ["spec.template.spec.containers[0].resources.requests.memory"]),
    (template(containers=[container(resources={"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}})]),
     ["spec.template.spec.containers[0].resources.requests", "at most its limit"]),
    (template(containers=[container(resources={"limits": {"gpu": "1"}})]),
     ["spec.template.spec.containers[0].resources.limits", "resource names"]),
    (template(containers=[]), ["spec.template.spec.containers"]),
    (template(serviceAccountName="Not A Name"), ["spec.template.spec.serviceAccountName"]),
    (labelled({"team": "a b"}), ["spec.template.metadata.labels.team"]),
    (labelled({"bad key!": "a"}), ["spec.template.metadata.labels", "label keys"]),
    # issue 37, defect 9: quantities Kubernetes would overflow, on every resources map
    (isvc("svc", resources={"requests": {"cpu": "1e999"}}), ["spec.resources.requests[cpu]", "at most 8Pi"]),
    (isvc("svc", resources={"limits": {"memory": "9Pi"}}), ["spec.resources.limits[memory]", "at most 8Pi"]),
    (isvc("svc", resources={"requests": {"cpu": 10 ** 16}}), ["spec.resources.requests.cpu"]),
    (isvc("svc", routing={"resources": {"limits": {"cpu": "1E18"}}}), ["spec.routing.resources.limits[cpu]", "at most 8Pi"]),
    (template(containers=[container(resources={"requests": {"memory": "1e999"}})]),
     ["spec.template.spec.containers[0].resources.requests[memory]", "at most 8Pi"]),
    # defect 9: a model name is never a flag
    (isvc("svc", model={"path": "/m", "servedModelNames": ["--api-key"]}), ["spec.model.servedModelNames[0]"]),
    (isvc("svc", model={"path": "/m", "servedModelNames": ["two words"]}), ["spec.model.servedModelNames[0]"]),
    # issue 34: one way to size the KV cache, quantities and fractions in range
    (with_engine(kvCacheMemory="20Gi", acceleratorMemoryUtilization=0.8),
     ["spec.engine.kvCacheMemory", "at most one of kvCacheMemory"]),
    (with_engine(kvCacheMb=512, kvCacheMemory="1Gi"), ["spec.engine.kvCacheMemory", "at most one of kvCacheMemory"]),
    (with_engine(acceleratorMemoryUtilization=1.5), ["spec.engine.acceleratorMemoryUtilization"]),
    (with_engine(kvCacheMemory="-1Gi"), ["spec.engine.kvCacheMemory"]),
    (with_engine(kvCacheDtype="int4"), ["spec.engine.kvCacheDtype"]),
]
INVALID += HARDENED


@pytest.mark.parametrize("manifest, words", INVALID, ids=[f"{i}-{w[0]}" for i, (_, w) in enumerate(INVALID)])
def test_api_server_rejects_invalid_objects_naming_the_field(installed, namespace, manifest, words):
    manifest = copy.deepcopy(manifest)
    if manifest["spec"].get("template", "") is None:
        del manifest["spec"]["template"]
    out = apply(installed, manifest, namespace, check=False)
    assert out.returncode != 0, f"accepted: {manifest}"
    for word in words:
        assert word in out.stderr, out.stderr


@pytest.mark.parametrize("manifest", [
    isvc("svc", model={"hostPath": {"path": "/data/models/llama"}, "servedModelNames": ["llama-3.1:8b"]},
         auth={"clientKeysSecretName": "client-keys"},
         resources={"requests": {"cpu": 2, "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "16Gi"}}),
    isvc("svc", model={"pvc": {"claimName": "w", "subPath": "models/..hidden/x"}, "servedModelNames": ["m"]}),
    slice_manifest(checkpoint={"store": "pvc://claim/jobs/a"}),
    template(containers=[container(resources={"requests": {"nvidia.com/gpu": 1, "cpu": "500m"},
                                              "limits": {"nvidia.com/gpu": 1}})],
             initContainers=[container(name="init")], serviceAccountName="runner"),
    labelled({"example.com/team": "a_b.c-d", "empty": ""}),
    isvc("svc", resources={"requests": {"cpu": "1e3", "memory": "8Pi"}, "limits": {"cpu": 9007199254740992}}),
], ids=["isvc", "pvc-subpath", "pvc-store", "containers", "labels", "largest-quantities"])
def test_what_the_hardened_schema_still_accepts(installed, namespace, manifest):
    out = apply(installed, manifest, namespace, check=False)
    assert out.returncode == 0, out.stderr


def test_valid_objects_are_accepted_and_defaulted(installed, namespace):
    apply(installed, isvc("svc"), namespace)
    apply(installed, slice_manifest(), namespace)
    import json
    svc = json.loads(installed.kubectl("get", "tfis", "svc", "-n", namespace, "-o", "json").stdout)
    assert svc["spec"]["engine"]["kvBlockSize"] == 16
    assert svc["spec"]["engine"]["runtime"] == "tokenfleet"
    assert svc["spec"]["routing"]["policy"] == "prefix-aware"
    assert svc["spec"]["slicePolicy"]["restartPolicy"]["maxRestarts"] == 3
    assert svc["spec"]["warmRestart"] == {"enabled": False, "maxMegabytes": 256}
    assert svc["spec"]["routing"]["migrationLimit"] == 3
    assert (svc["spec"]["routing"]["loadFactor"], svc["spec"]["routing"]["loadSlack"]) == (1.25, 4)
    warm = isvc("warm", warmRestart={"enabled": True}, slicePolicy={"checkpoint": {"store": "pvc://cache/llama",
                                                                                   "intervalSeconds": 60}})
    apply(installed, warm, namespace)
    gang = json.loads(installed.kubectl("get", "tfslice", "gang", "-n", namespace, "-o", "json").stdout)
    assert gang["spec"]["restartPolicy"] == {"maxRestarts": 3, "backoffSeconds": 10, "maxBackoffSeconds": 300}
    listing = installed.kubectl("get", "tokenfleet", "-n", namespace).stdout
    assert "inferenceservice.tokenfleet.dev/svc" in listing and "slice.tokenfleet.dev/gang" in listing


def test_the_levers_the_engine_builds_are_accepted(installed, namespace):
    engine = {"dtype": "float32", "quantization": "int8",
              "speculativeDecoding": {"method": "draft", "numSpeculativeTokens": 5,
                                      "draftModel": {"pvc": {"claimName": "weights", "subPath": "draft"}}}}
    apply(installed, isvc("levers", engine=engine), namespace)
    import json
    svc = json.loads(installed.kubectl("get", "tfis", "levers", "-n", namespace, "-o", "json").stdout)
    assert svc["spec"]["engine"]["speculativeDecoding"]["draftModel"] == {"pvc": {"claimName": "weights", "subPath": "draft"}}


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


def test_an_inference_service_keeps_its_runtime(installed, namespace):
    # issue 32: one runtime per InferenceService; other engine fields still change as before
    apply(installed, isvc("engine", image="vllm/vllm-openai:v0.32.0", engine={"runtime": "vllm"}), namespace)
    changed = apply(installed, isvc("engine", image="vllm/vllm-openai:v0.32.0",
                                    engine={"runtime": "vllm", "maxNumSeqs": 64}), namespace, check=False)
    assert changed.returncode == 0, changed.stderr
    out = apply(installed, isvc("engine", engine={"runtime": "tokenfleet"}), namespace, check=False)
    assert out.returncode != 0
    assert "spec.engine.runtime" in out.stderr and "cannot change" in out.stderr, out.stderr
    untouched = isvc("plain")
    apply(installed, untouched, namespace)
    untouched["spec"]["engine"] = {"maxNumSeqs": 32}          # runtime defaulted before and after
    assert apply(installed, untouched, namespace, check=False).returncode == 0
