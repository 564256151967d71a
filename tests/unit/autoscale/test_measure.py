"""Goodput, windowed cost, capacity and the autoscaler's signals, from a history of router readings."""
from __future__ import annotations

import pytest

from tokenfleet_operator.autoscale.measure import (
    MIN_TOKENS,
    Entry,
    PriceHistory,
    ReadingHistory,
    capacity_candidate,
    cold_start_seconds,
    combine,
    goodput,
    signals,
    trend,
    window,
    windowed_cost,
)
from tokenfleet_serving.contract.router_metrics import Histogram, RouterReading

BUCKETS = (0.1, 0.2, 0.5, 1.0, float("inf"))


def hist(values):
    h = Histogram({le: float(sum(v <= le for v in values)) for le in BUCKETS}, float(len(values)), float(sum(values)))
    return h


def reading(met=0, missed=0, tokens=0, ttfts=(), load=None, kv=None, pending=0, idle=0.0, inflight=None,
            draining=None, cold=()):
    return RouterReading(backend_load=load or {}, backend_kv=kv or {}, backend_inflight=inflight or {},
                         backend_draining=draining or {}, pending=pending, idle_s=idle, output_tokens=tokens,
                         slo_requests={"met": met, "missed": missed}, slo_tokens={"met": tokens, "missed": 0},
                         ttft=hist(ttfts), tpot=hist([]), cold_start=hist(cold))


def history(*entries):
    """(seconds, reading[, ready replicas]) entries."""
    h = ReadingHistory()
    for at, r, *ready in entries:
        h.add(Entry(at, 1_700_000_000 + at, r, ready[0] if ready else 1))
    return h


def test_goodput_over_the_window_with_the_latency_at_the_percentile():
    h = history((0, reading(), 2), (300, reading(met=18, missed=2, tokens=2000, ttfts=[0.05] * 18 + [0.9, 0.9]), 2))
    g = goodput(h, 95.0)
    assert g["requests"] == 20 and g["requestRatio"] == 0.9 and g["met"] is False
    assert g["timeToFirstTokenSeconds"] == pytest.approx(0.75, abs=0.01)      # p95 falls in the (0.5, 1.0] bucket
    assert goodput(h, 90.0)["met"] is True


def test_cost_needs_enough_tokens_and_prices_the_window():
    few = history((0, reading()), (300, reading(tokens=MIN_TOKENS - 1)))
    assert "costPerMillionTokens" not in windowed_cost(few, 10.0)
    enough = history((0, reading()), (300, reading(tokens=6000)))
    c = windowed_cost(enough, 10.0)
    assert c["tokensPerHour"] == 72000.0 and c["costPerMillionTokens"] == round(10.0 / 72000 * 1e6, 4)


def test_a_router_restart_counts_from_zero_again():
    h = history((0, reading(met=100, tokens=50000)), (300, reading(met=5, tokens=3000)))
    w = window(h, 300)
    assert w.requests == 5 and w.output_tokens == 3000


def test_capacity_is_a_minute_that_met_the_slo_per_ready_replica():
    h = history((0, reading(), 2), (60, reading(met=100, tokens=6000), 2))
    c = capacity_candidate(h, 95.0, price_per_replica_hour=3.6)
    assert c["tokensPerHourPerReplica"] == 180000.0 and c["costPerMillionTokens"] == 20.0
    missed = history((0, reading(), 2), (60, reading(met=50, missed=50, tokens=6000), 2))
    assert capacity_candidate(missed, 95.0, 3.6) is None


def test_signals_from_the_ready_replicas_and_the_last_minute():
    h = history((0, reading(), 2),
                (60, reading(met=9, missed=1, load={"a-0": 5, "b-0": 3, "gone-0": 50}, kv={"a-0": 0.5, "b-0": 0.3},
                             pending=2, idle=4.0), 2))
    s = signals(h, {"a-0", "b-0"}, serving_s=600.0)
    assert (s.ready_replicas, s.requests, s.kv_cache_usage, s.slo_attainment, s.pending, s.idle_s) == \
        (2, 10, pytest.approx(0.4), 0.9, 2, 4.0)
    assert signals(None, set()) is None


def test_waiting_and_running_are_separate_signals_from_the_routers_gauges():
    text = "\n".join([
        '# TYPE tokenfleet_router_backend_load gauge', 'tokenfleet_router_backend_load{backend="a-0"} 7',
        'tokenfleet_router_backend_load{backend="b-0"} 2',
        '# TYPE tokenfleet_router_backend_requests_waiting gauge',
        'tokenfleet_router_backend_requests_waiting{backend="a-0"} 3',
        'tokenfleet_router_backend_requests_waiting{backend="b-0"} 0',
        '# TYPE tokenfleet_router_backend_requests_running gauge',
        'tokenfleet_router_backend_requests_running{backend="a-0"} 4',
        'tokenfleet_router_backend_requests_running{backend="b-0"} 2',
        '# TYPE tokenfleet_router_pending_requests gauge', 'tokenfleet_router_pending_requests 1', ""])
    r = RouterReading.from_text(text)
    assert r.backend_waiting == {"a-0": 3, "b-0": 0} and r.backend_running == {"a-0": 4, "b-0": 2}
    both = combine([r, RouterReading.from_text(text)])          # two routers poll the same replicas
    assert both.backend_waiting == r.backend_waiting and both.pending == 2
    s = signals(history((0, both, 2)), {"a-0", "b-0"})
    assert (s.requests, s.waiting, s.running) == (11, 5, 6)       # the held requests queue too


def test_combining_routers_adds_what_they_count_and_keeps_the_replicas_load():
    a = reading(met=1, tokens=10, load={"p": 3}, inflight={"p": 1}, pending=1, idle=5.0)
    b = reading(met=2, tokens=20, load={"p": 3}, inflight={"p": 2}, pending=0, idle=1.0)
    c = combine([a, b])
    assert c.slo_requests["met"] == 3 and c.output_tokens == 30 and c.backend_load == {"p": 3}
    assert c.backend_inflight == {"p": 3} and c.pending == 1 and c.idle_s == 1.0


def test_cold_start_and_price_history():
    h = history((0, reading()), (100, reading(cold=[2.0, 4.0])))
    assert cold_start_seconds(h) == 3.0
    prices = PriceHistory()
    prices.add(0, 10.0)
    prices.add(150, 20.0)
    assert prices.mean(300, 300) == pytest.approx(15.0)


def test_load_signals_are_the_mean_over_the_window_and_the_latest_readings_are_kept_beside_it():
    h = history(*[(t, reading(load={"a-0": n, "b-0": 0}, kv={"a-0": k, "b-0": k}), 2)
                  for t, n, k in ((0, 40, 0.9), (10, 2, 0.2), (20, 4, 0.4), (30, 6, 0.6))])
    s = signals(h, {"a-0", "b-0"}, window_s=20)
    assert s.requests == pytest.approx(4.0) and s.requests_now == 5          # the reading at 0 s is outside;
    # the panic window (2 s) holds one reading, so it takes the last two
    assert s.kv_cache_usage == pytest.approx(0.4)
    latest_only = signals(h, {"a-0", "b-0"})
    assert latest_only.requests == latest_only.requests_now == 6 and latest_only.kv_cache_usage == pytest.approx(0.6)


def test_the_panic_signal_is_the_mean_over_the_last_tenth_of_the_window():
    h = history(*[(t, reading(load={"a-0": n}), 1) for t, n in ((0, 2), (26, 2), (28, 20), (30, 4))])
    s = signals(h, {"a-0"}, window_s=30)                      # panic window 3 s: the readings at 28 and 30 s
    assert s.requests == pytest.approx(7.0) and s.requests_now == pytest.approx(12.0)
    # 1 s holds the latest reading alone: one reading is a blip, so the panic signal takes the last two
    assert signals(h, {"a-0"}, window_s=10).requests_now == pytest.approx(12.0)
    assert signals(h, {"a-0"}, window_s=0).requests_now == 4  # 0: the latest reading, for both signals


def test_slo_attainment_counts_only_since_the_ready_replicas_last_changed():
    # 1 replica missed the SLO; the second became ready at 20 s, and since then every request met it
    h = history((0, reading(met=0, missed=0), 1), (10, reading(met=5, missed=5), 1),
                (20, reading(met=5, missed=8), 2), (30, reading(met=15, missed=8), 2))
    two, three = {"a-0", "b-0"}, {"a-0", "b-0", "c-0"}
    assert signals(h, two, window_s=30).slo_attainment == 1.0        # 10 met of 10, from 20 s on
    assert signals(h, two, window_s=0).slo_attainment == 1.0         # the window is at least 10 s
    # from the moment the count changes until it is 10 s old, there is too little to judge the new fleet by
    h.add(Entry(32, 1_700_000_032, reading(met=15, missed=9), 3))
    assert signals(h, three, window_s=30).slo_attainment is None
    h.add(Entry(40, 1_700_000_040, reading(met=16, missed=9), 3))
    assert signals(h, three, window_s=30).slo_attainment is None
    h.add(Entry(42, 1_700_000_042, reading(met=19, missed=9), 3))
    assert signals(h, three, window_s=30).slo_attainment == 1.0         # 4 met of 4 since 32 s


def test_a_fleet_that_changed_after_the_latest_reading_is_not_judged_by_the_readings_of_the_one_before():
    # 1 replica missed the SLO for 30 s; 2 more turned Ready after the latest reading (a pod's Ready event comes
    # before the collector's next read): those misses are not the 3 replicas', and "one more than the ready
    # replicas" would add a fourth to a fleet that has not served yet
    h = history((0, reading(met=0, missed=0, ttfts=[]), 1), (10, reading(met=5, missed=5), 1),
                (20, reading(met=8, missed=10), 1), (30, reading(met=10, missed=16, ttfts=[0.9] * 26), 1))
    one, three = {"a-0"}, {"a-0", "b-0", "c-0"}
    assert signals(h, one, window_s=10, percentile=0.95).slo_attainment == pytest.approx(2 / 8)
    s = signals(h, three, window_s=10, percentile=0.95)
    assert s.slo_attainment is None and s.ttft_at_slo is None


def test_the_trend_is_the_least_squares_slope_where_it_stands_out_of_the_noise():
    assert trend([(0, 1.0), (2, 2.0), (4, 3.0)]) == pytest.approx(0.5)
    assert trend([(0, 3.0), (2, 2.0), (4, 1.0)]) == pytest.approx(-0.5)
    assert trend([(0, 1.0), (2, 9.0)]) == 0.0                  # two points are no trend
    assert trend([(5, 1.0), (5, 2.0), (5, 3.0)]) == 0.0        # nor is one moment
    wobble = [(0, 5.0), (2, 9.0), (4, 4.0), (6, 8.0), (8, 5.0), (10, 9.0)]
    assert trend(wobble) > 0 and trend(wobble, significance=2.0) == 0.0
    rise = [(t, 1.0 + 0.5 * t + (0.2 if t % 4 else -0.2)) for t in range(0, 12, 2)]
    assert trend(rise, significance=2.0) == pytest.approx(0.5, abs=0.05)


def rising(load, seconds, step=2):
    """Readings every ``step`` s of one ready replica with ``load(t)`` requests in flight."""
    h = ReadingHistory()
    for t in range(0, seconds + 1, step):
        h.add(Entry(t, 1_700_000_000 + t, reading(load={"a-0": load(t)}), 1))
    return h


def test_a_rise_is_looked_ahead_over_a_replica_startup():
    h = rising(lambda t: 1 + t / 4, 40)                       # 0.25 more requests in flight each second
    s = signals(h, {"a-0"}, window_s=10, startup_s=8)
    assert s.requests_trend == pytest.approx(0.25)
    assert s.lookahead_s == 8 + 5                       # the startup, plus the half window the mean lags by
    # never further than the trend window (20 s) reaches back, plus that half window
    assert signals(h, {"a-0"}, window_s=10, startup_s=90).lookahead_s == 25
    # no startup measured yet, or no window: no look ahead
    assert signals(h, {"a-0"}, window_s=10).requests_trend == 0.0
    assert signals(h, {"a-0"}, window_s=0, startup_s=8).requests_trend == 0.0
    # a history shorter than most of the trend window says nothing about a trend yet
    assert signals(rising(lambda t: 1 + t / 4, 12), {"a-0"}, window_s=10, startup_s=8).requests_trend == 0.0
    # only the ready replicas' load counts, as for the mean
    assert signals(h, {"b-0"}, window_s=10, startup_s=8).requests_trend == 0.0
    # a pod that turned Ready after the latest reading carries no load yet, and the rise starts over: the queue
    # the fleet built without it is about to drain
    s = signals(h, {"a-0", "c-0"}, window_s=10, startup_s=8)
    assert s.ready_replicas == 1 and s.requests_trend == 0.0


def test_a_falling_or_wobbling_load_has_no_rise():
    s = signals(rising(lambda t: 11 - t / 4, 40), {"a-0"}, window_s=10, startup_s=8)
    assert (s.requests_trend, s.lookahead_s) == (0.0, 0.0)
    # Poisson-like readings around 3 whose least-squares slope is positive but well inside its noise
    wobbly = rising(lambda t: {20: 1, 22: 5, 24: 2, 26: 6, 28: 1, 30: 4, 32: 2, 34: 5, 36: 3, 38: 4, 40: 3}.get(t, 3), 40)
    assert signals(wobbly, {"a-0"}, window_s=10, startup_s=8).requests_trend == 0.0


def test_the_zeros_assumed_at_a_routers_start_are_no_reading_of_the_load():
    h = ReadingHistory()
    h.add(Entry(-30, 1_700_000_000 - 30, RouterReading(), 0, baseline=True))
    for t in range(0, 42, 2):
        h.add(Entry(t, 1_700_000_000 + t, reading(load={"a-0": 6.0}), 1))
    s = signals(h, {"a-0"}, window_s=40, startup_s=8)
    assert s.requests == pytest.approx(6.0) and s.requests_trend == 0.0


def test_the_rise_is_taken_since_the_ready_replicas_last_changed():
    # a queue that climbed on 1 replica until 30 s, then 2 replicas serving a flat 4: no rise
    h = ReadingHistory()
    for t in range(0, 52, 2):
        h.add(Entry(t, 1_700_000_000 + t, reading(load={"a-0": 1 + t / 5 if t < 30 else 4.0}), 1 if t < 30 else 2))
    assert signals(h, {"a-0"}, window_s=20, startup_s=8).requests_trend == 0.0
    # fewer than six readings since the change are too few for a trend, however steep
    h = ReadingHistory()
    for t in range(0, 42, 2):
        h.add(Entry(t, 1_700_000_000 + t, reading(load={"a-0": t / 2}), 1 if t < 34 else 2))
    assert signals(h, {"a-0"}, window_s=20, startup_s=8).requests_trend == 0.0
    h.add(Entry(42, 1_700_000_042, reading(load={"a-0": 21.0}), 2))
    h.add(Entry(44, 1_700_000_044, reading(load={"a-0": 22.0}), 2))
    assert signals(h, {"a-0", "b-0"}, window_s=20, startup_s=8).requests_trend == pytest.approx(0.5)


def test_idle_counts_from_when_the_first_replica_became_ready():
    # the router was idle 100 s, but the replica has been ready for 10 s only: 10 s without a request while
    # the service could serve
    h = history((0, reading(idle=90), 0), (10, reading(load={"a": 0}, idle=100), 1))
    assert signals(h, {"a"}, serving_s=10.0).idle_s == 10
    # never able to serve (no replica was ever Ready): not idle, however long the router was
    assert signals(h, set()).idle_s == 0
    # a replica ready for longer than the router was idle, and a request that reset the router's idle time
    assert signals(h, {"a"}, serving_s=500.0).idle_s == 100
    h = history((0, reading(load={"a": 0}, idle=3), 1))
    assert signals(h, {"a"}, serving_s=50.0).idle_s == 3


def test_the_ttft_at_the_slos_percentile_over_the_attainment_window():
    h = history((0, reading(load={"a": 0}), 1), (20, reading(met=20, ttfts=[0.05] * 18 + [0.9, 0.9], load={"a": 0}), 1))
    s = signals(h, {"a"}, window_s=10, percentile=0.95)
    assert s.ttft_at_slo == pytest.approx(0.75, abs=0.01)          # p95 falls in the (0.5, 1.0] bucket
    assert signals(h, {"a"}, window_s=10).ttft_at_slo is None       # no percentile: not measured
    assert signals(history((0, reading(load={"a": 0}), 1), (20, reading(load={"a": 0}), 1)), {"a"},
                   percentile=0.95).ttft_at_slo is None            # no request in the window
