"""Who may send a TokenRoute's override header, how far an override goes, and how far a request travels
through routes (router/route_mode.py; docs/routing.md, "Model routing": override and hops)."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from tokenfleet_serving.contract.route_files import HOPS_HEADER, MAX_ROUTE_HOPS, RouteConfig, RouteTarget
from tokenfleet_serving.contract.router_files import ConfigError, Endpoint, RouterConfig, parse_router_config, router_config_json
from tokenfleet_serving.openai.errors import ApiError
from tokenfleet_serving.router.route_mode import RouteMode
from tokenfleet_serving.router.state import EngineSample, Fleet

HEADER = "x-tokenfleet-route-target"
EASY = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def mode_over_two_targets(tmp_path, **route_fields) -> tuple[RouteMode, Fleet, CollectorRegistry]:
    route = RouteConfig("difficulty", (RouteTarget("small", "s", 16), RouteTarget("large", "l", 16, 1)),
                        **route_fields)
    fleet = Fleet(RouterConfig(models=("chat",), route=route))
    fleet.set_endpoints([Endpoint("small-r", "10.0.0.1", 8080, True, tier="small"),
                         Endpoint("large-r", "10.0.0.2", 8080, True, tier="large")])
    for name in ("small-r", "large-r"):
        fleet.record_poll(name, EngineSample(), None, None)
    registry = CollectorRegistry()
    return RouteMode(route, "chat", {}, tmp_path / "targets.json", registry), fleet, registry


def refused(call) -> ApiError:
    with pytest.raises(ApiError) as e:
        call()
    return e.value


def test_the_override_header_is_refused_unless_the_route_lets_clients_send_it(tmp_path):
    off, _, registry = mode_over_two_targets(tmp_path)
    assert off.checked_override({}) is None                             # no header: the policy decides
    e = refused(lambda: off.checked_override({HEADER: "large"}))
    assert (e.status, e.param) == (403, HEADER) and "spec.override is off" in e.message
    assert registry.get_sample_value("tokenfleet_router_route_override_refusals_total", {"reason": "off"}) == 1
    anyone, _, _ = mode_over_two_targets(tmp_path, override="any")
    assert anyone.checked_override({HEADER: "large"}) == "large"


def test_with_override_keys_only_those_keys_may_override_and_a_rotated_file_is_read_again(tmp_path):
    keys = tmp_path / "override-keys"
    keys.write_text("# who may pick a target\nops-key\n")
    mode, _, registry = mode_over_two_targets(tmp_path, override="keys", override_keys=str(keys))
    assert mode.checked_override({HEADER: "large", "Authorization": "Bearer ops-key"}) == "large"
    for auth in ({}, {"Authorization": "Bearer client-key"}, {"Authorization": "ops-key"}):
        e = refused(lambda auth=auth: mode.checked_override({HEADER: "large", **auth}))
        assert (e.status, e.param) == (403, HEADER) and "overrideKeysSecretName" in e.message
    assert registry.get_sample_value("tokenfleet_router_route_override_refusals_total", {"reason": "key"}) == 3
    keys.write_text("new-ops-key\n")
    mode.reload_targets()                                               # the router's one-second tick
    assert mode.checked_override({HEADER: "large", "Authorization": "Bearer new-ops-key"}) == "large"
    missing, _, _ = mode_over_two_targets(tmp_path, override="keys", override_keys=str(tmp_path / "none"))
    assert refused(lambda: missing.checked_override({HEADER: "large", "Authorization": "Bearer x"})).status == 403


def test_an_override_respects_max_concurrent_requests_and_operator_saturation(tmp_path):
    mode, fleet, registry = mode_over_two_targets(tmp_path, override="any")

    def decide(override):
        return asyncio.run(mode.decide("chat", EASY, override, fleet, None, {}))

    assert decide("large").decision.target == "large"
    fleet.backends["large-r"].inflight = 1                              # large's maxConcurrentRequests
    e = refused(lambda: decide("large"))
    assert (e.status, e.param, e.headers) == (429, HEADER, {"Retry-After": "1"})
    assert "maxConcurrentRequests" in e.message
    assert decide("small").decision.target == "small"
    (tmp_path / "targets.json").write_text('[{"name": "small", "saturated": true}]')
    mode.reload_targets()
    e = refused(lambda: decide("small"))
    assert e.status == 429 and "maxReplicas" in e.message
    assert registry.get_sample_value("tokenfleet_router_route_override_refusals_total",
                                     {"reason": "saturated"}) == 2
    assert refused(lambda: decide("huge")).status == 400


def test_hops_are_counted_and_a_loop_of_routes_ends_with_508(tmp_path):
    mode, _, _ = mode_over_two_targets(tmp_path)
    assert mode.checked_override({HOPS_HEADER: str(MAX_ROUTE_HOPS - 1)}) is None
    e = refused(lambda: mode.checked_override({HOPS_HEADER: str(MAX_ROUTE_HOPS)}))
    assert (e.status, e.param) == (508, HOPS_HEADER) and e.body()["error"]["type"] == "loop_detected"
    for bad in ("-1", "x", "1" * 4, "１"):
        e = refused(lambda bad=bad: mode.checked_override({HOPS_HEADER: bad}))
        assert (e.status, e.param) == (400, HOPS_HEADER)


def test_a_target_gets_no_override_header_and_one_hop_more(tmp_path):
    mode, _, _ = mode_over_two_targets(tmp_path, override="any")
    headers = {"X-Tokenfleet-Route-Target": "large", "x-tokenfleet-route-hops": "2", "Accept": "*/*"}
    mode.forward_headers(headers, {"x-tokenfleet-route-hops": "2"})
    assert headers == {"Accept": "*/*", HOPS_HEADER: "3"}
    headers = {}
    mode.forward_headers(headers, {})
    assert headers == {HOPS_HEADER: "1"}


@pytest.mark.parametrize("header", ["Authorization", "cookie", "Host", "content-length", "Connection",
                                    "x-tokenfleet-route-hops"])
def test_router_json_refuses_a_credential_or_hop_by_hop_override_header(header):
    data = router_config_json(RouterConfig(models=("chat",), route=RouteConfig(targets=(RouteTarget("a"),))))
    data["route"]["overrideHeader"] = header
    with pytest.raises(ConfigError, match=r"route\.overrideHeader"):
        parse_router_config(data)


def test_router_json_override_access_round_trips_and_keys_need_a_file():
    config = RouterConfig(models=("chat",), route=RouteConfig(targets=(RouteTarget("a"),), override="keys",
                                                              override_keys="/keys"))
    assert parse_router_config(router_config_json(config)) == config
    data = router_config_json(config)
    del data["route"]["overrideKeys"]
    with pytest.raises(ConfigError, match=r"route\.overrideKeys"):
        parse_router_config(data)
    data["route"]["override"] = "everyone"
    with pytest.raises(ConfigError, match=r"route\.override\b"):
        parse_router_config(data)
    assert parse_router_config({"route": {"targets": [{"name": "a"}]}}).route.override == "off"
