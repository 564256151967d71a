"""Route mode's pure parts: the difficulty score, the classifier's grade, the difficulty and cost choices, and
the route section of router.json / targets.json (docs/routing.md, "Model routing")."""
from __future__ import annotations

import pytest

from tokenfleet_serving.contract.route_files import (
    Classifier,
    Difficulty,
    RouteConfig,
    RouteTarget,
    TargetStatus,
    parse_targets,
    targets_json,
)
from tokenfleet_serving.contract.router_files import ConfigError, RouterConfig, parse_router_config, router_config_json
from tokenfleet_serving.router import route_policy as rp
from tokenfleet_serving.router.difficulty import Features, features, grading_prompt, parse_grade, score

D = Difficulty(max_prompt_tokens=100, max_output_tokens=50, max_turns=2, tools=True, response_schema=True)


def chat(*turns: str, **extra) -> dict:
    msgs = []
    for t in turns:
        msgs += [{"role": "user", "content": t}, {"role": "assistant", "content": "ok"}]
    return {"model": "m", "messages": msgs[:-1], **extra}


def test_a_short_plain_request_scores_zero_and_each_rule_adds_one():
    easy = features("chat", chat("hi", max_tokens=20), 10, 20)
    assert score(easy, D).points == 0
    assert score(features("chat", chat("hi", max_tokens=20), 101, 20), D).rules == ("prompt-tokens",)
    assert score(features("chat", chat("hi", max_tokens=51), 10, 51), D).rules == ("max-tokens",)
    assert score(features("chat", chat("a", "b", "c", max_tokens=20), 10, 20), D).rules == ("turns",)
    tools = chat("hi", max_tokens=20, tools=[{"type": "function", "function": {"name": "f"}}])
    assert score(features("chat", tools, 10, 20), D).rules == ("tools",)
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}):
        assert score(features("chat", chat("hi", max_tokens=20, response_format=fmt), 10, 20), D).rules == ("schema",)
    assert score(features("chat", chat("hi", max_tokens=20, response_format={"type": "text"}), 10, 20), D).points == 0
    everything = chat("a", "b", "c", max_tokens=99, tools=[{"type": "function"}], structured_outputs={"json": {}})
    assert score(features("chat", everything, 500, 99), D) == score(
        Features(500, 99, True, 3, True, True), D)
    assert score(features("chat", everything, 500, 99), D).points == 5


def test_thresholds_are_inclusive_and_unset_rules_are_off():
    assert score(Features(100, 50, True, 2), D).points == 0          # at the threshold: easy
    off = Difficulty(None, None, None, False, False)
    assert score(Features(10**6, 10**6, True, 99, True, True), off).points == 0


def test_a_chat_without_max_tokens_is_long_output_but_a_completion_is_not():
    assert score(features("chat", chat("hi"), 5, None), D).rules == ("max-tokens",)
    assert score(features("completion", {"model": "m", "prompt": "x"}, 5, None), D).points == 0
    # max_completion_tokens counts like max_tokens
    assert features("chat", chat("hi", max_completion_tokens=7), 5, None).max_tokens == 7


def test_the_grade_is_the_first_word_or_nothing():
    assert parse_grade(" Hard.") == "hard" and parse_grade("easy, because") == "easy"
    assert parse_grade("") is None and parse_grade("medium") is None and parse_grade("hardly") is None
    prompt = grading_prompt("chat", chat("what is 2+2"))
    assert "what is 2+2" in prompt and prompt.endswith("Grade:")
    assert len(grading_prompt("completion", {"prompt": "x" * 10_000})) < 2200


T = ("small", "mid", "large")


def test_difficulty_picks_by_position_and_spills_larger_first():
    every = set(T)
    assert rp.by_difficulty(T, 0, rp.EASY, "", every, set()).target == "small"
    assert rp.by_difficulty(T, 1, rp.HARD, "", every, set()).target == "mid"
    assert rp.by_difficulty(T, 4, rp.HARD, "", every, set()).target == "large"
    d = rp.by_difficulty(T, 0, rp.EASY, "score 0", every, {"small"})
    assert (d.target, d.reason) == ("mid", rp.SPILL_SATURATED) and "small is saturated" in d.detail
    d = rp.by_difficulty(T, 2, rp.HARD, "", {"small", "mid"}, set())
    assert (d.target, d.reason) == ("mid", rp.SPILL_UNAVAILABLE)          # no larger one: the nearest smaller
    assert rp.by_difficulty(T, 0, rp.EASY, "", every, every).reason == rp.ALL_DEGRADED
    assert rp.by_difficulty(T, 0, rp.EASY, "", set(), set()) is None


def st(name, cost=None, slo=None, sat=False):
    return TargetStatus(name, cost, slo, sat)


def test_cost_takes_the_cheapest_that_meets_its_slo_and_is_not_saturated():
    status = {"small": st("small", 0.2, True), "mid": st("mid", 0.5, True), "large": st("large", 1.0, True)}
    every = set(T)
    assert rp.by_cost(T, status, every, set()) == rp.RouteDecision("small", rp.CHEAPEST, "small at 0.2 $/Mtok")
    d = rp.by_cost(T, status, every, {"small"})
    assert (d.target, d.reason) == ("mid", rp.SPILL_SATURATED) and "small is saturated" in d.detail
    status["small"] = st("small", 0.2, False)
    d = rp.by_cost(T, status, every, set())
    assert (d.target, d.reason) == ("mid", rp.SPILL_SLO) and "small misses its SLO" in d.detail
    # measured cost, not spec order, decides
    status = {"small": st("small", 3.0), "mid": st("mid", 0.5), "large": st("large", 1.0)}
    assert rp.by_cost(T, status, every, set()).target == "mid"
    # an SLO not measured yet is not a miss
    assert rp.by_cost(T, {"small": st("small", 0.1, None)}, every, set()).target == "small"


def test_unknown_cost_is_the_most_expensive_and_says_so():
    status = {"small": st("small"), "mid": st("mid", 9.0), "large": st("large")}
    assert rp.by_cost(T, status, set(T), set()).target == "mid"
    d = rp.by_cost(T, {}, set(T), set())
    assert (d.target, d.reason) == ("small", rp.COST_UNKNOWN) and "unknown" in d.detail
    d = rp.by_cost(T, status, set(T), {"mid"})
    assert d.target == "small" and d.reason == rp.SPILL_SATURATED and "unknown" in d.detail


def test_cost_with_everything_degraded_takes_the_cheapest_and_unavailable_targets_never():
    status = {"small": st("small", 0.2, False), "large": st("large", 1.0, False)}
    d = rp.by_cost(("small", "large"), status, {"small", "large"}, set())
    assert (d.target, d.reason) == ("small", rp.ALL_DEGRADED)
    assert rp.by_cost(("small", "large"), status, {"large"}, set()).target == "large"
    assert rp.by_cost(("small", "large"), status, set(), set()) is None


def test_route_section_and_targets_file_round_trip_and_refuse_unknown_keys():
    config = RouterConfig(models=("chat",), route=RouteConfig(
        "cost", (RouteTarget("small", "s", 16, 4), RouteTarget("large", "l")), D, Classifier("g", 0.25)))
    assert parse_router_config(router_config_json(config)) == config
    data = router_config_json(config)
    data["route"]["policy"] = "cascade"
    with pytest.raises(ConfigError, match=r"route\.policy"):
        parse_router_config(data)
    data = router_config_json(config)
    data["route"]["targets"][0]["weight"] = 1
    with pytest.raises(ConfigError, match=r"route\.targets\[0\]\.weight"):
        parse_router_config(data)
    statuses = (st("a", 1.5, True), st("b", None, None, True))
    assert parse_targets(targets_json(statuses)) == statuses
    with pytest.raises(ConfigError, match=r"\[0\]\.costPerMillionTokens"):
        parse_targets([{"name": "a", "costPerMillionTokens": -1}])


def test_route_mode_glue_override_model_classifier_fallback_and_concurrency_saturation(tmp_path):
    """RouteMode.decide over a fleet of two targets' router pods (no network: the classifier has no pod)."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from tokenfleet_serving.contract.router_files import Endpoint
    from tokenfleet_serving.openai.errors import ApiError
    from tokenfleet_serving.router.route_mode import RouteMode
    from tokenfleet_serving.router.state import EngineSample, Fleet

    route = RouteConfig("difficulty", (RouteTarget("small", "s", 16, 2), RouteTarget("large", "l")), D,
                        Classifier("g", 0.1))
    fleet = Fleet(RouterConfig(models=("chat",), route=route))
    fleet.set_endpoints([Endpoint("small-r", "10.0.0.1", 8080, True, tier="small"),
                         Endpoint("large-r", "10.0.0.2", 8080, True, tier="large")])
    for name in ("small-r", "large-r"):
        fleet.record_poll(name, EngineSample(), None, None)
    registry = CollectorRegistry()
    mode = RouteMode(route, "chat", {}, tmp_path / "targets.json", registry)

    def decide(body, override=None):
        return asyncio.run(mode.decide("chat", body, override, fleet, None, {}))

    easy = chat("hi", max_tokens=4) | {"model": "chat"}
    d = decide(easy)
    assert (d.decision.target, d.decision.reason, d.model) == ("small", rp.EASY, "s")
    assert registry.get_sample_value("tokenfleet_router_route_classifier_fallbacks_total",
                                     {"reason": "unavailable"}) == 1
    assert decide(easy, "large").decision.reason == rp.OVERRIDE
    with pytest.raises(ApiError) as e:
        decide(easy, "huge")
    assert e.value.status == 400
    with pytest.raises(ApiError) as e:
        decide({**easy, "model": "s"})
    assert e.value.status == 404 and e.value.param == "model"
    fleet.backends["small-r"].inflight = 2          # maxConcurrentRequests of small
    d = decide(easy)
    assert (d.decision.target, d.decision.reason) == ("large", rp.SPILL_SATURATED)
    assert registry.get_sample_value("tokenfleet_router_route_decisions_total",
                                     {"target": "large", "reason": rp.SPILL_SATURATED}) == 1
    # targets.json: read, shown as gauges, and a bad one keeps the last good state
    (tmp_path / "targets.json").write_text('[{"name": "small", "costPerMillionTokens": 0.5, "saturated": true}]')
    mode.reload_targets()
    assert registry.get_sample_value("tokenfleet_router_route_target_saturated", {"target": "small"}) == 1
    assert registry.get_sample_value("tokenfleet_router_route_target_cost_per_million_tokens",
                                     {"target": "small"}) == 0.5
    (tmp_path / "targets.json").write_text('[{"name": 1}]')
    mode.reload_targets()
    assert mode.status["small"].saturated
