"""The autoscaler's decisions, step by step, on a fake clock."""
from __future__ import annotations

from tokenfleet_operator.autoscale.policy import History, Signals, Targets, Why, recommend

T = Targets(min_replicas=1, max_replicas=4, requests_per_replica=8, kv_cache_usage=0.8, slo_attainment=0.95,
            scale_up_stabilization_s=0, scale_down_stabilization_s=60, max_scale_up=4, max_scale_down=1,
            scale_to_zero_after_s=120)


def sig(ready, requests, kv=0.1, slo=None, pending=0, idle=0.0):
    return Signals(ready, requests, kv, slo, pending, idle)


def test_load_above_target_scales_up_at_once_by_the_requests_needed():
    r = recommend(T, 1, sig(1, 30), History(), now=0)
    assert (r.replicas, r.reason) == (4, Why.REQUESTS)            # ceil(30 / 8)


def test_a_queue_target_scales_on_waiting_requests_alone():
    queued = Signals(2, 10, 0.1, None, 0, 0.0, waiting=9, running=1)        # few running, many waiting
    assert recommend(T, 2, queued, History(), 0).replicas == 2       # no queue target: ceil(10 / 8) in flight
    t = Targets(**{**T.__dict__, "waiting_per_replica": 2})
    r = recommend(t, 2, queued, History(), 0)
    assert (r.replicas, r.reason) == (4, Why.WAITING) and "9 requests waiting" in r.message   # ceil(9 / 2) = 5 > max 4
    assert r.limited
    calm = Signals(2, 10, 0.1, None, 0, 0.0, waiting=0, running=10)
    assert recommend(t, 2, calm, History(), 0).reason != Why.WAITING


def test_the_biggest_need_wins_and_each_signal_can_be_it():
    assert recommend(T, 2, sig(2, 4, kv=0.95), History(), 0).reason == Why.KV_CACHE      # ceil(2 * .95 / .8) = 3
    r = recommend(T, 2, sig(2, 4, kv=0.1, slo=0.80), History(), 0)
    assert (r.replicas, r.reason) == (3, Why.SLO)                 # attainment below target: one more


def test_low_attainment_adds_one_replica_at_a_time_as_they_become_ready():
    h = History()
    assert recommend(T, 1, sig(1, 2, slo=0.3), h, now=0).replicas == 2
    for now in (1, 2, 3, 4):                                      # the minute's attainment stays low while the
        assert recommend(T, 2, sig(1, 2, slo=0.3), h, now).replicas == 2   # second replica starts: no runaway
    assert recommend(T, 2, sig(2, 2, slo=0.3), h, now=60).replicas == 3    # it is ready and did not suffice


def test_a_step_adds_at_most_max_scale_up():
    t = Targets(**{**T.__dict__, "max_replicas": 20, "max_scale_up": 2})
    assert recommend(t, 1, sig(1, 100), History(), 0).replicas == 3


def test_scale_down_waits_for_the_whole_window_and_removes_one_at_a_time():
    h = History()
    assert recommend(T, 4, sig(4, 30), h, now=0).replicas == 4
    for now in (10, 30, 50):                                      # load gone, but the window is not covered
        r = recommend(T, 4, sig(4, 2), h, now)
        assert (r.replicas, r.reason) == (4, Why.STABILIZING)
    assert recommend(T, 4, sig(4, 2), h, now=55).replicas == 4    # the burst at 0 s is still in the 60 s window
    r = recommend(T, 4, sig(4, 2), h, now=65)                     # the last 60 s all asked for 1
    assert (r.replicas, r.reason) == (3, Why.REQUESTS)            # one replica per step
    assert recommend(T, 3, sig(3, 2), h, now=80).replicas == 2
    assert recommend(T, 2, sig(2, 2), h, now=95).replicas == 1


def test_a_dip_inside_the_window_removes_nothing():
    h = History()
    for now in range(0, 200, 10):
        load = 30 if now % 40 == 0 else 2                         # bursts every 40 s
        assert recommend(T, 4, sig(4, load), h, now).replicas == 4


def test_limited_at_max_says_so_without_exceeding_it():
    r = recommend(T, 4, sig(4, 4, slo=0.5), History(), 0)
    assert r.replicas == 4 and r.limited and "maxReplicas is 4" in r.message
    r = recommend(T, 4, sig(4, 200), History(), 0)
    assert r.replicas == 4 and r.limited


def test_zero_and_back():
    t = Targets(**{**T.__dict__, "min_replicas": 0})
    h = History()
    assert recommend(t, 1, sig(1, 0, idle=30), h, 0).replicas == 1          # idle, but not long enough
    r = recommend(t, 1, sig(1, 0, idle=130), h, 70)
    assert (r.replicas, r.reason) == (0, Why.SCALE_TO_ZERO)
    assert recommend(t, 0, sig(0, 0), h, 80).replicas == 0                   # nobody waits
    r = recommend(t, 0, sig(0, 1, pending=1), h, 90)
    assert (r.replicas, r.reason) == (1, Why.SCALE_FROM_ZERO)               # a held request brings one back


def test_a_service_whose_replicas_are_all_starting_is_not_idle():
    t = Targets(**{**T.__dict__, "min_replicas": 0})
    # the router has had no request for 200 s, but the one replica asked for is still starting
    h = History()
    recommend(t, 1, sig(0, 0, idle=200), h, 0, starting=1)
    assert recommend(t, 1, sig(0, 0, idle=270), h, 70, starting=1).replicas == 1
    assert recommend(t, 1, sig(0, 0, idle=200), History(), 0).replicas == 1        # by default: not ready = starting
    # a replica stuck for long no longer counts as starting: an idle service goes to zero
    h = History()
    recommend(t, 1, sig(0, 0, idle=200), h, 0, starting=0)
    r = recommend(t, 1, sig(0, 0, idle=270), h, 70, starting=0)
    assert (r.replicas, r.reason) == (0, Why.SCALE_TO_ZERO)
    # one replica serves and another starts: idle is idle
    h = History()
    recommend(t, 2, sig(1, 0, idle=200), h, 0, starting=1)
    assert recommend(t, 2, sig(1, 0, idle=200), h, 70, starting=1).reason == Why.SCALE_TO_ZERO


def test_min_replicas_is_a_floor_and_no_signal_changes_nothing():
    t = Targets(**{**T.__dict__, "min_replicas": 2})
    assert recommend(t, 1, sig(1, 0), History(), 0).replicas == 2
    assert recommend(t, 3, None, History(), 0).reason == Why.NO_SIGNALS


def test_one_busy_reading_neither_adds_a_replica_nor_keeps_one_but_a_surge_is_acted_on_at_once():
    # the mean of the window asks for 2; the latest readings for 4 (30 requests), less than twice the 16 that
    # the 2 replicas are sized for: the mean decides
    assert recommend(T, 2, Signals(2, 12.0, 0.1, None, requests_now=20.0), History(), 0).replicas == 2
    assert recommend(T, 2, Signals(2, 12.0, 0.1, None, requests_now=30.0), History(), 0).replicas == 2
    # 32 = 2 x 2 replicas x 8: a surge, acted on without waiting for the mean
    r = recommend(T, 2, Signals(2, 12.0, 0.1, None, requests_now=32.0), History(), 0)
    assert (r.replicas, r.reason) == (4, Why.REQUESTS) and "now" in r.message
    # scale-down follows the mean too: with the mean at 1 replica's worth, one busy reading does not hold 3
    h, t = History(), Targets(**{**T.__dict__, "scale_down_stabilization_s": 10})
    for now in range(0, 12, 2):
        r = recommend(t, 3, Signals(3, 6.0, 0.1, None, requests_now=20.0 if now == 4 else 6.0), h, now)
    assert r.replicas == 2


def test_a_load_within_the_tolerance_of_the_ready_replicas_keeps_them():
    # 2 ready replicas are sized for 16 requests: 17 is within 10 % and keeps 2, where ceil(17 / 8) would add one
    assert recommend(T, 2, sig(2, 17.0), History(), 0).replicas == 2
    assert recommend(T, 2, sig(2, 17.7), History(), 0).replicas == 3            # 10.6 % over: one more
    # and 10 ready at 72 requests (10 % under their 80) are not cut to ceil(72 / 8) = 9
    t = Targets(**{**T.__dict__, "max_replicas": 12, "scale_down_stabilization_s": 0})
    assert recommend(t, 10, sig(10, 72.0), History(), 0).replicas == 10
    assert recommend(t, 10, sig(10, 71.0), History(), 0).replicas == 9


def test_the_queue_of_a_scale_up_under_way_is_no_surge_of_its_own():
    # 1 replica ready and a second starting (2 asked for): 24 in flight on the ready one is what the 2 will share,
    # short of twice their 16; the mean (12) would need 2 anyway
    t = Targets(**{**T.__dict__, "max_replicas": 8})
    assert recommend(t, 2, Signals(1, 12.0, 0.1, None, requests_now=24.0), History(), 0).replicas == 2
    # with only the ready one asked for, the same reading is twice its 8: a surge
    assert recommend(t, 1, Signals(1, 12.0, 0.1, None, requests_now=24.0), History(), 0).replicas == 3
    # and twice what the 2 are sized for is a surge even while the second starts
    assert recommend(t, 2, Signals(1, 12.0, 0.1, None, requests_now=40.0), History(), 0).replicas == 5


def test_while_replicas_start_the_mean_asks_for_no_more_than_those():
    t = Targets(**{**T.__dict__, "max_replicas": 8})
    # the ready replica's mean of 20 would need 3; the 2 asked for have not all had their chance
    r = recommend(t, 2, Signals(1, 20.0, 0.1, None, requests_now=20.0), History(), 0)
    assert (r.replicas, r.reason) == (2, Why.REQUESTS) and "waiting for 1 starting" in r.message
    # once both are ready, the same mean adds the third
    assert recommend(t, 2, Signals(2, 20.0, 0.1, None, requests_now=20.0), History(), 0).replicas == 3
    # a surge is acted on while replicas start, however high the mean: 36 now >= 2 x 2 x 8
    r = recommend(t, 2, Signals(1, 40.0, 0.1, None, requests_now=36.0), History(), 0)
    assert (r.replicas, r.reason) == (5, Why.REQUESTS) and "now" in r.message
    # a replica stuck for many startups is not starting (the operator counts them): the mean decides again
    assert recommend(t, 2, Signals(1, 20.0, 0.1, None, requests_now=20.0), History(), 0, starting=0).replicas == 3
    # a replica whose pod is Ready is not starting, even before the router has polled it (the operator counts
    # the starting ones from the pods, startup.starting_replicas)
    assert recommend(t, 2, Signals(1, 20.0, 0.1, None, requests_now=20.0), History(), 0, starting=0).replicas == 3
    assert recommend(t, 2, Signals(1, 20.0, 0.1, None, requests_now=20.0), History(), 0, starting=1).replicas == 2


def test_a_rising_load_scales_up_one_startup_ahead():
    # 1 replica at 6 of its 8 requests, rising 0.5 per second; a replica takes 10 s to start: 11 by then
    r = recommend(T, 1, Signals(1, 6.0, 0.1, None, requests_trend=0.5, lookahead_s=10), History(), 0)
    assert (r.replicas, r.reason) == (2, Why.REQUESTS) and "in 10 s" in r.message
    # the same rise with no startup to look ahead over, or flat, or a rise that stays within the tolerance of the
    # ready replicas' 8 (6 + 0.25 x 10 = 8.5): just the ready one
    assert recommend(T, 1, Signals(1, 6.0, 0.1, None, requests_trend=0.5, lookahead_s=0), History(), 0).replicas == 1
    assert recommend(T, 1, Signals(1, 6.0, 0.1, None, requests_trend=0.0, lookahead_s=10), History(), 0).replicas == 1
    assert recommend(T, 1, Signals(1, 6.0, 0.1, None, requests_trend=0.25, lookahead_s=10), History(), 0).replicas == 1
    # a steep rise asks for what it will need, within maxReplicas and the step bound
    r = recommend(T, 1, Signals(1, 6.0, 0.1, None, requests_trend=3.0, lookahead_s=10), History(), 0)
    assert (r.replicas, r.limited) == (4, True)
    # no look ahead while a replica asked for still starts: the ready one's climb is its queue, not the load
    assert recommend(T, 2, Signals(1, 6.0, 0.1, None, requests_trend=3.0, lookahead_s=10), History(), 0).replicas == 2
    # looking ahead only ever adds: a falling trend does not cut what the mean needs
    assert recommend(T, 3, Signals(3, 24.0, 0.1, None, requests_trend=-1.0, lookahead_s=10), History(), 0).replicas == 3


def test_a_scale_down_keeps_headroom_under_the_slos_ttft():
    t = Targets(**{**T.__dict__, "slo_ttft_s": 0.25, "scale_down_stabilization_s": 0})
    # 2 replicas, 1.2 requests in flight (1 replica's worth), TTFT at the percentile 0.1 s: on 1 replica about
    # 0.1 x (2/1)^2 = 0.4 s, over the SLO's 0.25 s: held
    r = recommend(t, 2, Signals(2, 1.2, 0.1, 1.0, ttft_at_slo=0.1), History(), 0)
    assert (r.replicas, r.reason) == (2, Why.SLO_HEADROOM)
    assert "about 0.400 s on 1" in r.message
    # with room (0.05 s -> 0.2 s) it goes ahead
    assert recommend(t, 2, Signals(2, 1.2, 0.1, 1.0, ttft_at_slo=0.05), History(), 0).replicas == 1
    # 4 -> 3 at 0.1 s: 0.1 x (4/3)^2 = 0.18 s, within the SLO
    assert recommend(t, 4, Signals(4, 2.0, 0.1, 1.0, ttft_at_slo=0.1), History(), 0).replicas == 3
    # under load with no measured TTFT yet (the ready replicas just changed) a scale-down waits; idle, it does not
    assert recommend(t, 2, Signals(2, 1.2, 0.1, None), History(), 0).reason == Why.SLO_HEADROOM
    assert recommend(t, 2, Signals(2, 0.0, 0.1, None), History(), 0).replicas == 1
    # no TTFT in the SLO: the requests decide alone
    assert recommend(T, 2, Signals(2, 1.2, 0.1, 1.0, ttft_at_slo=5.0), History(), 0).reason != Why.SLO_HEADROOM


def test_headroom_never_holds_off_scale_to_zero():
    t = Targets(**{**T.__dict__, "slo_ttft_s": 0.25, "min_replicas": 0, "scale_down_stabilization_s": 0})
    r = recommend(t, 1, Signals(1, 0.0, 0.1, None, idle_s=500, ttft_at_slo=0.2), History(), 0)
    assert (r.replicas, r.reason) == (0, Why.SCALE_TO_ZERO)
