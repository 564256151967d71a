import datetime as dt

import pytest

from tokenfleet_operator import conditions as cond


def test_merge_sets_transition_time_only_when_status_changes():
    first = cond.merge(None, [cond.Desired("Ready", "False", "Starting", "a")], now="2026-01-01T00:00:00Z", generation=1)
    assert first == [{"type": "Ready", "status": "False", "reason": "Starting", "message": "a",
                      "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}]
    same_status = cond.merge(first, [cond.Desired("Ready", "False", "Waiting", "b")], now="2026-01-01T00:05:00Z", generation=2)
    assert same_status[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert same_status[0]["reason"] == "Waiting" and same_status[0]["observedGeneration"] == 2
    flipped = cond.merge(same_status, [cond.Desired("Ready", "True", "Serving")], now="2026-01-01T00:09:00Z")
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T00:09:00Z"
    assert "observedGeneration" not in flipped[0]


def test_merge_is_idempotent():
    desired = [cond.Desired("Ready", "True", "Serving", "ok"), cond.Desired("Degraded", "False", "AsExpected")]
    once = cond.merge(None, desired, now="2026-01-01T00:00:00Z")
    twice = cond.merge(once, desired, now="2026-02-01T00:00:00Z")
    assert once == twice


def test_merge_keeps_foreign_conditions_and_orders_desired_first():
    foreign = [{"type": "example.com/Audited", "status": "True", "reason": "Done", "lastTransitionTime": "x"}]
    out = cond.merge(foreign, [cond.Desired("Ready", "True", "Serving")], now="t")
    assert [c["type"] for c in out] == ["Ready", "example.com/Audited"]


def test_duplicate_types_are_a_bug():
    import pytest
    with pytest.raises(ValueError, match="Ready"):
        cond.merge(None, [cond.Desired("Ready", "True", "A"), cond.Desired("Ready", "False", "B")], now="t")


def test_transitions_lists_only_status_changes():
    before = cond.merge(None, [cond.Desired("Ready", "False", "A"), cond.Desired("Degraded", "False", "B")], now="t")
    after = cond.merge(before, [cond.Desired("Ready", "True", "C"), cond.Desired("Degraded", "False", "D")], now="u")
    assert [(t.type, t.old_status, t.new_status, t.reason) for t in cond.transitions(before, after)] == [("Ready", "False", "True", "C")]
    assert [t.type for t in cond.transitions(None, after)] == ["Ready", "Degraded"]


def test_rfc3339_round_trip():
    moment = dt.datetime(2026, 3, 4, 5, 6, 7, tzinfo=dt.UTC)
    assert cond.parse_rfc3339(cond.now_rfc3339(moment)) == moment


def test_api_server_timestamps_parse_as_utc_and_anything_else_is_refused():
    assert cond.parse_rfc3339("2026-12-02T23:59:59Z") == dt.datetime(2026, 12, 2, 23, 59, 59, tzinfo=dt.UTC)
    for bad in ("2026-13-02T00:00:00Z", "2026-12-02T00:00+1:0Z", "2026-12-02 00:00:00Z", "2026-12-02T00:00:00",
                "2026-12-02T00:00:00+00:00", ""):
        with pytest.raises(ValueError):
            cond.parse_rfc3339(bad)


def test_an_object_is_ready_when_its_status_has_a_true_ready_condition():
    assert cond.is_ready({"status": {"conditions": [{"type": "PodScheduled", "status": "True"},
                                                    {"type": "Ready", "status": "True"}]}})
    assert not cond.is_ready({"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert not cond.is_ready({"status": {"conditions": [{"type": "ContainersReady", "status": "True"}]}})
    assert not cond.is_ready({"status": None}) and not cond.is_ready({})
