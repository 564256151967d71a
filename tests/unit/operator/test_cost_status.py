"""status.cost and status.goodput as the status function builds them from what was measured."""
from tokenfleet_operator.api import InferenceServiceSpec
from tokenfleet_operator.inference_service_status import Measured, Scaling, SliceState, compute_status
from tokenfleet_operator.pod_metrics import checkpoint_from_metrics, metrics_url

from harness.operator_samples import isvc_body


def status(measured=None, scaling=None, old=None):
    body = isvc_body()
    spec = InferenceServiceSpec.model_validate(body["spec"])
    slices = [SliceState("llama-0", "new", "Ready", True), SliceState("llama-1", "new", "Ready", True)]
    return compute_status(body, spec, "new", slices, 1, old_status=old, now="2026-01-01T00:00:00Z",
                          scaling=scaling, measured=measured)


def test_cost_and_goodput_come_from_the_window_and_capacity_keeps_its_best_minute():
    window = {"window": "5m", "minTokens": 1000, "tokensPerHour": 72000.0, "costPerMillionTokens": 583.3333}
    capacity = {"tokensPerHourPerReplica": 50000.0, "costPerMillionTokens": 420.0, "measuredAt": "2026-01-01T00:00:00Z"}
    good = {"window": "5m", "requests": 10, "requestRatio": 0.9, "tokenRatio": 0.95, "percentile": 95.0,
            "timeToFirstTokenSeconds": 0.2, "timePerOutputTokenSeconds": 0.05, "met": False}
    s = status(Measured(window, good, capacity))
    assert s["cost"] == {"dollarsPerHour": 42.0, **window, "capacity": capacity}   # 2 replicas * (8 * 2.5 + 1)
    assert s["goodput"] == good and s["desiredReplicas"] == 2
    later = status(Measured({"window": "5m", "minTokens": 1000}), old=s)             # idle now: no cost per token
    assert "costPerMillionTokens" not in later["cost"] and later["cost"]["capacity"] == capacity
    assert "goodput" not in later


def test_draining_replicas_are_paid_for_and_the_limit_shows_as_a_condition():
    from tokenfleet_operator import conditions as cond
    limited = cond.Desired("ScalingLimited", "True", "AtMaxReplicas", "more than maxReplicas")
    s = status(scaling=Scaling(2, {"reason": "SloAttainment"}, limited, ({"name": "llama-2", "since": "t"},)))
    assert s["cost"]["dollarsPerHour"] == 3 * 21.0 and s["draining"] == [{"name": "llama-2", "since": "t"}]
    assert next(c for c in s["conditions"] if c["type"] == "ScalingLimited")["status"] == "True"
    off = status(old=s)                                                               # autoscaler turned off
    assert "ScalingLimited" not in {c["type"] for c in off["conditions"]} and "autoscaling" not in off


def test_the_leaders_checkpoint_is_read_from_its_metrics():
    text = ("# TYPE tokenfleet_batch_committed_round gauge\ntokenfleet_batch_committed_round 3.0\n"
            "# TYPE tokenfleet_batch_checkpoint_timestamp_seconds gauge\n"
            'tokenfleet_batch_checkpoint_timestamp_seconds{checkpoint="r000003-ab"} 1.7672256e+09\n')
    assert checkpoint_from_metrics(text) == {"latest": "r000003-ab", "savedAt": "2026-01-01T00:00:00Z"}
    assert checkpoint_from_metrics("tokenfleet_batch_committed_round 0.0\n") is None
    assert checkpoint_from_metrics("not { metrics") is None
    pod = {"status": {"phase": "Running", "podIP": "127.1.0.5"},
           "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 80},
                                              {"name": "metrics", "containerPort": 9100}]}]}}
    assert metrics_url(pod) == "http://127.1.0.5:9100/metrics"
    pod["spec"]["containers"][0]["ports"] = [{"containerPort": 8000}]
    assert metrics_url(pod) == "http://127.1.0.5:8000/metrics"
    assert metrics_url({**pod, "status": {"phase": "Succeeded", "podIP": "127.1.0.5"}}) is None
    pod["spec"]["containers"][0]["ports"] = []
    assert metrics_url(pod) is None
