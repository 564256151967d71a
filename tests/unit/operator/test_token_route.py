"""TokenRoute on the operator side, as pure functions: the spec's refusals, target resolution (missing targets,
route cycles, model names), the status and its kstatus / Argo CD reading, and what the operator writes for the
route's router, read back by the router's own parsers."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tokenfleet_operator.api.token_route import CASCADE_REFUSAL, TokenRouteSpec
from tokenfleet_operator.builders.token_route import desired_route_children, router_pod_endpoints, target_status
from tokenfleet_operator.controller.route_triggers import routes_naming
from tokenfleet_operator.controller.triggers import triggers
from tokenfleet_operator.token_route_status import compute_route_status, find_cycle, resolve
from tokenfleet_serving.contract.route_files import parse_targets
from tokenfleet_serving.contract.router_files import parse_endpoints, parse_router_config

from harness import kstatus
from harness.argo_health import health
from harness.operator_samples import isvc_body


def route_body(name="chat", **spec):
    body = {"model": "chat", "targets": [{"inferenceService": "small", "model": "small-m"},
                                         {"inferenceService": "large"}]} | spec
    return {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "TokenRoute",
            "metadata": {"name": name, "namespace": "ns", "uid": "uid-route", "generation": 2}, "spec": body}


def isvc(name, served, **status):
    body = isvc_body(name, model={"hostPath": {"path": f"/m/{name}"}, "servedModelNames": served},
                     accelerator={"type": "cpu"}, engine={"kvBlockSize": 32})
    body["status"] = status
    return body


SERVICES = {"small": isvc("small", ["small-m"]), "large": isvc("large", ["large-m", "big"])}


def test_cascade_and_a_target_naming_both_kinds_are_refused():
    with pytest.raises(ValidationError, match="cascade is not implemented"):
        TokenRouteSpec.model_validate(route_body(policy="cascade")["spec"])
    assert "use difficulty or cost" in CASCADE_REFUSAL
    with pytest.raises(ValidationError, match="exactly one of"):
        TokenRouteSpec.model_validate({"model": "m", "targets": [{"inferenceService": "a", "tokenRoute": "b"}]})
    with pytest.raises(ValidationError):
        TokenRouteSpec.model_validate({"model": "m", "targets": []})


def test_resolution_names_the_missing_target_the_wrong_model_and_the_cycle():
    spec = TokenRouteSpec.model_validate(route_body()["spec"])
    r = resolve("chat", spec, SERVICES.get, lambda n: None)
    assert r.problems == [] and [(t.name, t.model) for t in r.targets] == [("small", "small-m"), ("large", "large-m")]
    r = resolve("chat", spec, {"large": SERVICES["large"]}.get, lambda n: None)
    assert [(p.reason, p.field) for p in r.problems] == [("TargetNotFound", "spec.targets[0].inferenceService")]
    assert "InferenceService small does not exist" in r.problems[0].message and not r.cycle
    wrong = TokenRouteSpec.model_validate(route_body(targets=[{"inferenceService": "large", "model": "huge"}])["spec"])
    (p,) = resolve("chat", wrong, SERVICES.get, lambda n: None).problems
    assert p.reason == "TargetModelNotServed" and "large-m, big" in p.message
    # chat -> inner -> chat
    routes = {"inner": route_body("inner", targets=[{"tokenRoute": "chat"}])}
    outer = TokenRouteSpec.model_validate(route_body(targets=[{"inferenceService": "small"}, {"tokenRoute": "inner"}])["spec"])
    r = resolve("chat", outer, SERVICES.get, routes.get)
    assert r.cycle and r.problems[0].reason == "RouteCycle" and "chat -> inner -> chat" in r.problems[0].message
    assert find_cycle("a", lambda n: {"a": ["b"], "b": ["c"], "c": ["b"]}[n]) is None   # a cycle not through a


def test_status_conditions_and_how_kstatus_and_argo_read_them():
    spec = TokenRouteSpec.model_validate(route_body()["spec"])
    owner = route_body()
    r = resolve("chat", spec, SERVICES.get, lambda n: None)
    stats = {t.name: target_status(t.name, SERVICES.get(t.name)) for t in r.targets}
    ok = compute_route_status(owner, spec, r, {"small": True, "large": True}, 1, False, stats, "http://x", now="t")
    c = {x["type"]: (x["status"], x["reason"]) for x in ok["conditions"]}
    assert c["Ready"] == ("True", "Routing") and c["Stalled"][0] == "False" and c["Reconciling"][0] == "False"
    assert ok["readyTargets"] == 2 and ok["url"] == "http://x" and ok["observedGeneration"] == 2
    obj = owner | {"status": ok}
    assert kstatus.compute(obj)["status"] == "Current"
    assert health("TokenRoute", obj)["status"] == "Healthy"
    starting = compute_route_status(owner, spec, r, {}, 0, False, stats, "http://x", now="t")
    obj = owner | {"status": starting}
    assert kstatus.compute(obj)["status"] == "InProgress" and health("TokenRoute", obj)["status"] == "Progressing"
    missing = resolve("chat", spec, {"large": SERVICES["large"]}.get, lambda n: None)
    bad = compute_route_status(owner, spec, missing, {"large": True}, 1, False, stats, "http://x", now="t")
    c = {x["type"]: (x["status"], x["reason"]) for x in bad["conditions"]}
    assert c["TargetsResolved"] == ("False", "TargetNotFound") and c["Stalled"] == ("True", "TargetNotFound")
    assert c["Ready"] == ("True", "Routing")                 # it still routes over the target that exists
    obj = owner | {"status": bad}
    assert kstatus.compute(obj)["status"] == "Failed" and health("TokenRoute", obj)["status"] == "Degraded"
    assert "small does not exist" in health("TokenRoute", obj)["message"]
    assert health("TokenRoute", owner | {"status": {"observedGeneration": 1}})["status"] == "Progressing"


def test_a_classifier_that_is_missing_or_not_ready_is_a_condition():
    spec = TokenRouteSpec.model_validate(route_body(classifier={"inferenceService": "grader"})["spec"])
    r = resolve("chat", spec, SERVICES.get, lambda n: None)
    st = compute_route_status(route_body(), spec, r, {"small": True}, 1, False, {}, "u", now="t")
    c = {x["type"]: x for x in st["conditions"]}
    assert (c["ClassifierReady"]["status"], c["ClassifierReady"]["reason"]) == ("False", "ClassifierNotFound")
    assert "rules alone" in c["ClassifierReady"]["message"]
    services = SERVICES | {"grader": isvc("grader", ["g"])}
    r = resolve("chat", spec, services.get, lambda n: None)
    assert r.classifier_model == "g"
    st = compute_route_status(route_body(), spec, r, {"small": True}, 1, False, {}, "u", now="t")
    assert {x["type"]: x["reason"] for x in st["conditions"]}["ClassifierReady"] == "ClassifierNotReady"


def test_target_status_reads_cost_goodput_and_saturation():
    s = target_status("a", isvc("a", ["a"], cost={"dollarsPerHour": 3.0, "costPerMillionTokens": 1.25},
                                 goodput={"met": False}, desiredReplicas=2, readyReplicas=2))
    assert (s.cost_per_mtok, s.slo_met, s.saturated) == (1.25, False, False)
    # a service without a price shows 0 $/Mtok: unknown, not free
    unpriced = isvc("a", ["a"], cost={"dollarsPerHour": 0.0, "costPerMillionTokens": 0.0})
    assert target_status("a", unpriced).cost_per_mtok is None
    s = target_status("a", isvc("a", ["a"], cost={"dollarsPerHour": 3.0, "capacity": {"costPerMillionTokens": 0.5}},
                                 desiredReplicas=1, readyReplicas=0))
    assert (s.cost_per_mtok, s.slo_met, s.saturated) == (0.5, None, True)
    limited = isvc("a", ["a"], desiredReplicas=4, readyReplicas=4,
                   conditions=[{"type": "ScalingLimited", "status": "True", "reason": "AtMaxReplicas"}])
    assert target_status("a", limited).saturated
    assert target_status("a", None).cost_per_mtok is None


def router_pod(name, service, ip, ready=True):
    return {"metadata": {"name": name, "labels": {"tokenfleet.dev/inference-service": service,
                                                  "tokenfleet.dev/role": "router"}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_what_the_operator_writes_is_what_the_route_router_reads():
    spec = TokenRouteSpec.model_validate(route_body(policy="cost", classifier={"inferenceService": "large"},
                                                    difficulty={"maxTurns": 9})["spec"])
    owner = route_body()
    r = resolve("chat", spec, SERVICES.get, lambda n: None)
    eps = (router_pod_endpoints([router_pod("small-router-a", "small", "10.0.0.1")], "small")
           + router_pod_endpoints([router_pod("large-router-a", "large", "10.0.0.2", ready=False)], "large"))
    stats = [target_status(t.name, SERVICES[t.name]) for t in r.targets]
    cm, deploy, svc = desired_route_children(owner, spec, r.targets, eps, stats, r.classifier_model)
    config = parse_router_config(json.loads(cm["data"]["router.json"]))
    assert config.models == ("chat",) and config.migration_limit == 0 and config.route is not None
    assert config.route.policy == "cost" and config.route.difficulty.max_turns == 9
    assert [(t.name, t.model, t.kv_block_size) for t in config.route.targets] == [("small", "small-m", 32),
                                                                                  ("large", "large-m", 32)]
    assert config.route.classifier is not None and config.route.classifier.model == "large-m"
    assert [(e.pod, e.tier, e.port, e.ready) for e in parse_endpoints(json.loads(cm["data"]["endpoints.json"]))] == [
        ("large-router-a", "large", 8080, False), ("small-router-a", "small", 8080, True)]
    assert [t.name for t in parse_targets(json.loads(cm["data"]["targets.json"]))] == ["small", "large"]
    command = deploy["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["tokenfleet", "route"]
    assert command[-6:] == ["--target-model", "small", "/route-models/small", "--target-model", "large",
                            "/route-models/large"]
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-small"]["hostPath"]["path"] == "/m/small"
    assert svc["metadata"]["name"] == "chat-route" and svc["spec"]["ports"][0]["port"] == 80
    # endpoints and target state do not roll the router; the route's config does
    cm2, deploy2, _ = desired_route_children(owner, spec, r.targets, [], [], r.classifier_model)
    assert deploy2 == deploy and cm2["data"]["router.json"] == cm["data"]["router.json"]
    # a child's event queues its route, not an InferenceService
    assert triggers("Deployment", deploy) == [("TokenRoute", "ns", "chat")]


def test_a_target_or_its_router_pods_changing_queues_the_routes_naming_it():
    class Cache:
        def list(self, kind, ns):
            return [route_body("chat"), route_body("other", targets=[{"tokenRoute": "chat"}])]

    target = {"metadata": {"name": "small", "namespace": "ns"}}
    assert routes_naming(Cache(), "InferenceService", target) == [("TokenRoute", "ns", "chat")]
    pod = router_pod("large-router-a", "large", "1.2.3.4") | {}
    pod["metadata"]["namespace"] = "ns"
    assert routes_naming(Cache(), "Pod", pod) == [("TokenRoute", "ns", "chat")]
    assert routes_naming(Cache(), "TokenRoute", route_body("chat")) == [("TokenRoute", "ns", "other")]
    assert routes_naming(Cache(), "Node", {"metadata": {"name": "n"}}) == []


@pytest.mark.parametrize("header", ["Authorization", "cookie", "HOST", "Content-Length", "connection",
                                    "x-tokenfleet-route-hops"])
def test_a_credential_or_hop_by_hop_override_header_is_refused_naming_the_field(header):
    from tokenfleet_operator.api.token_route import RESERVED_HEADER_REFUSAL
    with pytest.raises(ValidationError, match="overrideHeader must not be"):
        TokenRouteSpec.model_validate(route_body(overrideHeader=header)["spec"])
    assert "authorization" in RESERVED_HEADER_REFUSAL


def test_override_is_off_by_default_and_keys_need_their_secret_which_the_router_gets_mounted():
    spec = TokenRouteSpec.model_validate(route_body()["spec"])
    r = resolve("chat", spec, SERVICES.get, lambda n: None)
    cm, deploy, _ = desired_route_children(route_body(), spec, r.targets, [], [], None)
    route = parse_router_config(json.loads(cm["data"]["router.json"])).route
    assert route is not None and (route.override, route.override_keys) == ("off", None)
    for bad in ({"override": "keys"}, {"override": "any", "overrideKeysSecretName": "ops"}):
        with pytest.raises(ValidationError, match="overrideKeysSecretName is required"):
            TokenRouteSpec.model_validate(route_body(**bad)["spec"])
    spec = TokenRouteSpec.model_validate(route_body(override="keys", overrideKeysSecretName="ops")["spec"])
    cm, deploy, _ = desired_route_children(route_body(), spec, r.targets, [], [], None)
    route = parse_router_config(json.loads(cm["data"]["router.json"])).route
    assert route is not None and (route.override, route.override_keys) == ("keys", "/var/run/tokenfleet/override-keys")
    pod = deploy["spec"]["template"]["spec"]
    assert {"name": "override-keys", "secret": {"secretName": "ops"}} in pod["volumes"]
    assert {"name": "override-keys", "mountPath": "/var/run/tokenfleet/override-keys", "readOnly": True} in \
        pod["containers"][0]["volumeMounts"]
