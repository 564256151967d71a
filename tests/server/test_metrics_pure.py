"""The pure parts of the metrics: rate window, cost per token, request timer, buckets."""
from __future__ import annotations

import math

import pytest

from tokenfleet_serving.server.metrics import (E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, RateWindow, RequestTimer,
                                               cost_per_million_tokens, length_buckets)


def test_rate_window_measures_over_the_window_and_decays_when_idle():
    w = RateWindow(window_s=10, min_spacing_s=0.5)
    assert w.rate() == 0.0
    for t in range(0, 11):
        w.add(float(t), 100.0 * t)           # 100 tokens/s
    assert w.rate() == pytest.approx(100.0)
    for t in range(11, 40):
        w.add(float(t), 1000.0)              # idle from t=10
    assert w.rate() == 0.0


def test_rate_window_coalesces_close_samples():
    w = RateWindow(window_s=60, min_spacing_s=1.0)
    for i in range(100):
        w.add(i * 0.01, i)                   # 100 samples within one second
    assert len(w.samples) == 2
    assert w.rate() == pytest.approx(99 / 0.99)


def test_cost_per_million_tokens():
    # $3.60/h at 1000 tok/s = 3.6M tokens/h -> $1 per million
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)
    assert cost_per_million_tokens(3.6, 0.0) is None
    assert cost_per_million_tokens(3.6, math.inf) is None


def test_request_timer_ttft_tpot_and_gaps():
    t = RequestTimer(arrival=10.0)
    t.on_tokens(0, 10.1)                     # an output with no tokens is not a first token
    t.on_tokens(1, 10.5)
    t.on_tokens(1, 10.7)
    t.on_tokens(2, 11.1)
    assert t.ttft == pytest.approx(0.5)
    assert t.gaps == pytest.approx([0.2, 0.4])
    assert t.tpot == pytest.approx(0.6 / 3)
    single = RequestTimer(arrival=0.0)
    single.on_tokens(1, 1.0)
    assert single.tpot is None and single.ttft == 1.0


def test_buckets_match_vllm_shapes():
    assert (len(TTFT_BUCKETS), len(ITL_BUCKETS), len(E2E_BUCKETS)) == (22, 19, 21)
    assert all(a < b for a, b in zip(TTFT_BUCKETS, TTFT_BUCKETS[1:]))
    assert length_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert length_buckets(4096)[-1] == 2000
