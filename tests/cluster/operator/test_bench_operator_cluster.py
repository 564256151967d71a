"""`tokenfleet bench operator` end to end on a small run: its own plane, the operator under its
ServiceAccount, five services. Every field the issue names is there and agrees with the others,
and the operator's API-request counter speaks RBAC's words."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
ISSUE_FIELDS = ("services", "seconds_to_all_ready", "reconciles_per_second", "reconcile_p50_seconds",
                "reconcile_p99_seconds", "api_requests_per_reconcile", "peak_rss_mb", "cpu_seconds",
                "idle_cpu_cores", "hardware")


def rbac_rules() -> set[tuple[str, str]]:
    """(verb, resource) pairs the operator's ClusterRole and its leader-election Role grant."""
    roles = [doc for f in ("clusterrole.yaml", "role-leader-election.yaml")
             for doc in yaml.safe_load_all((REPO / "manifests" / "base" / f).read_text()) if doc and "rules" in doc]
    return {(verb, resource) for role in roles for rule in role["rules"] for resource in rule["resources"]
            for verb in rule["verbs"]}


@pytest.mark.slow
def test_a_small_run_reports_every_field_coherently(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenfleet_cli", "bench", "operator", "--services", "5", "--json", str(out),
         "--plot", str(png), "--workdir", str(tmp_path / "work"), "--timeout", "240",
         "--warmup-seconds", "1", "--settle-seconds", "0", "--idle-seconds", "8", "--trigger-seconds", "4",
         "--touched", "2", "--probe-seconds", "20"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=600)
    log = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    r = json.loads(out.read_text())
    assert png.stat().st_size > 10_000

    for name in ISSUE_FIELDS:
        assert r.get(name) is not None, f"{name} missing: {log}"
    assert r["services"] == 5 and r["all_ready"]
    assert 5 <= r["replicas"] <= 20
    assert r["seconds_to_all_ready"] > 0
    assert r["reconciles"] >= 5 + r["replicas"]  # every service and every Slice at least once
    assert r["reconciles_per_second"] == pytest.approx(r["reconciles"] / r["seconds_to_all_ready"], rel=0.01)
    assert 0 < r["reconcile_p50_seconds"] <= r["reconcile_p99_seconds"] <= 10
    assert r["api_requests_per_reconcile"] == pytest.approx(r["api_requests"] / r["reconciles"], rel=0.01)
    assert r["api_requests_per_reconcile"] >= 1
    assert 20 < r["peak_rss_mb"] < 2000
    assert 0 < r["cpu_seconds"] <= r["cpu_seconds_total"]
    assert 0 <= r["idle_cpu_cores"] <= r["hardware"]["cores"]
    assert r["hardware"]["cores"] >= 1 and r["hardware"]["cpu"]
    assert len(r["hardware"]["loadavg_start"]) == 3 and len(r["hardware"]["loadavg_end"]) == 3
    assert set(r["targets"]) == {"seconds_to_all_ready_under_600", "peak_rss_mb_under_300", "idle_cpu_cores_under_0.1"}

    # The counter in kube.py: the requests the pass must make, each a verb the operator's RBAC grants
    # ("apply" is a patch to RBAC).
    by_verb = r["api_requests_by_verb"]
    assert sum(by_verb.values()) == r["api_requests"]
    for needed in ("apply inferenceservices/status", "apply slices/status", "create pods", "create pods/binding",
                   "apply deployments"):
        assert by_verb.get(needed, 0) >= 1, by_verb
    assert by_verb["create pods/binding"] == r["member_pods"]  # the gang scheduler bound every member once
    granted = rbac_rules()
    for key in by_verb:
        verb, resource = key.split(" ")
        assert ({"apply": "patch"}.get(verb, verb), resource) in granted, key

    # Reconciles per object: every object once or more during the ramp; the touched services at
    # least once in their window; the service waiting for its PVC from its creation on.
    per_object = r["ramp_reconciles_per_object"]
    assert per_object["InferenceService"]["objects"] == 5 and per_object["InferenceService"]["min"] >= 1
    assert per_object["Slice"]["objects"] == r["replicas"] and per_object["Slice"]["min"] >= 1
    idle = r["idle"]
    assert idle["seconds"] >= 8 and idle["reconciles"] == sum(idle["reconciles_by_kind"].values())
    trigger = r["reconciles_per_object_per_trigger"]
    annotated, changed, untouched = trigger["annotation"]["touched"], trigger["spec_change"]["touched"], trigger["untouched"]
    assert (annotated["services"], changed["services"], untouched["services"]) == (2, 2, 1)
    assert annotated["slices"] + changed["slices"] + untouched["slices"] == r["replicas"]
    assert trigger["annotation"]["caused_by_one_trigger"]["service"] is not None
    # a changed spec is always seen: the window waits for it
    assert trigger["spec_change"]["seconds_to_observed"]["observed"] == 2
    assert 0 < trigger["spec_change"]["seconds_to_observed"]["max"] <= trigger["window_seconds"]
    assert changed["reconciles_per_service"] >= 1
    waiting = r["waiting_service"]
    assert waiting["reconciles"] >= 1  # reconciled once it was created, and counted
    assert waiting["reconciles"] == sum(i["reconciles"] for i in waiting["reconciles_by_interval"])
    intervals = waiting["reconciles_by_interval"]
    assert len(intervals) >= 2 and intervals[0]["from_seconds"] == 0
    assert all(a["to_seconds"] == b["from_seconds"] for a, b in zip(intervals, intervals[1:]))
    assert intervals[-1]["to_seconds"] == pytest.approx(waiting["window_seconds"], abs=0.2)
    assert waiting["reconciles_per_minute"] > 0
    assert r["series"]["ready"][-1][1] == 5
