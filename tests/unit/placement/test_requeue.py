"""Admission timeout and exponential requeue backoff helpers."""
from __future__ import annotations

import pytest

from tokenfleet_operator.gang.placement import RequeueState, admission_timed_out, after_timeout, may_queue, requeue_delay


def test_delay_doubles_from_the_base_and_stops_at_the_cap():
    assert [requeue_delay(n, base=60, cap=3600) for n in range(1, 9)] == [60, 120, 240, 480, 960, 1920, 3600, 3600]
    assert requeue_delay(10_000, base=1, cap=5) == 5


@pytest.mark.parametrize("args, field", [((0,), "attempt"), ((1, 0), "base"), ((1, 10, 5), "cap"), ((True,), "attempt")])
def test_bad_backoff_arguments_name_the_argument(args, field):
    with pytest.raises(ValueError, match=field):
        requeue_delay(*args)


def test_timeout_is_measured_from_the_start_of_the_wait():
    assert not admission_timed_out(100.0, 159.9, 60)
    assert admission_timed_out(100.0, 160.0, 60)
    assert not admission_timed_out(0.0, 1e9, None)
    with pytest.raises(ValueError, match="timeout"):
        admission_timed_out(0.0, 1.0, 0)


def test_each_timeout_counts_and_holds_the_slice_back_longer():
    state = RequeueState()
    assert may_queue(state, 0.0)
    state = after_timeout(state, now=1000.0, base=10, cap=100)
    assert state == RequeueState(1, 1010.0)
    assert not may_queue(state, 1009.0) and may_queue(state, 1010.0)
    state = after_timeout(state, now=2000.0, base=10, cap=100)
    assert state == RequeueState(2, 2020.0)
