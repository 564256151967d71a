"""The gang pass's own binds and deletions, laid over a cache that has not seen them yet."""
from __future__ import annotations

from tokenfleet_operator.gang.assumed import AssumedState


def pod(uid, node=None, deleting=None):
    p = {"metadata": {"name": uid, "namespace": "ns", "uid": uid}, "spec": {}, "status": {"phase": "Pending"}}
    if node:
        p["spec"]["nodeName"] = node
    if deleting:
        p["metadata"]["deletionTimestamp"] = deleting
    return p


def test_a_bind_shows_until_the_cache_has_it_and_the_cached_pod_is_never_changed():
    now = [100.0]
    a = AssumedState(clock=lambda: now[0])
    cached = [pod("p1"), pod("p2")]
    a.bound("p1", "n1")
    view = a.overlay(cached)
    assert view[0]["spec"]["nodeName"] == "n1" and "nodeName" not in view[1]["spec"]
    assert "nodeName" not in cached[0]["spec"]                   # a copy, not the cache's object
    assert len(a) == 1
    view = a.overlay([pod("p1", node="n1"), pod("p2")])           # the watch delivered the bind
    assert view[0]["spec"]["nodeName"] == "n1" and len(a) == 0


def test_a_deletion_shows_as_terminating_until_the_cache_has_it():
    now = [100.0]
    a = AssumedState(clock=lambda: now[0])
    a.deleted("p1")
    view = a.overlay([pod("p1", node="n1")])
    assert view[0]["metadata"]["deletionTimestamp"] and view[0]["spec"]["nodeName"] == "n1"
    assert a.overlay([pod("p1", node="n1", deleting="2030-01-01T00:00:00Z")])[0]["metadata"]["deletionTimestamp"] \
        == "2030-01-01T00:00:00Z" and len(a) == 0


def test_entries_end_when_the_pod_is_gone_or_too_old():
    now = [100.0]
    a = AssumedState(ttl=60, clock=lambda: now[0])
    a.bound("gone", "n1")
    a.deleted("gone-too")
    assert a.overlay([pod("other")]) == [pod("other")] and len(a) == 0
    a.bound("p1", "n1")
    now[0] += 61
    assert "nodeName" not in a.overlay([pod("p1")])[0]["spec"] and len(a) == 0   # a missed event cannot pin it
