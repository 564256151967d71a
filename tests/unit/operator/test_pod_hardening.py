"""The pods and policies the operator builds (issue 19): PodSecurity "restricted", keys, NetworkPolicy."""
from __future__ import annotations

import base64
import json

from tokenfleet_operator.api import InferenceServiceSpec, SliceSpec
from tokenfleet_operator.builders.auth import NO_WIRING, REPLICA_KEY_ANNOTATION, Wiring, replica_key_secret
from tokenfleet_operator.builders.inference_service import desired_children
from tokenfleet_operator.builders.slice_pods import member_pod

from harness.operator_samples import isvc_body, slice_body

KEY_REF = {"name": "TOKENFLEET_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llama-replica-key", "key": "api-key"}}}


def build(wiring=NO_WIRING, **overrides):
    body = isvc_body(**overrides)
    spec = InferenceServiceSpec.model_validate(body["spec"])
    return body, desired_children(body, spec, wiring=wiring)


def pods_of(children):
    """(pod template metadata, pod spec) of the serving pods and of the router pods."""
    serving = children.slices[0]["spec"]["template"]
    router = next(m for m in children.others if m["kind"] == "Deployment")["spec"]["template"]
    return [(serving["metadata"], serving["spec"]), (router["metadata"], router["spec"])]


def restricted_violations(pod_spec):
    """What PodSecurity "restricted" (v1.34) would refuse in a pod spec: its checks, written out."""
    out = []
    pod_sc = pod_spec.get("securityContext") or {}
    volumes_ok = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
    for v in pod_spec.get("volumes") or []:
        if not set(v) - {"name"} <= volumes_ok:
            out.append(f"volume {v['name']}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(key):
            out.append(key)
    for c in [*(pod_spec.get("initContainers") or []), *pod_spec["containers"]]:
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation")
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
            out.append(f"{c['name']}: capabilities.drop")
        if set((sc.get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: capabilities.add")
        if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))):
            out.append(f"{c['name']}: runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.append(f"{c['name']}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccompProfile")
        for p in c.get("ports") or []:
            if p.get("hostPort"):
                out.append(f"{c['name']}: hostPort")
    return out


def test_serving_and_router_pods_meet_pod_security_restricted():
    for model in ({"pvc": {"claimName": "w"}, "servedModelNames": ["m"]}, {"path": "/opt/m", "servedModelNames": ["m"]}):
        _, children = build(model=model)
        for _, pod_spec in pods_of(children):
            assert restricted_violations(pod_spec) == []
            assert pod_spec["automountServiceAccountToken"] is False
            assert pod_spec["securityContext"]["runAsUser"] == 10001        # the serving image's user
            [container] = pod_spec["containers"]
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
            # the one writable place is an emptyDir
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
            assert {"name": "tmp", "emptyDir": {}} in pod_spec["volumes"]


def test_the_oracle_sees_what_restricted_refuses():
    _, children = build(model={"hostPath": {"path": "/data/m"}, "servedModelNames": ["m"]})
    [(_, serving), _] = pods_of(children)
    assert restricted_violations(serving) == ["volume model"]          # a host path is the user's choice, and refused
    bare = {"containers": [{"name": "c", "image": "x"}]}
    assert len(restricted_violations(bare)) == 4


def test_the_replica_key_reaches_router_and_replicas_only_through_a_secret_ref():
    _, children = build()
    for _, pod_spec in pods_of(children):
        [container] = pod_spec["containers"]
        assert KEY_REF in container["env"]
        assert not any("api-key" in arg or "--backend-api-key" in arg for arg in container["command"])


def test_the_replica_key_secret():
    body = isvc_body()
    owner = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": body["metadata"]}
    secret = replica_key_secret(owner, "k" * 43)
    assert secret["metadata"]["name"] == "llama-replica-key" and secret["immutable"] is True
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "k" * 43
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-isvc"


def test_client_keys_are_mounted_into_the_router_only_with_spec_auth():
    _, plain = build()
    router = pods_of(plain)[1][1]
    assert "--client-keys" not in router["containers"][0]["command"]
    _, authed = build(auth={"clientKeysSecretName": "team-keys"})
    serving, router = (spec for _, spec in pods_of(authed))
    command = router["containers"][0]["command"]
    assert command[command.index("--client-keys") + 1] == "/var/run/tokenfleet/client-keys"
    assert {"name": "client-keys", "secret": {"secretName": "team-keys"}} in router["volumes"]
    assert {"name": "client-keys", "mountPath": "/var/run/tokenfleet/client-keys", "readOnly": True} \
        in router["containers"][0]["volumeMounts"]
    assert "client-keys" not in json.dumps(serving)                    # replicas never see client keys
    # client keys are the router's business: the replicas do not roll for them
    assert plain.revision == authed.revision


def test_a_new_replica_key_rolls_router_and_replicas():
    _, first = build(Wiring("uid-a"))
    _, second = build(Wiring("uid-b"))
    assert first.revision != second.revision
    for metadata, _ in pods_of(second):
        assert metadata["annotations"][REPLICA_KEY_ANNOTATION] == "uid-b"


def test_network_policy_lets_only_the_router_and_the_operator_reach_the_serving_port():
    _, children = build(Wiring(operator_namespace="ops"))
    [policy] = [m for m in children.others if m["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"tokenfleet.dev/inference-service": "llama", "tokenfleet.dev/role": "serve"}}
    assert spec["policyTypes"] == ["Ingress"]
    router, operator, members = spec["ingress"]
    assert router["from"] == [{"podSelector": {"matchLabels": {"tokenfleet.dev/inference-service": "llama",
                                                                "tokenfleet.dev/role": "router"}}}]
    assert router["ports"] == [{"protocol": "TCP", "port": 8000}] == operator["ports"]
    assert operator["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}
    assert members["from"] == [{"podSelector": {"matchLabels": spec["podSelector"]["matchLabels"]}}]
    # the router's pods carry the labels the policy lets in
    router_labels = next(m for m in children.others if m["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert router["from"][0]["podSelector"]["matchLabels"].items() <= router_labels.items()


def test_member_pods_keep_their_last_words_unless_the_template_says_otherwise():
    body = slice_body()
    body["spec"]["template"]["spec"]["containers"].append({"name": "side", "image": "x", "terminationMessagePolicy": "File"})
    spec = SliceSpec.model_validate(body["spec"])
    pod = member_pod(body, spec, 0, attempt=0, revision="r")
    main, side = pod["spec"]["containers"]
    assert main["terminationMessagePolicy"] == "FallbackToLogsOnError" and side["terminationMessagePolicy"] == "File"
