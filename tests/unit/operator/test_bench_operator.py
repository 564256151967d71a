"""The pure parts of `tokenfleet bench operator`: the workload, node sizing, readiness, and what it
reads from an operator's /metrics (quantiles, differences, absent series)."""
import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tokenfleet_dev.bench.operator import (
    GPUS_PER_NODE,
    NODES_PER_BLOCK,
    PODS_PER_NODE,
    Phases,
    Workload,
    is_ready,
    node_count,
    service_manifest,
    summarize,
    workload,
)
from tokenfleet_dev.bench.operator_metrics import beyond_last_bucket, histogram_quantile, parse, spread
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.validation import check_inference_service

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def operator_metrics(durations=(), requests=(), objects=(), with_objects=True):
    """The /metrics text of an operator that exported these series."""
    reg = CollectorRegistry()
    total = Counter("tokenfleet_reconcile_total", "", ["kind", "result"], registry=reg)
    hist = Histogram("tokenfleet_reconcile_duration_seconds", "", ["kind"], buckets=BUCKETS, registry=reg)
    api = Counter("tokenfleet_operator_api_requests_total", "", ["verb", "resource"], registry=reg)
    per_object = Counter("tokenfleet_object_reconciles_total", "", ["kind", "namespace", "name"],
                         registry=reg) if with_objects else None
    for kind, seconds in durations:
        total.labels(kind, "ok").inc()
        hist.labels(kind).observe(seconds)
    for verb, resource, n in requests:
        api.labels(verb, resource).inc(n)
    for kind, ns, name, n in objects:
        per_object.labels(kind, ns, name).inc(n)
    return generate_latest(reg).decode()


def test_workload_is_seeded_and_within_the_issue_shape():
    a, b = workload(200, seed=3), workload(200, seed=3)
    assert a == b and a != workload(200, seed=4)
    assert {w.replicas for w in a} == {1, 2, 3, 4}
    assert len({w.name for w in a}) == 200


def test_every_service_manifest_is_a_valid_spec():
    for w in workload(50, seed=0):
        spec = InferenceServiceSpec.model_validate(service_manifest(w, "bench")["spec"])
        assert check_inference_service(spec) == []
        assert spec.accelerator.type != "cpu"  # the gang scheduler places every member
    waiting = InferenceServiceSpec.model_validate(service_manifest(Workload("w", 1, 1, 1), "bench", pvc="nope")["spec"])
    assert waiting.model.pvc.claim_name == "nope"


def test_nodes_hold_every_gpu_and_pod_with_room_to_spare():
    for count in (1, 5, 100, 1000):
        services = workload(count, seed=0)
        nodes = node_count(services)
        assert nodes % NODES_PER_BLOCK == 0
        assert nodes * GPUS_PER_NODE >= 1.2 * sum(w.gpus for w in services)
        assert nodes * PODS_PER_NODE >= 1.2 * sum(w.pods for w in services)


def test_ready_needs_the_condition_and_the_current_generation():
    def obj(generation, observed, status, cond_generation=None):
        c = {"type": "Ready", "status": status}
        if cond_generation is not None:
            c["observedGeneration"] = cond_generation
        return {"metadata": {"generation": generation}, "status": {"observedGeneration": observed, "conditions": [c]}}

    assert is_ready(obj(2, 2, "True"))
    assert is_ready(obj(2, 2, "True", cond_generation=2))
    assert not is_ready(obj(2, 1, "True"))
    assert not is_ready(obj(2, 2, "True", cond_generation=1))
    assert not is_ready(obj(2, 2, "False"))
    assert not is_ready({"metadata": {"generation": 1}})


def test_histogram_quantile_interpolates_inside_the_bucket():
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.95)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.99, {0.1: 1.0, math.inf: 10.0}) == 0.1  # in +Inf: the highest finite bound
    assert beyond_last_bucket(0.99, {0.1: 1.0, math.inf: 10.0})
    assert not beyond_last_bucket(0.99, buckets) and not beyond_last_bucket(0.5, {0.1: 0.0, math.inf: 0.0})
    with pytest.raises(ValueError):
        histogram_quantile(1.5, buckets)


def test_a_difference_of_scrapes_is_what_happened_between_them():
    before = parse(operator_metrics([("Slice", 0.02)], [("get", "pods", 3)], [("Slice", "ns", "a", 1)]))
    after = parse(operator_metrics(
        [("Slice", 0.02), ("Slice", 0.3), ("InferenceService", 0.7), ("InferenceService", 0.8)],
        [("get", "pods", 10), ("apply", "slices/status", 4)],
        [("Slice", "ns", "a", 1), ("InferenceService", "ns", "s", 2)]))
    d = after - before
    assert d.reconciles == {"Slice": 1, "InferenceService": 2}
    assert d.total_api_requests == 11
    assert d.object_count("Slice", "ns", "a") == 0
    assert d.object_count("InferenceService", "ns", "s") == 2
    assert d.object_count("Slice", "ns", "never") == 0
    merged = d.merged_buckets()
    assert merged[0.25] == 0 and merged[0.5] == 1 and merged[1.0] == 3 and merged[math.inf] == 3


def test_series_an_operator_does_not_export_read_as_absent_not_zero():
    s = parse(operator_metrics([("Slice", 0.02)], with_objects=False))
    assert s.object_count("Slice", "ns", "a") is None
    assert parse(operator_metrics()).object_count("Slice", "ns", "a") == 0  # exported, no sample yet
    bare = parse("# HELP x y\n# TYPE x counter\nx_total 1\n")
    assert bare.total_api_requests is None and bare.total_reconciles == 0


def test_summary_divides_the_ramp_by_its_own_counts():
    services = [Workload("svc-0000", 2, 1, 1), Workload("svc-0001", 2, 1, 1)]
    ramp = parse(operator_metrics([("Slice", 0.02)] * 8 + [("InferenceService", 0.2)] * 2,
                                  [("list", "pods", 30)], [("InferenceService", "bench", "svc-0000", 1)]))
    idle = parse(operator_metrics([("InferenceService", 0.2)] * 4, [],
                                  [("InferenceService", "bench", "svc-0000", 3), ("InferenceService", "bench", "svc-0001", 1)]))
    result = summarize(Phases(services=services, nodes=8, create_seconds=0.5, all_ready_at=5.0, ramp=ramp,
                              ramp_cpu_seconds=2.0, idle=idle, idle_window=(10.0, 40.0), idle_cpu_seconds=1.5,
                              peak_rss_mb=90.0))
    assert result["services"] == 2 and result["replicas"] == 4
    assert result["reconciles_per_second"] == 2.0
    assert result["api_requests_per_reconcile"] == 3.0
    assert result["idle_cpu_cores"] == 0.05
    assert 0.01 <= result["reconcile_p50_seconds"] <= 0.025
    assert 0.1 <= result["reconcile_p99_seconds"] <= 0.25
    assert result["idle"]["reconciles_per_object_per_minute"]["InferenceService"]["max"] == pytest.approx(6.0)
    assert result["targets"] == {"seconds_to_all_ready_under_600": True, "peak_rss_mb_under_300": True,
                                 "idle_cpu_cores_under_0.1": True}


def test_a_ramp_that_timed_out_reports_its_rates_over_the_time_it_ran():
    services = [Workload("svc-0000", 1, 1, 1), Workload("svc-0001", 1, 1, 1)]
    ramp = parse(operator_metrics([("Slice", 0.02)] * 30, [("list", "pods", 60)]))
    result = summarize(Phases(services=services, nodes=8, create_seconds=0.5, all_ready_at=None, ramp=ramp,
                              ramp_cpu_seconds=2.0, ramp_end=60.0, ready_at_ramp_end=1))
    assert result["seconds_to_all_ready"] is None and not result["all_ready"]
    assert result["ready_at_end_of_ramp"] == 1 and result["ramp_seconds"] == 60.0
    assert result["reconciles_per_second"] == 0.5 and result["api_requests_per_reconcile"] == 2.0
    assert result["idle_cpu_cores"] is None
    assert result["targets"]["seconds_to_all_ready_under_600"] is False


def test_spread():
    assert spread([]) is None
    assert spread([3, 1, 2]) == {"objects": 3, "min": 1, "p50": 2, "mean": 2.0, "max": 3}


def test_touched_services_are_spread_and_leave_a_control_group():
    from tokenfleet_dev.bench.operator import touched_sample

    services = workload(100, seed=0)
    touched = touched_sample(services, 10)
    assert touched == [f"svc-{i:04d}" for i in range(0, 100, 10)]
    assert touched_sample(services[:5], 10) == ["svc-0000", "svc-0001", "svc-0002", "svc-0003"]  # one left untouched
    assert touched_sample(services[:3], 2) == ["svc-0000", "svc-0001"]


def test_a_trigger_is_measured_against_the_untouched_services():
    services = [Workload(f"svc-000{i}", 2 if i < 2 else 1, 1, 1) for i in range(4)]
    slices_of = {"svc-0000": ["svc-0000-0", "svc-0000-1"], "svc-0001": ["svc-0001-0", "svc-0001-1"],
                 "svc-0002": ["svc-0002-0"], "svc-0003": ["svc-0003-0"]}
    # in the window: the annotated service 3 times and its Slices twice each; the spec-changed one twice;
    # the untouched ones once each (a resync)
    trigger = parse(operator_metrics(objects=[
        ("InferenceService", "bench", "svc-0000", 3), ("Slice", "bench", "svc-0000-0", 2), ("Slice", "bench", "svc-0000-1", 2),
        ("InferenceService", "bench", "svc-0001", 2), ("Slice", "bench", "svc-0001-0", 1), ("Slice", "bench", "svc-0001-1", 1),
        ("InferenceService", "bench", "svc-0002", 1), ("Slice", "bench", "svc-0002-0", 1),
        ("InferenceService", "bench", "svc-0003", 1), ("Slice", "bench", "svc-0003-0", 1)]))
    result = summarize(Phases(services=services, nodes=8, create_seconds=0.5, all_ready_at=5.0, ramp=parse(""),
                              ramp_cpu_seconds=1.0, trigger=trigger, trigger_window=(10.0, 40.0),
                              touched=["svc-0000"], changed={"svc-0001": 10.5}, observed={"svc-0001": 13.0},
                              slices_of=slices_of))
    t = result["reconciles_per_object_per_trigger"]
    assert t["untouched"] == {"services": 2, "slices": 2, "reconciles_per_service": 1.0, "reconciles_per_slice": 1.0}
    assert t["annotation"]["touched"] == {"services": 1, "slices": 2, "reconciles_per_service": 3.0, "reconciles_per_slice": 2.0}
    assert t["annotation"]["caused_by_one_trigger"] == {"service": 2.0, "per_slice": 1.0, "slices_of_one_service": 2.0}
    assert t["spec_change"]["caused_by_one_trigger"] == {"service": 1.0, "per_slice": 0.0, "slices_of_one_service": 0.0}
    assert t["spec_change"]["seconds_to_observed"] == {"observed": 1, "of": 1, "p50": 2.5, "max": 2.5}


def test_the_waiting_service_is_reported_per_interval():
    services = [Workload("svc-0000", 1, 1, 1), Workload("svc-0001", 1, 1, 1)]
    probe = parse(operator_metrics(objects=[("InferenceService", "bench", "waiting-for-pvc", 6)]))
    result = summarize(Phases(services=services, nodes=8, create_seconds=0.5, all_ready_at=5.0, ramp=parse(""),
                              ramp_cpu_seconds=1.0, probe=probe, probe_window=(100.0, 130.0),
                              probe_intervals=[(0.0, 15.0, 1.0), (15.0, 30.0, 5.0)]))
    w = result["waiting_service"]
    assert w["reconciles"] == 6 and w["reconciles_per_minute"] == 12.0
    assert [i["reconciles"] for i in w["reconciles_by_interval"]] == [1.0, 5.0]
    assert w["reconciles_per_minute_last_interval"] == 20.0


def test_audit_lines_are_counted_per_window_for_one_user():
    import json as _json

    from tokenfleet_dev.bench.audit_log import count_requests

    def line(user, verb, resource, at, sub=None, stage="ResponseComplete"):
        ref = {"resource": resource, **({"subresource": sub} if sub else {})}
        return _json.dumps({"kind": "Event", "stage": stage, "verb": verb, "user": {"username": user},
                            "objectRef": ref, "requestReceivedTimestamp": at})

    op = "system:serviceaccount:tokenfleet-system:tokenfleet-operator"
    lines = [
        line(op, "patch", "inferenceservices", "2026-01-01T00:00:01.500000Z"),
        line(op, "create", "pods", "2026-01-01T00:00:02.000000Z", sub="binding"),
        line(op, "create", "pods", "2026-01-01T00:00:02.000000Z", sub="binding", stage="ResponseStarted"),
        line("system:kube-scheduler", "create", "pods", "2026-01-01T00:00:02.000000Z", sub="binding"),
        line(op, "get", "nodes", "2026-01-01T00:00:12.000000Z"),
        '{"kind": "Event", "user": {"username": "' + op + '"',  # cut short
    ]
    base = 1767225600.0  # 2026-01-01T00:00:00Z
    counts = count_requests(lines, op, {"ramp": (base, base + 10), "idle": (base + 10, base + 20)})
    assert counts["ramp"] == {("patch", "inferenceservices"): 1, ("create", "pods/binding"): 1}
    assert counts["idle"] == {("get", "nodes"): 1}
