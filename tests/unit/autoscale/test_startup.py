"""A replica's startup, from its Slice's creation to its leader's Ready condition."""
from __future__ import annotations

from tokenfleet_operator.autoscale.startup import replica_startup_seconds


def sl(created):
    return {"metadata": {"creationTimestamp": created}}


def pod(ready_at, status="True"):
    return {"status": {"conditions": [{"type": "Initialized", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
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
