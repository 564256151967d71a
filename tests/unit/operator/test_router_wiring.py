"""The router's ConfigMap and Deployment: what the operator writes is what the router reads."""
import json

from tokenfleet_operator.api import InferenceServiceSpec
from tokenfleet_operator.builders.inference_service import desired_children, endpoints_config

from harness.operator_samples import isvc_body


def build(**overrides):
    body = isvc_body(**overrides)
    return body, InferenceServiceSpec.model_validate(body["spec"])


def pod(name, ip="10.0.0.1", ready=True, deleting=False, slice_="llama-0"):
    p = {"metadata": {"name": name, "labels": {"tokenfleet.dev/slice": slice_}},
         "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
    if ip:
        p["status"]["podIP"] = ip
    if deleting:
        p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return p


def test_endpoints_config_lists_addressable_pods_with_their_readiness():
    pods = [pod("llama-1-0", "10.0.0.2", ready=False, slice_="llama-1"), pod("llama-0-0", "10.0.0.1"),
            pod("llama-2-0", ip=None, slice_="llama-2"), pod("llama-3-0", "10.0.0.4", deleting=True),
            {"metadata": {"name": "llama-4-0"}, "status": {"podIP": "10.0.0.5"}}]
    assert endpoints_config(pods) == [
        {"pod": "llama-0-0", "slice": "llama-0", "ip": "10.0.0.1", "port": 8000, "ready": True},
        {"pod": "llama-1-0", "slice": "llama-1", "ip": "10.0.0.2", "port": 8000, "ready": False},
        {"pod": "llama-4-0", "slice": "", "ip": "10.0.0.5", "port": 8000, "ready": False},  # no conditions yet
    ]
    assert endpoints_config([]) == []


def test_endpoints_go_into_the_configmap_but_do_not_roll_the_router():
    body, spec = build()
    empty = desired_children(body, spec)
    eps = endpoints_config([pod("llama-0-0"), pod("llama-1-0", "10.0.0.2", slice_="llama-1")])
    full = desired_children(body, spec, eps)
    cm, deploy = full.others[0], full.others[1]
    assert json.loads(cm["data"]["endpoints.json"]) == eps
    assert json.loads(empty.others[0]["data"]["endpoints.json"]) == []
    assert cm["data"]["router.json"] == empty.others[0]["data"]["router.json"]
    assert deploy == empty.others[1]  # same config hash, same pod template


def test_what_the_operator_writes_parses_in_the_router():
    from tokenfleet_serving.contract.router_files import parse_endpoints, parse_router_config

    body, spec = build(routing={"policy": "kv-aware", "sessionAffinity": {"enabled": True, "header": "x-user"}},
                       engine={"kvBlockSize": 32}, price={"acceleratorPerHour": 2.5, "overheadPerHour": 1.0,
                                                          "currency": "EUR"})
    cm = desired_children(body, spec, endpoints_config([pod("llama-0-0")])).others[0]
    config = parse_router_config(json.loads(cm["data"]["router.json"]), "router.json")
    assert (config.policy, config.kv_block_size, config.model_path) == ("kv-aware", 32, "/models/llama-8b")
    assert config.session_affinity.enabled and config.session_affinity.header == "x-user"
    assert (config.price_per_replica_hour, config.currency) == (21.0, "EUR")  # 8 accelerators * 2.5 + 1.0
    assert config.models == ("llama-8b", "llama")
    [ep] = parse_endpoints(json.loads(cm["data"]["endpoints.json"]), "endpoints.json")
    assert (ep.pod, ep.ip, ep.port, ep.ready, ep.slice) == ("llama-0-0", "10.0.0.1", 8000, True, "llama-0")


def test_router_mounts_the_model_for_its_tokenizer():
    body, spec = build()
    deploy = desired_children(body, spec).others[1]
    pod_spec = deploy["spec"]["template"]["spec"]
    [container] = pod_spec["containers"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod_spec["volumes"]
    assert container["command"] == ["tokenfleet", "route", "--config", "/etc/tokenfleet/router.json",
                                    "--host", "0.0.0.0", "--port", "8080", "--model", "/models/llama-8b",
                                    "--drain-timeout", "30"]
    # a model baked into the image needs no volume
    body, spec = build(model={"path": "/opt/model", "servedModelNames": ["m"]})
    children = desired_children(body, spec)
    assert [v["name"] for v in children.others[1]["spec"]["template"]["spec"]["volumes"]] == ["config", "tmp"]
    assert json.loads(children.others[0]["data"]["router.json"])["modelPath"] == "/opt/model"


def test_routing_max_recorded_blocks_reaches_the_router():
    import pytest
    from pydantic import ValidationError

    from tokenfleet_serving.contract.router_files import DEFAULT_MAX_RECORDED_BLOCKS, parse_router_config

    for routing, want in (({}, DEFAULT_MAX_RECORDED_BLOCKS), ({"maxRecordedBlocks": 4096}, 4096)):
        body, spec = build(routing=routing)
        cm = desired_children(body, spec).others[0]
        assert parse_router_config(json.loads(cm["data"]["router.json"])).max_recorded_blocks == want
    with pytest.raises(ValidationError, match="maxRecordedBlocks|max_recorded_blocks"):
        build(routing={"maxRecordedBlocks": 10})
