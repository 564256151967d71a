"""Sampling: greedy, truncation filters, seeds, penalties, logprobs, parameter validation."""
from __future__ import annotations

import math

import pytest
import torch

from tokenfleet_serving.engine.request import Request
from tokenfleet_serving.engine.sampler import filter_probs, sample
from tokenfleet_serving.engine.sampling_params import SamplingParams


def req(prompt=(1, 2), **params) -> Request:
    return Request("r", list(prompt), SamplingParams(**params))


LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0]])


def test_greedy_picks_argmax():
    assert sample(LOGITS, [req(temperature=0.0)])[0] == [1]
    assert sample(LOGITS, [req(temperature=5.0, top_k=1)])[0] == [1]


def test_top_k_top_p_min_p_truncate_the_distribution():
    logits = LOGITS[0]
    assert (filter_probs(logits, 2, 1.0, 0.0) > 0).tolist() == [False, True, True, False, False]
    p = torch.softmax(logits, -1)
    # top-p keeps the smallest set whose mass reaches p: the first token alone has p[1] < 0.7 -> two tokens
    assert (filter_probs(logits, 0, 0.7, 0.0) > 0).sum() == 2 and p[1] < 0.7
    assert (filter_probs(logits, 0, 0.01, 0.0) > 0).tolist() == [False, True, False, False, False]
    kept = filter_probs(logits, 0, 1.0, 0.3) > 0          # min-p: keep p >= 0.3 * max
    assert kept.tolist() == (p >= 0.3 * p.max()).tolist()
    assert math.isclose(float(filter_probs(logits, 3, 0.9, 0.05).sum()), 1.0, rel_tol=1e-6)


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.randn(1, 1000)
    draw = lambda seed: [sample(logits, [r])[0][0] for r in [req(seed=seed)] for _ in range(20)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    r = req(seed=0)
    counts = torch.bincount(torch.tensor([sample(logits, [r])[0][0] for _ in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_repetition_presence_frequency_penalties():
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    original = logits.clone()
    r = req(prompt=(0,), temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, [r])[0] == [1]                  # 2.0 / 2 = 1.0 < 1.9
    r = req(prompt=(3,), temperature=0.0)
    r.output_token_ids = [0, 0]
    assert sample(logits, [r])[0] == [0]                  # no penalty configured
    r2 = req(prompt=(3,), temperature=0.0, frequency_penalty=0.1)
    r2.output_token_ids = [0, 0]
    assert sample(logits, [r2])[0] == [1]                 # 2.0 - 0.2 < 1.9
    r3 = req(prompt=(3,), temperature=0.0, presence_penalty=0.2)
    r3.output_token_ids = [0, 0]
    assert sample(logits, [r3])[0] == [1]
    assert torch.equal(logits, original)                 # the caller's logits are untouched


def test_logprobs_report_the_raw_distribution():
    r = req(temperature=0.0, logprobs=2)
    tokens, lps = sample(LOGITS, [r])
    lp = torch.log_softmax(LOGITS[0], -1)
    assert lps[0].token_id == 1 and math.isclose(lps[0].logprob, float(lp[1]), rel_tol=1e-6)
    assert [t for t, _ in lps[0].top] == [1, 2]
    assert sample(LOGITS, [req(temperature=0.0)])[1] == [None]


def test_batch_rows_use_their_own_params():
    logits = torch.tensor([[0.0, 5.0, 0.0], [5.0, 0.0, 0.0]])
    tokens, _ = sample(logits, [req(temperature=0.0), req(temperature=0.0)])
    assert tokens == [1, 0]


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                                         ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0.0),
                                         ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
                                         ("logprobs", 21), ("stop", ("",))])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# ---- numerics: no parameter the bounds accept can make a row unsampleable ----------------------------

@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-10, 1e-5])
def test_tiny_temperatures_sample_the_maximum(temperature):
    """(logits - max) / T stays finite for every T > 0: the limit is the argmax (issue 19: these were NaN)."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    for seed in range(5):
        tokens, _ = sample(logits, [req(temperature=temperature, seed=seed), req(temperature=temperature, seed=seed)])
        assert tokens[0] == 1
        assert 0 <= tokens[1] < 5          # all tied: any of them


def test_tiny_temperature_splits_tied_maxima():
    logits = torch.tensor([[5.0, 1.0, 5.0]])
    drawn = {sample(logits, [req(temperature=1e-300, seed=s)])[0][0] for s in range(40)}
    assert drawn == {0, 2}


@pytest.mark.parametrize("penalty", [0.01, 100.0])
def test_extreme_allowed_repetition_penalties_keep_rows_finite(penalty):
    logits = torch.tensor([[3e38, -3e38, 1.0, 0.0, -1.0]])   # float32 extremes
    for temperature in (0.0, 1.0, 1e-300):
        tokens, _ = sample(logits, [req(prompt=(0, 1, 2), temperature=temperature, repetition_penalty=penalty,
                                        seed=1)])
        assert 0 <= tokens[0] < 5


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1e-300), ("repetition_penalty", 1e-45),
                                         ("repetition_penalty", 0.009), ("repetition_penalty", 1e9),
                                         ("temperature", float("nan")), ("temperature", float("inf")),
                                         ("repetition_penalty", float("nan")), ("top_p", float("nan")),
                                         ("min_p", float("nan")), ("presence_penalty", float("inf")),
                                         ("seed", 2**64), ("seed", -(2**63) - 1)])
def test_values_the_sampler_cannot_compute_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_non_finite_row_fails_only_with_its_request_named():
    from tokenfleet_serving.engine.sampler import SamplingError

    logits = torch.tensor([[1.0, 2.0, 0.0], [1.0, float("nan"), 0.0]])
    bad, good = Request("bad", [1], SamplingParams(seed=1)), Request("good", [1], SamplingParams(seed=1))
    with pytest.raises(SamplingError) as info:
        sample(logits, [good, bad])
    assert info.value.request_id == "bad"
    assert sample(logits[:1], [good])[0][0] in (0, 1, 2)


def test_logprobs_above_the_vocabulary_are_clamped():
    tokens, lps = sample(LOGITS, [req(temperature=0.0, logprobs=20)])
    assert len(lps[0].top) == 5


def test_any_accepted_parameters_give_a_token_in_range():
    """Property: for finite logits across float32's range and any parameters SamplingParams accepts,
    sampling returns a token of the vocabulary and never raises."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
    tiny_or_normal = st.one_of(st.just(0.0), st.floats(5e-324, 2.0), st.sampled_from([5e-324, 1e-300, 1e-45]))

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(row=st.lists(finite32, min_size=2, max_size=12), temperature=tiny_or_normal,
           top_k=st.integers(-1, 20), top_p=st.floats(1e-300, 1.0, exclude_min=False),
           min_p=st.floats(0.0, 1.0), rep=st.floats(0.01, 100.0), presence=st.floats(-2.0, 2.0),
           frequency=st.floats(-2.0, 2.0), seed=st.integers(0, 2**32), history=st.lists(st.integers(0, 11), max_size=6))
    def check(row, temperature, top_k, top_p, min_p, rep, presence, frequency, seed, history):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency,
                                seed=seed, logprobs=3)
        r = Request("r", [h % len(row) for h in history] or [0], params)
        r.output_token_ids = [h % len(row) for h in history]
        tokens, lps = sample(torch.tensor([row]), [r])
        assert 0 <= tokens[0] < len(row)
        assert lps[0] is not None and lps[0].token_id == tokens[0]

    check()
