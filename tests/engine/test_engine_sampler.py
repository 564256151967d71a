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
