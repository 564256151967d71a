"""``tokenfleet bench routing``'s pure parts: the mixed trace keeps its promises (half of the output tokens easy,
every label what its definition says), the route's rules score it as the benchmark says, and the figures of a
pass (cost, SLO attainment, precision and recall of "hard", lost requests) add up."""
from __future__ import annotations

import pytest

from tokenfleet_dev.bench import routing_trace as rt
from tokenfleet_serving.contract.route_files import Difficulty
from tokenfleet_serving.router.difficulty import features, score


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """The trace as the benchmark makes it, counted with the reference family's tokenizer and chat template
    (the tokenizer files of ``create_random_checkpoint``, without weights)."""
    import json

    from tokenfleet_dev.bench.fleet import Settings
    from tokenfleet_serving.engine.tokenizer import load_tokenizer
    from tokenfleet_serving.router.prompt import prompt_info
    from tokenfleet_serving.testing_models import CHAT_TEMPLATE, build_tokenizer

    d = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(Settings().vocab).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE}))
    tokenizer = load_tokenizer(str(d))
    return rt.make_trace(lambda body: prompt_info("chat", body, tokenizer).num_tokens)


def test_half_the_output_tokens_are_easy_and_the_labels_hold(trace):
    assert abs(rt.output_token_share(trace, "easy") - 0.5) < 0.01
    assert {r.category for r in trace if r.label == "hard"} == set(rt.HARD_CATEGORIES)
    for r in trace:
        assert r.body["ignore_eos"] is True and r.body["max_tokens"] == r.max_tokens
        if r.label == "easy":
            assert r.prompt_tokens <= rt.EASY_MAX_PROMPT and r.prompt_tokens + r.max_tokens <= rt.SMALL_CONTEXT
        elif r.category in ("long-context", "long-output"):
            assert r.prompt_tokens + r.max_tokens > rt.SMALL_CONTEXT      # the small model cannot serve it
    assert rt.make_trace(lambda b: 10, seed=3, hard_per_category=0) == []


def test_the_routes_rules_find_every_hard_request_and_call_only_verbose_easy_ones_hard(trace):
    d = rt.DIFFICULTY
    rules = Difficulty(d["maxPromptTokens"], d["maxOutputTokens"], d["maxTurns"], d["tools"], d["responseSchema"])
    for r in trace:
        points = score(features("chat", r.body, r.prompt_tokens, r.max_tokens), rules).points
        assert (points > 0) == (r.label == "hard" or r.category == "verbose"), r.category


def rec(i, label, target, ok=True, tokens=10, ttft=0.1, tpot=0.01):
    return rt.Record(i, label, label, 200 if ok else 503, ok, target, None, ttft, tpot, tokens if ok else 0)


def test_a_passes_figures():
    cost = {"small": 1.0, "large": 3.0}
    records = [rec(0, "easy", "small"), rec(1, "easy", "large"), rec(2, "hard", "large", tokens=20),
               rec(3, "hard", "small", ok=False), rec(4, "easy", "small", ttft=5.0)]
    assert rt.dollars_per_mtok(records, cost) == pytest.approx((10 + 30 + 60 + 10) / 50)
    slo = rt.SloSpec(1.0, 0.05)
    assert rt.slo_attainment(records, slo) == pytest.approx(3 / 5)      # the lost one and the slow one miss
    precision, recall = rt.hard_precision_recall(records, "large")
    assert (precision, recall) == (0.5, 0.5)
    assert rt.lost(records) == 1
    s = rt.summary(records, slo, cost)
    assert s["requests_lost"] == 1 and s["by_target"] == {"small": 3, "large": 2} and s["output_tokens"] == 50
    assert rt.dollars_per_mtok([rec(0, "easy", "small", ok=False)], cost) is None
    assert rt.percentile([3, 1, 2], 50) == 2 and rt.percentile([], 95) is None
