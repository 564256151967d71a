"""Argo CD health checks for InferenceService, Slice, SliceQueue and TokenRoute, run on Lua as Argo CD runs them: every
case of each health_test.yaml (objects captured from the real plane in each state) gives the expected status
and message."""
from __future__ import annotations

import pytest

from harness.argo_health import CUSTOMIZATIONS, health, health_tests

STATES = {
    "InferenceService": {"new": "Progressing", "progressing": "Progressing", "ready": "Healthy",
                         "degraded": "Degraded", "failed": "Degraded"},
    "Slice": {"progressing": "Progressing", "ready": "Healthy", "degraded": "Degraded", "failed": "Degraded"},
    "SliceQueue": {"new": "Progressing", "ready": "Healthy"},
    "TokenRoute": {"new": "Progressing", "ready": "Healthy", "degraded": "Degraded"},
}


@pytest.mark.parametrize("kind", sorted(STATES))
def test_health_test_yaml_cases_pass(kind):
    cases = health_tests(kind)
    assert {path: want["status"] for path, want, _ in cases} == {f"testdata/{s}.yaml": h for s, h in STATES[kind].items()}
    for path, want, got in cases:
        assert got == want, path
    assert (CUSTOMIZATIONS / "tokenfleet.dev" / kind / "health.lua").exists()


def test_a_spec_the_operator_has_not_seen_is_progressing_and_stalled_is_degraded():
    old = {"metadata": {"generation": 3}, "status": {"observedGeneration": 2, "conditions": [
        {"type": "Ready", "status": "True", "reason": "Serving", "message": "ok"}]}}
    assert health("InferenceService", old)["status"] == "Progressing"
    stalled = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "conditions": [
        {"type": "Ready", "status": "False", "reason": "QueueInvalid", "message": "bad"},
        {"type": "Stalled", "status": "True", "reason": "QueueInvalid", "message": "bad; its Slices wait"}]}}
    assert health("SliceQueue", stalled) == {"status": "Degraded", "message": "QueueInvalid: bad; its Slices wait"}
    done = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "phase": "Succeeded", "conditions": [
        {"type": "Ready", "status": "True", "reason": "Completed", "message": "all 2 members exited successfully"},
        {"type": "Reconciling", "status": "False", "reason": "Completed", "message": "all 2 members exited successfully"}]}}
    assert health("Slice", done)["status"] == "Healthy"
