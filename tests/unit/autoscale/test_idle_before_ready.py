"""A replica is not idle before it could serve: a model that loads for longer than the idle window (vLLM's CPU
build: about a minute; a 70B model on GPUs: minutes) is not scaled to zero before its first replica is Ready.
The steps are the reconciler's: the replicas' serving time, the starting ones, the signals, the recommendation."""
from __future__ import annotations

import datetime as dt

from tokenfleet_operator.autoscale.measure import Entry, ReadingHistory, signals
from tokenfleet_operator.autoscale.policy import History, Targets, Why, recommend
from tokenfleet_operator.autoscale.startup import ServingSince, serving_seconds, starting_replicas
from tokenfleet_serving.contract.router_metrics import RouterReading

CREATED = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
# bench fleet's autoscaled service: minReplicas 0, to zero after 20 s idle, scale-down at once
TARGETS = Targets(min_replicas=0, max_replicas=4, scale_down_stabilization_s=0.0, scale_to_zero_after_s=20.0)


def stamp(seconds: float) -> str:
    return (CREATED + dt.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def leader(ready_at: float | None) -> dict:
    ready = {"type": "Ready", "status": "True" if ready_at is not None else "False",
             "lastTransitionTime": stamp(ready_at if ready_at is not None else 0)}
    return {"metadata": {"creationTimestamp": stamp(0)}, "status": {"conditions": [ready]}}


def step(at: float, ready_at: float | None, router_idle: float, serving: ServingSince, h: History):
    """One pass of the autoscaler ``at`` seconds after the service (one replica, no request yet) was created."""
    pod = leader(ready_at)
    replicas = [(0, {"metadata": {"creationTimestamp": stamp(0)}}, pod)]
    now = CREATED + dt.timedelta(seconds=at)
    ready = {"auto-0"} if ready_at is not None else set()
    readings = ReadingHistory()
    load = {"auto-0": 0.0} if ready else {}
    readings.add(Entry(at, 1_700_000_000 + at, RouterReading(backend_load=load, idle_s=router_idle), len(ready)))
    serving_s = serving.seconds(at, 1, serving_seconds([pod], now))
    sig = signals(readings, ready, 0.0, None, None, serving_s)
    return recommend(TARGETS, 1, sig, h, at, starting_replicas(1, replicas, now, None))


def test_a_replica_that_loads_for_longer_than_the_idle_window_is_not_scaled_to_zero_before_it_is_ready():
    serving, h = ServingSince(), History()
    # the router has had no request since it started with the service; the replica loads for 90 s, longer than
    # the 60 s after which a replica that is not Ready stops counting as starting (startup.STARTING_MIN_S)
    for at in (10, 30, 62, 75, 89):
        r = step(at, None, at, serving, h)
        assert r.replicas == 1, (at, r)
    # Ready at 90 s: idle from then on, and gone 20 s later
    assert step(95, 90, 95, serving, h).replicas == 1
    r = step(111, 90, 111, serving, h)
    assert (r.replicas, r.reason) == (0, Why.SCALE_TO_ZERO)


def test_a_replica_that_never_becomes_ready_is_never_idle():
    serving, h = ServingSince(), History()
    for at in (100, 1_000, 10_000):
        assert step(at, None, at, serving, h).replicas == 1


def test_a_service_that_could_serve_stays_able_to_until_it_has_no_replica():
    serving = ServingSince()
    assert serving.seconds(100.0, 1, None) is None                    # starting
    assert serving.seconds(130.0, 1, 20.0) == 20.0                    # Ready since 110
    assert serving.seconds(200.0, 1, None) == 90.0                    # it failed since: it had its chance
    assert serving.seconds(210.0, 2, 5.0) == 100.0                    # another Ready later: still since 110
    assert serving.seconds(220.0, 0, None) is None                    # scaled to zero
    assert serving.seconds(230.0, 1, None) is None                    # the next replica starts afresh
