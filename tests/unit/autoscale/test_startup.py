"""A replica's startup, from its Slice's creation to its leader's Ready condition."""
from __future__ import annotations

import datetime as dt

from tokenfleet_operator.autoscale.startup import replica_startup_seconds, serving_seconds, starting_replicas


def sl(created):
    return {"metadata": {"creationTimestamp": created}}


def pod(ready_at, status="True", created=None):
    return {"metadata": {"creationTimestamp": created} if created else {},
            "status": {"conditions": [{"type": "Initialized", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                                      {"type": "Ready", "status": status, "lastTransitionTime": ready_at}]}}


def test_the_newest_ready_replica_says_how_long_a_start_takes():
    replicas = [(sl("2026-01-01T00:00:00Z"), pod("2026-01-01T00:01:00Z")),      # 60 s, an older replica
                (sl("2026-01-01T00:10:00Z"), pod("2026-01-01T00:10:09Z")),      # 9 s, the newest ready one
                (sl("2026-01-01T00:11:00Z"), pod("2026-01-01T00:11:02Z", "False")),   # still starting
                (sl("2026-01-01T00:12:00Z"), None)]                              # no pod yet
    assert replica_startup_seconds(replicas) == 9.0


def test_nothing_ready_or_unreadable_times_give_no_figure():
    assert replica_startup_seconds([]) is None
    assert replica_startup_seconds([(sl("2026-01-01T00:11:00Z"), pod("2026-01-01T00:11:02Z", "False"))]) is None
    assert replica_startup_seconds([(sl("yesterday"), pod("2026-01-01T00:11:02Z"))]) is None
    assert replica_startup_seconds([({"metadata": {}}, pod("2026-01-01T00:11:02Z"))]) is None
    # a Ready condition older than the Slice (clock skew, a reused name) is no measurement
    assert replica_startup_seconds([(sl("2026-01-01T00:11:00Z"), pod("2026-01-01T00:10:00Z"))]) is None


def test_a_pod_recreated_in_an_old_slice_starts_from_its_own_creation():
    # a rollout replaced the leader pod of a Slice made an hour before: 12 s, not an hour
    old_slice = sl("2026-01-01T00:00:00Z")
    assert replica_startup_seconds([(old_slice, pod("2026-01-01T01:00:12Z", created="2026-01-01T01:00:00Z"))]) == 12.0


NOW = dt.datetime(2026, 1, 1, 0, 10, tzinfo=dt.UTC)


def test_starting_replicas_are_the_ones_asked_for_and_not_ready_for_a_few_startups():
    ready = pod("2026-01-01T00:01:00Z")
    replicas = [(0, sl("2026-01-01T00:00:00Z"), ready),
                (1, sl("2026-01-01T00:09:30Z"), None),                               # 30 s old, no pod yet
                (2, sl("2026-01-01T00:09:00Z"), pod("2026-01-01T00:09:05Z", "False")),  # 60 s old, not Ready
                (3, sl("2026-01-01T00:00:00Z"), pod("2026-01-01T00:09:05Z", "False"))]  # 10 min old: stuck
    # 0 is ready; 1 and 2 start; 3 is stuck (older than 3 startups of 30 s and than 60 s); 4 and 5 have no Slice yet
    assert starting_replicas(6, replicas, NOW, startup_s=30) == 4
    # only the replicas asked for count: a Slice beyond them is being removed
    assert starting_replicas(2, replicas, NOW, startup_s=30) == 1
    # with a slow startup measured (5 min), the 10-minute-old replica still counts as starting
    assert starting_replicas(4, replicas, NOW, startup_s=300) == 3
    # no startup measured yet: 60 s
    assert starting_replicas(4, replicas, NOW, startup_s=None) == 2
    # a Ready condition without a transition time is still Ready
    bare = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert starting_replicas(1, [(0, sl("2026-01-01T00:09:59Z"), bare)], NOW, startup_s=30) == 0


def test_serving_time_is_that_of_the_longest_ready_replica():
    now = dt.datetime(2026, 1, 1, 0, 10, tzinfo=dt.UTC)
    assert serving_seconds([pod("2026-01-01T00:09:58Z"), pod("2026-01-01T00:05:00Z"), None], now) == 300.0
    assert serving_seconds([pod("2026-01-01T00:09:58Z")], now) == 2.0            # just came up
    assert serving_seconds([pod("2026-01-01T00:09:58Z", "False"), None], now) is None   # none ready
    assert serving_seconds([pod("later")], now) is None
