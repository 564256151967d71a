"""Issue 19 on the real control plane: pods under PodSecurity "restricted", no privilege of the operator's
own, refused children and dead containers in status, the replica key and the NetworkPolicy.

Serving pods run as real processes under the local pod runner (image tokenfleet/serving); the others
(example.invalid/...) are faked Ready by KWOK. A pod's emptyDir at /tmp hides the host's /tmp from the paths
it names, as it would in a container, so models read by path live outside /tmp (``pod_model``).
"""
from __future__ import annotations

import base64
import functools
import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.operator_cluster import (
    OPERATOR_NAMESPACE,
    OPERATOR_SA,
    Operator,
    apply,
    condition,
    get_json,
    install,
    isvc,
    isvc_obj,
    names,
    ready_with,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SERVING_IMAGE = "tokenfleet/serving:0.1.0"
RESTRICTED_CONTEXT = {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def restricted(cluster, namespace):
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/enforce-version=latest")


def events(cluster, namespace, name):
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}", "-o", "json")
    return [(e["type"], e["reason"], e["message"]) for e in json.loads(out.stdout)["items"]]


def post(url, body, key=None, timeout=120):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get_status(url, key=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def counters(op, name):
    """{labels: value} of one counter on the operator's /metrics."""
    out = {}
    for line in op.metrics().splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) + 1:].rpartition("} ")
            out[labels] = float(value)
    return out


def pod_ip(cluster, namespace, selector):
    pods = [p for p in (get_json(cluster, "pods", "-n", namespace, "-l", selector) or {}).get("items", [])
            if condition(p, "Ready").get("status") == "True" and not p["metadata"].get("deletionTimestamp")]
    return pods[0]["status"]["podIP"] if pods else None


def serving_isvc(name, model, **spec):
    body = isvc(name, model={"path": str(model), "servedModelNames": ["tiny"]}, replicas=1, image=SERVING_IMAGE,
                accelerator={"type": "nvidia-h100-80gb", "countPerHost": 1},
                engine={"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 4, "maxNumBatchedTokens": 256,
                        "extraArgs": ["--kv-cache-mb", "32", "--num-threads", "1"]},
                price={"acceleratorPerHour": 0})
    body["spec"].update(spec)
    return body


# ---------------------------------------------------------------- defect 6 (and 8, end to end)

def test_a_service_and_a_batch_slice_run_under_pod_security_restricted(cluster, namespace, pod_model, tmp_path):
    install(cluster)
    restricted(cluster, namespace)
    op = Operator(cluster, namespace, tmp_path / "operator.log", router_image=SERVING_IMAGE).start()
    try:
        cluster.kubectl("create", "secret", "generic", "client-keys", "-n", namespace, "--from-literal=alice=alice-key")
        apply(cluster, serving_isvc("svc", pod_model, auth={"clientKeysSecretName": "client-keys"}), namespace)

        inp = tmp_path / "items.jsonl"
        inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"item {i}", "max_tokens": 4}) + "\n" for i in range(4)))
        job = {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "Slice", "metadata": {"name": "job"}, "spec": {
            "accelerator": {"type": "nvidia-h100-80gb", "countPerHost": 1}, "hosts": 1,
            "topologyKey": "tokenfleet.dev/block", "role": "batch",
            "checkpoint": {"store": f"file://{tmp_path / 'ck'}"},
            "template": {"spec": {"securityContext": RESTRICTED_CONTEXT, "automountServiceAccountToken": False,
                                  "containers": [{
                                      "name": "main", "image": "tokenfleet/serving:test",
                                      "command": ["tokenfleet", "batch", "--model", str(pod_model), "--input", str(inp),
                                                  "--items-per-round", "2", "--host", "0.0.0.0", "--port", "8000",
                                                  "--num-threads", "1", "--kv-cache-mb", "32", "--dtype", "float32"],
                                      "ports": [{"name": "metrics", "containerPort": 8000}],
                                      "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
                                      "securityContext": RESTRICTED_CONTAINER}]}}}}
        apply(cluster, job, namespace)

        wait_for("the service Ready in a restricted namespace", lambda: ready_with(cluster, namespace, "svc", 1), 300, op)
        done = wait_for("the batch Slice Succeeded", lambda: (lambda s: s if (s or {}).get("status", {}).get("phase")
                                                               == "Succeeded" else None)(
            get_json(cluster, "slice", "job", "-n", namespace)), 300, op)
        assert done["status"]["members"]["succeeded"] == 1 and done["status"]["restarts"] == 0
        assert len((tmp_path / "ck" / "RESULT.jsonl").read_text().splitlines()) == 4

        # the pods the API server admitted carry what restricted asks for, and no ServiceAccount token
        for pod in get_json(cluster, "pods", "-n", namespace, "-l", "tokenfleet.dev/inference-service=svc")["items"]:
            assert pod["spec"]["automountServiceAccountToken"] is False
            assert not any("serviceAccountToken" in json.dumps(v) for v in pod["spec"].get("volumes", []))
            [c] = pod["spec"]["containers"]
            assert c["securityContext"]["readOnlyRootFilesystem"] and c["terminationMessagePolicy"] == "FallbackToLogsOnError"

        # clients need a key at the router; the replicas take only the router's key
        router = pod_ip(cluster, namespace, "tokenfleet.dev/role=router")
        replica = pod_ip(cluster, namespace, "tokenfleet.dev/slice=svc-0")
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
        assert post(f"http://{router}:8080/v1/completions", body)[0] == 401
        status, answer = post(f"http://{router}:8080/v1/completions", body, key="alice-key")
        assert status == 200 and answer["usage"]["completion_tokens"] == 3
        assert post(f"http://{replica}:8000/v1/completions", body, key="alice-key")[0] == 401
        assert get_status(f"http://{replica}:8000/cache/blocks") == 401
        secret = get_json(cluster, "secret", "svc-replica-key", "-n", namespace)
        replica_key = base64.b64decode(secret["data"]["api-key"]).decode()
        assert get_status(f"http://{replica}:8000/cache/blocks", replica_key) == 200
        assert replica_key not in op.log_path.read_text()           # never logged
    finally:
        op.stop()


# ---------------------------------------------------------------- defects 5 and 7

def refused_with(cluster, namespace, name, reason):
    """The service's Ready condition once it has this reason, else None."""
    ready = condition(isvc_obj(cluster, namespace, name), "Ready")
    return ready if ready.get("reason") == reason else None


def test_refused_children_and_host_paths_show_in_status(cluster, namespace, tmp_path):
    install(cluster)
    restricted(cluster, namespace)
    op = Operator(cluster, namespace, tmp_path / "operator.log", extra=("--allow-host-path", "/data/models")).start()
    try:
        # a template PodSecurity refuses: the Slice says so, with the API server's message, and an Event
        bare = {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "Slice", "metadata": {"name": "bare"}, "spec": {
            "accelerator": {"type": "nvidia-h100-80gb", "countPerHost": 1}, "hosts": 2,
            "topologyKey": "tokenfleet.dev/block",
            "template": {"spec": {"containers": [{"name": "main", "image": "example.invalid/x:1"}]}}}}
        apply(cluster, bare, namespace)
        ready = wait_for("PodForbidden on the Slice", lambda: (lambda c: c if c.get("reason") == "PodForbidden" else None)(
            condition(get_json(cluster, "slice", "bare", "-n", namespace), "Ready")), 60, op)
        assert ready["status"] == "False" and 'violates PodSecurity "restricted:latest"' in ready["message"]
        assert "the API server refused Pod bare-0 (403 Forbidden)" in ready["message"]
        assert ("Warning", "PodForbidden", ready["message"]) in events(cluster, namespace, "bare")
        assert names(cluster, "pods", namespace, "tokenfleet.dev/slice=bare") == []

        # a ServiceAccount that does not exist, then does: the Slice recovers on the queue's retry
        ghost = json.loads(json.dumps(bare))
        ghost["metadata"]["name"] = "ghost"
        ghost["spec"]["template"]["spec"] |= {"serviceAccountName": "ghost", "securityContext": RESTRICTED_CONTEXT}
        ghost["spec"]["template"]["spec"]["containers"][0]["securityContext"] = RESTRICTED_CONTAINER
        apply(cluster, ghost, namespace)
        ready = wait_for("the missing ServiceAccount on the Slice", lambda: (lambda c: c if c.get("reason") == "PodForbidden"
                                                                              else None)(
            condition(get_json(cluster, "slice", "ghost", "-n", namespace), "Ready")), 60, op)
        assert 'serviceaccount "ghost" not found' in ready["message"]
        cluster.kubectl("create", "serviceaccount", "ghost", "-n", namespace)
        wait_for("the Slice Ready once the ServiceAccount exists", lambda: condition(
            get_json(cluster, "slice", "ghost", "-n", namespace), "Ready").get("status") == "True", 180, op)

        # a host path the operator may mount, in a namespace that forbids host paths: both children say why
        apply(cluster, isvc("hp", model={"hostPath": {"path": "/data/models/llama"}, "servedModelNames": ["m"]},
                            replicas=1, accelerator={"type": "nvidia-h100-80gb", "countPerHost": 1}), namespace)

        def router_refused():
            obj = isvc_obj(cluster, namespace, "hp")
            return obj if condition(obj, "RouterReady").get("reason") == "RouterPodsRefused" and \
                "PodForbidden" in condition(obj, "SlicesReady").get("message", "") else None

        obj = wait_for("RouterPodsRefused and PodForbidden on the service", router_refused, 120, op)
        router = condition(obj, "RouterReady")
        assert router["status"] == "False" and 'volume "model" uses restricted volume type "hostPath"' in router["message"]
        assert condition(obj, "Ready")["status"] == "False"
        assert any(t == "Warning" and r == "RouterPodsRefused" for t, r, _ in events(cluster, namespace, "hp"))

        # a host path below no allowed prefix is never mounted: no children at all
        apply(cluster, isvc("far", model={"hostPath": {"path": "/etc/ssl"}, "servedModelNames": ["m"]}), namespace)
        ready = wait_for("HostPathNotAllowed", lambda: (lambda c: c if c.get("reason") == "HostPathNotAllowed" else None)(
            condition(isvc_obj(cluster, namespace, "far"), "Ready")), 60, op)
        assert "spec.model.hostPath.path" in ready["message"] and "/data/models" in ready["message"]
        assert names(cluster, "slices", namespace, "tokenfleet.dev/inference-service=far") == []

        # issue 37, defect 1: the draft model is a model source like any other, under the same policy
        for name, path in (("draft-etc", "/etc"), ("draft-kubelet", "/var/lib/kubelet/pods")):
            apply(cluster, isvc(name, engine={"speculativeDecoding": {"method": "draft", "draftModel": {
                "hostPath": {"path": path}}}}), namespace)
        for name, path in (("draft-etc", "/etc"), ("draft-kubelet", "/var/lib/kubelet/pods")):
            ready = wait_for(f"HostPathNotAllowed for {path}", functools.partial(
                refused_with, cluster, namespace, name, "HostPathNotAllowed"), 60, op)
            assert ready["status"] == "False"
            assert f"spec.engine.speculativeDecoding.draftModel.hostPath.path: host path {path} " in ready["message"]
            assert ("Warning", "HostPathNotAllowed", ready["message"]) in events(cluster, namespace, name)
            assert names(cluster, "slices", namespace, f"tokenfleet.dev/inference-service={name}") == []
    finally:
        op.stop()


# ---------------------------------------------------------------- defect 8: the replica key and the NetworkPolicy

def test_the_replica_key_is_made_once_never_read_and_made_anew_when_deleted(cluster, namespace, tmp_path):
    install(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log").start()
    try:
        apply(cluster, isvc("svc", replicas=1), namespace)
        wait_for("ready", lambda: ready_with(cluster, namespace, "svc", 1), 120, op)
        secret = get_json(cluster, "secret", "svc-replica-key", "-n", namespace)
        owner = secret["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], secret["immutable"]) == ("InferenceService", "svc", True)
        key = base64.b64decode(secret["data"]["api-key"]).decode()
        assert len(key) >= 43 and key not in op.log_path.read_text()
        uid = secret["metadata"]["uid"]

        def wired(key_uid):
            deploy = get_json(cluster, "deployment", "svc-router", "-n", namespace)
            gang = get_json(cluster, "slice", "svc-0", "-n", namespace)
            pods = get_json(cluster, "pods", "-n", namespace, "-l", "tokenfleet.dev/slice=svc-0")["items"]
            templates = [deploy["spec"]["template"], gang["spec"]["template"]]
            return all(t["metadata"]["annotations"]["tokenfleet.dev/replica-key"] == key_uid for t in templates) and \
                all(p["metadata"].get("annotations", {}).get("tokenfleet.dev/replica-key") == key_uid for p in pods) and \
                len(pods) == 2

        assert wired(uid)
        # a full pass over the unchanged service (an annotation asks for one) writes none of its children again
        # (the new ones included), and the resyncs after it find nothing new and are skipped
        before = counters(op, "tokenfleet_children_applied_total")
        passes = counters(op, "tokenfleet_reconcile_total")
        ok, unchanged = 'kind="InferenceService",result="ok"', 'kind="InferenceService",result="unchanged"'
        cluster.kubectl("annotate", "tfis", "svc", "-n", namespace, "example.com/touched=1")
        wait_for("a full pass and two skipped resyncs", lambda: (c := counters(op, "tokenfleet_reconcile_total"))
                 and c.get(ok, 0) >= passes.get(ok, 0) + 1 and c.get(unchanged, 0) >= passes.get(unchanged, 0) + 2, 60, op)
        assert counters(op, "tokenfleet_children_applied_total") == before
        env = get_json(cluster, "pod", "svc-0-0", "-n", namespace)["spec"]["containers"][0]["env"]
        assert {"name": "TOKENFLEET_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": "svc-replica-key", "key": "api-key"}}} in env

        # the operator may create Secrets, and do nothing else with them
        sa = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"
        for verb, allowed in (("create", "yes"), ("get", "no"), ("list", "no"), ("watch", "no"), ("update", "no"),
                              ("delete", "no")):
            out = cluster.kubectl("auth", "can-i", verb, "secrets", "-n", namespace, f"--as={sa}", check=False)
            assert out.stdout.strip() == allowed, (verb, out.stdout)

        # only the router (and the operator) reach the serving port
        policy = get_json(cluster, "networkpolicy", "svc-replicas", "-n", namespace)
        assert policy["spec"]["podSelector"]["matchLabels"] == {"tokenfleet.dev/inference-service": "svc",
                                                                "tokenfleet.dev/role": "serve"}
        assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["tokenfleet.dev/role"] == "router"

        # deleted: made anew within a resync (3 s here), and router and replicas roll onto it
        cluster.kubectl("delete", "secret", "svc-replica-key", "-n", namespace)
        fresh = wait_for("a new key Secret", lambda: (lambda s: s if s and s["metadata"]["uid"] != uid else None)(
            get_json(cluster, "secret", "svc-replica-key", "-n", namespace)), 60, op)
        assert base64.b64decode(fresh["data"]["api-key"]).decode() != key
        wait_for("router and replicas on the new key", lambda: wired(fresh["metadata"]["uid"])
                 and ready_with(cluster, namespace, "svc", 1), 180, op)
        assert any(r == "ReplicaKeyRecreated" for _, r, _ in events(cluster, namespace, "svc"))
    finally:
        op.stop()


# ---------------------------------------------------------------- defect 9

def test_bad_arguments_are_refused_and_a_crash_says_why(cluster, namespace, tmp_path, pod_model):
    install(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log").start()
    try:
        apply(cluster, serving_isvc("args", "/models/tiny", engine={"extraArgs": ["--api-key", "x"]}), namespace)
        ready = wait_for("InvalidEngineArgs", lambda: (lambda c: c if c.get("reason") == "InvalidEngineArgs" else None)(
            condition(isvc_obj(cluster, namespace, "args"), "Ready")), 60, op)
        assert "spec.engine.extraArgs" in ready["message"] and "--api-key" in ready["message"]
        assert names(cluster, "slices", namespace, "tokenfleet.dev/inference-service=args") == []

        # a model that is not there: the model-shape pod cannot read it, so no Slice is placed for it at all
        apply(cluster, serving_isvc("gone", "/nonexistent/tokenfleet-model"), namespace)
        unreadable = wait_for("ModelNotReadable", lambda: (lambda c: c if c.get("reason") == "ModelNotReadable" else None)(
            condition(isvc_obj(cluster, namespace, "gone"), "Ready")), 180, op)
        assert "spec.model" in unreadable["message"] and "/nonexistent/tokenfleet-model" in unreadable["message"]
        assert names(cluster, "slices", namespace, "tokenfleet.dev/inference-service=gone") == []

        # a model whose config reads but whose weights are missing: the server exits 1 and says why; the Slice
        # and the service carry it
        # (beside pod_model, not under /tmp: a serving pod's /tmp is its own emptyDir)
        broken = Path(pod_model).with_name(Path(pod_model).name + "-weightless")
        broken.mkdir(exist_ok=True)
        shutil.copy(Path(pod_model) / "config.json", broken / "config.json")
        weightless = serving_isvc("weightless", broken)
        weightless["spec"]["slicePolicy"]["restartPolicy"] = {"maxRestarts": 0, "backoffSeconds": 1}
        apply(cluster, weightless, namespace)
        failed = wait_for("the Slice Failed", lambda: (lambda s: s if (s or {}).get("status", {}).get("phase") == "Failed"
                                                       else None)(get_json(cluster, "slice", "weightless-0", "-n",
                                                                           namespace)), 240, op)
        message = condition(failed, "Failed")["message"]
        assert "container engine exited with code 1" in message and "no *.safetensors file" in message, message
        svc = wait_for("the service shows it", lambda: (lambda o: o if "no *.safetensors file" in
                                                        condition(o, "Ready").get("message", "") else None)(
            isvc_obj(cluster, namespace, "weightless")), 60, op)
        assert condition(svc, "Ready")["reason"] == "SliceFailed"

        # a draft model the server cannot take: it exits 2 (a configuration error) and, with restarts to spare
        # (maxRestarts 3 by default), the Slice fails at once and is not restarted: no crash loop
        bad_draft = serving_isvc("draft", pod_model)
        bad_draft["spec"]["engine"]["speculativeDecoding"] = {"method": "draft",
                                                              "draftModel": {"path": "/nonexistent/draft-model"}}
        apply(cluster, bad_draft, namespace)
        stalled = wait_for("the Slice Failed", lambda: (lambda s: s if (s or {}).get("status", {}).get("phase") == "Failed"
                                                        else None)(get_json(cluster, "slice", "draft-0", "-n", namespace)),
                           240, op)
        failed = condition(stalled, "Failed")
        assert failed["reason"] == "ConfigurationError", failed
        assert "exited with code 2" in failed["message"] and "/nonexistent/draft-model" in failed["message"]
        assert stalled["status"]["restarts"] == 0 and not stalled["status"].get("lastRestart")
        svc = wait_for("the service shows it", lambda: (lambda o: o if "ConfigurationError" in
                                                        condition(o, "Ready").get("message", "") else None)(
            isvc_obj(cluster, namespace, "draft")), 60, op)
        assert "/nonexistent/draft-model" in condition(svc, "Stalled")["message"]
        time.sleep(5)                                    # and it stays down: no new attempt is made
        again = get_json(cluster, "slice", "draft-0", "-n", namespace)
        assert again["status"]["phase"] == "Failed" and again["status"]["restarts"] == 0
        assert names(cluster, "pods", namespace, "tokenfleet.dev/slice=draft-0") == []
    finally:
        op.stop()
        shutil.rmtree(Path(pod_model).with_name(Path(pod_model).name + "-weightless"), ignore_errors=True)
