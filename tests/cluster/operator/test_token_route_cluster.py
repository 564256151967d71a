"""TokenRoute on the real control plane: the API server refuses what the schema forbids (cascade, a target of
both kinds), the operator names a missing target and a route cycle in conditions, and a route over two
InferenceServices of real serving pods sends an easy request to the small one and a hard one to the large one,
each answered with that target's own usage."""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import yaml

from harness.operator_cluster import Operator, apply, condition, get_json, install, wait_for
from harness.router import metric_samples
from harness.support import http

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def route(name: str, **spec) -> dict:
    body = {"model": "chat", "targets": [{"inferenceService": "small"}, {"inferenceService": "large"}]} | spec
    return {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "TokenRoute", "metadata": {"name": name}, "spec": body}


def service(name: str, model_dir: Path) -> dict:
    return {
        "apiVersion": "tokenfleet.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
        "spec": {
            "model": {"path": str(model_dir), "servedModelNames": [f"{name}-m"]},
            "replicas": 1, "accelerator": {"type": "cpu"},
            "engine": {"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 4, "maxNumBatchedTokens": 256},
            "price": {"overheadPerHour": 1.0}, "image": "tokenfleet/serving:test",
        },
    }


def refused(cluster, namespace, manifest) -> str:
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=False)
    assert out.returncode != 0, "the API server took it"
    return out.stderr


def test_the_api_server_refuses_cascade_and_the_operator_names_missing_targets_and_cycles(cluster, namespace,
                                                                                          tmp_path):
    install(cluster)
    err = refused(cluster, namespace, route("casc", policy="cascade"))
    assert "spec.policy" in err and "cascade is not implemented" in err
    err = refused(cluster, namespace, route("both", targets=[{"inferenceService": "a", "tokenRoute": "b"}]))
    assert "exactly one of inferenceService and tokenRoute" in err
    err = refused(cluster, namespace, route("none", targets=[]))
    assert "spec.targets" in err
    op = Operator(cluster, namespace, tmp_path / "operator.log").start()
    try:
        apply(cluster, route("chat"), namespace)
        obj = wait_for("TargetsResolved=False", lambda: (o := get_json(cluster, "troute", "chat", "-n", namespace))
                       and condition(o, "TargetsResolved").get("status") == "False" and o, 60, op)
        c = condition(obj, "TargetsResolved")
        assert c["reason"] == "TargetNotFound" and "InferenceService small does not exist" in c["message"]
        assert condition(obj, "Stalled")["status"] == "True" and obj["status"]["observedGeneration"] == 1
        assert obj["status"]["url"] == f"http://chat-route.{namespace}.svc"
        # the route's router is built even so (it serves the targets that exist once they do)
        wait_for("the route's children", lambda: get_json(cluster, "deployment", "chat-route", "-n", namespace)
                 and get_json(cluster, "service", "chat-route", "-n", namespace), 30, op)
        table = cluster.kubectl("get", "troute", "chat", "-n", namespace).stdout
        assert table.split("\n")[0].split()[:5] == ["NAME", "MODEL", "POLICY", "TARGETS", "READY"]
        # chat -> inner -> chat
        apply(cluster, route("inner", model="inner", targets=[{"tokenRoute": "chat"}]), namespace)
        apply(cluster, route("chat", targets=[{"inferenceService": "small"}, {"tokenRoute": "inner"}]), namespace)
        obj = wait_for("RouteCycle", lambda: (o := get_json(cluster, "troute", "chat", "-n", namespace))
                       and condition(o, "TargetsResolved").get("reason") == "RouteCycle" and o, 60, op)
        assert "chat -> inner -> chat" in condition(obj, "TargetsResolved")["message"]
        assert condition(obj, "Ready")["reason"] == "RouteCycle"
        events = cluster.kubectl("get", "events", "-n", namespace, "-o", "jsonpath={.items[*].reason}").stdout.split()
        assert "TargetNotFound" in events and "RouteCycle" in events
    finally:
        op.stop()


@pytest.fixture(scope="module")
def two_models():
    """Two random checkpoints outside /tmp (serving pods read them by path), with different tokenizers."""
    from tokenfleet_serving.testing_models import create_random_checkpoint

    root = Path.home() / ".cache" / "tokenfleet" / "test-models" / f"route-{uuid.uuid4().hex[:8]}"
    small = create_random_checkpoint(root / "small", num_layers=2, vocab_size=512, max_position_embeddings=512)
    large = create_random_checkpoint(root / "large", num_layers=4, vocab_size=384, max_position_embeddings=512,
                                     seed=1)
    yield small, large
    shutil.rmtree(root, ignore_errors=True)


def route_pod_url(cluster, namespace) -> str | None:
    pods = (get_json(cluster, "pods", "-n", namespace, "-l", "tokenfleet.dev/token-route=chat") or {}).get("items", [])
    ready = [p for p in pods if condition(p, "Ready").get("status") == "True" and p["status"].get("podIP")]
    return f"http://{ready[0]['status']['podIP']}:8080" if ready else None


def test_a_route_over_two_services_sends_easy_requests_small_and_hard_ones_large(cluster, namespace, two_models,
                                                                                   tmp_path):
    install(cluster)
    small, large = two_models
    op = Operator(cluster, namespace, tmp_path / "operator.log", extra=("--collect-seconds=2",),
                  router_image="tokenfleet/serving:test").start()    # real routers: requests go through them
    try:
        apply(cluster, service("small", small), namespace)
        apply(cluster, service("large", large), namespace)
        apply(cluster, route("chat", targets=[{"inferenceService": "small"}, {"inferenceService": "large",
                                                                              "model": "large-m"}],
                             difficulty={"maxPromptTokens": 64, "maxOutputTokens": 8}), namespace)
        # Ready over both targets, each with a ready replica (before that, a target counts as saturated)
        obj = wait_for("the route Ready over 2 targets", lambda: (o := get_json(cluster, "troute", "chat", "-n",
                                                                                namespace))
                       and condition(o, "Ready").get("status") == "True" and o["status"].get("readyTargets") == 2
                       and not any(t["saturated"] for t in o["status"]["targets"]) and o, 240, op)
        assert condition(obj, "TargetsResolved")["status"] == "True"
        assert [t["model"] for t in obj["status"]["targets"]] == ["small-m", "large-m"]
        base = wait_for("a ready route pod", lambda: route_pod_url(cluster, namespace), 60, op)

        def ask(max_tokens: int):
            body = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
                    "temperature": 0}
            status, headers, raw = http("POST", f"{base}/v1/chat/completions", body, timeout=120)
            assert status == 200, raw[:300]
            return {k.lower(): v for k, v in headers.items()}, json.loads(raw)

        # the router re-reads targets.json within a second of the kubelet updating it
        wait_for("the route router sees no saturated target", lambda: all(
            metric_samples(base).get(f"tokenfleet_router_route_target_saturated{{target={t}}}") == 0
            for t in ("small", "large")), 30, op)
        headers, body = ask(4)
        assert (headers["x-tokenfleet-route-target"], headers["x-tokenfleet-route-reason"]) == ("small", "easy")
        assert body["model"] == "small-m"
        easy_prompt_tokens = body["usage"]["prompt_tokens"]
        headers, body = ask(9)
        assert (headers["x-tokenfleet-route-target"], headers["x-tokenfleet-route-reason"]) == ("large", "hard")
        assert body["model"] == "large-m" and body["usage"]["completion_tokens"] <= 9
        assert body["usage"]["prompt_tokens"] != easy_prompt_tokens     # the large model's own tokenizer
    finally:
        op.stop()


def test_the_api_server_refuses_a_credential_override_header_and_override_keys_without_their_secret(cluster,
                                                                                                     namespace):
    """overrideHeader Authorization (and the like) was accepted; who may override is spec.override, and its
    keys need spec.overrideKeysSecretName (docs/routing.md, "Override")."""
    install(cluster)
    for header in ("Authorization", "cookie", "Host", "Content-Length", "Connection", "x-tokenfleet-route-hops"):
        err = refused(cluster, namespace, route("hdr", overrideHeader=header))
        assert "spec.overrideHeader" in err and "must not be a credential, hop-by-hop or router header" in err, err
    err = refused(cluster, namespace, route("keys", override="keys"))
    assert "spec.overrideKeysSecretName" in err and "required with override keys" in err
    err = refused(cluster, namespace, route("any", override="any", overrideKeysSecretName="ops"))
    assert "spec.overrideKeysSecretName" in err
    err = refused(cluster, namespace, route("who", override="admins"))
    assert "spec.override" in err
    for name, spec in (("ok-keys", {"override": "keys", "overrideKeysSecretName": "ops"}),
                       ("ok-default", {"overrideHeader": "x-pick-target"})):
        out = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                              input=yaml.safe_dump(route(name, **spec)), check=False)
        assert out.returncode == 0, out.stderr
    obj = json.loads(cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-o", "json", "-f", "-",
                                     input=yaml.safe_dump(route("defaults"))).stdout)
    assert obj["spec"]["override"] == "off"
