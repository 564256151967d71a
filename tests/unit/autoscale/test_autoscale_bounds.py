"""The autoscaler's count is always within [minReplicas, maxReplicas], whatever the targets and the readings
(issue 37, defect 2: a target of 5e-324 with one request in flight overflowed the float-to-int conversion, and
the service's status stopped updating)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tokenfleet_operator.api.inference_service import AutoscalingSpec
from tokenfleet_operator.autoscale.policy import History, Signals, Targets, Why, recommend

EXTREME = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-308, 1e-9, 1.0, 1e308, math.inf, -math.inf, math.nan]),
)
TARGET = st.one_of(st.floats(min_value=5e-324, max_value=1e308), st.sampled_from([5e-324, 1e-300, 0.01, 1e300]))
COUNT = st.integers(min_value=0, max_value=10_000)


@st.composite
def targets(draw) -> Targets:
    low = draw(st.integers(min_value=0, max_value=50))
    return Targets(
        min_replicas=low, max_replicas=draw(st.integers(min_value=max(low, 1), max_value=200)),
        requests_per_replica=draw(TARGET), kv_cache_usage=draw(TARGET), slo_attainment=draw(st.floats(0, 1)),
        scale_up_stabilization_s=draw(st.sampled_from([0.0, 30.0])),
        scale_down_stabilization_s=draw(st.sampled_from([0.0, 120.0])),
        max_scale_up=draw(st.integers(1, 1000)), max_scale_down=draw(st.integers(1, 1000)),
        scale_to_zero_after_s=draw(st.sampled_from([1.0, 300.0])),
        waiting_per_replica=draw(st.one_of(st.just(0.0), TARGET)),
        slo_ttft_s=draw(st.one_of(st.just(0.0), EXTREME)),
    )


@st.composite
def signals(draw) -> Signals | None:
    if draw(st.integers(0, 9)) == 0:
        return None
    optional = st.one_of(st.none(), EXTREME)
    return Signals(
        ready_replicas=draw(COUNT), requests=draw(EXTREME), kv_cache_usage=draw(optional),
        slo_attainment=draw(optional), pending=draw(COUNT), idle_s=draw(EXTREME), waiting=draw(EXTREME),
        running=draw(EXTREME), requests_now=draw(optional), waiting_now=draw(optional),
        requests_trend=draw(EXTREME), lookahead_s=draw(EXTREME), ttft_at_slo=draw(optional),
    )


@settings(max_examples=2000, deadline=None)
@given(targets(), COUNT, st.lists(signals(), min_size=1, max_size=4), st.one_of(st.none(), COUNT))
def test_recommend_stays_within_bounds_over_extreme_floats(t, current, readings, starting):
    history = History()
    for step, s in enumerate(readings):
        r = recommend(t, current, s, history, now=30.0 * step, starting=starting)
        assert isinstance(r.replicas, int) and t.min_replicas <= r.replicas <= t.max_replicas, (r, current, s)
        current = r.replicas


@pytest.mark.parametrize("field", ["requests_per_replica", "waiting_per_replica", "kv_cache_usage"])
def test_a_subnormal_target_with_one_request_asks_for_max_replicas(field):
    t = Targets(min_replicas=1, max_replicas=3, **{field: 5e-324})
    one = Signals(ready_replicas=1, requests=1, kv_cache_usage=0.5, slo_attainment=None, waiting=1, running=0)
    r = recommend(t, 1, one, History(), now=0)
    assert (r.replicas, r.limited) == (3, True) and r.reason != Why.NO_SIGNALS


@pytest.mark.parametrize("field", ["targetRequestsPerReplica", "targetKvCacheUsage", "targetWaitingPerReplica"])
@pytest.mark.parametrize("value", [5e-324, 1e-9, 0.0099, 0, -1])
def test_the_schema_refuses_targets_the_arithmetic_cannot_take(field, value):
    with pytest.raises(ValidationError) as refused:
        AutoscalingSpec.model_validate({field: value})
    assert refused.value.errors()[0]["loc"] == (field,)
    AutoscalingSpec.model_validate({field: 0.01})
