"""The built-in autoscaler on the real control plane: with real serving processes, an idle service scales to
zero (draining its replica first), and a request that arrives then is held by the router, brings a replica
up and is answered; with a stand-in for the router's /metrics (the reading the test controls), a service
scales above the starting count it was created with."""
from __future__ import annotations

import datetime as dt
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.operator_cluster import Operator, apply, condition, get_json, install, isvc, names, wait_for
from harness.support import http

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def autoscaled(model_dir) -> dict:
    return {
        "apiVersion": "tokenfleet.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "zero"},
        "spec": {
            "model": {"path": str(model_dir), "servedModelNames": ["tiny"]},
            "replicas": 1, "minReplicas": 0, "maxReplicas": 2,
            "accelerator": {"type": "cpu"},
            "engine": {"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 8, "maxNumBatchedTokens": 256},
            "slo": {"timeToFirstTokenMs": 600000},
            "price": {"overheadPerHour": 1.0},
            "autoscaling": {"scaleToZeroAfterSeconds": 20, "scaleDownStabilizationSeconds": 5,
                            "drainTimeoutSeconds": 30, "pendingTimeoutSeconds": 240},
            "image": "tokenfleet/serving:test",
        },
    }


def router_url(cluster, namespace) -> str | None:
    pods = (get_json(cluster, "pods", "-n", namespace, "-l", "tokenfleet.dev/role=router") or {}).get("items", [])
    ready = [p for p in pods if condition(p, "Ready").get("status") == "True" and p["status"].get("podIP")]
    return f"http://{ready[0]['status']['podIP']}:8080" if ready else None


def test_an_idle_service_scales_to_zero_and_a_request_brings_it_back(cluster, namespace, pod_model, tmp_path):
    install(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log", extra=("--collect-seconds=2",),
                  router_image="tokenfleet/serving:test").start()
    try:
        apply(cluster, autoscaled(pod_model), namespace)
        obj = wait_for("one ready replica", lambda: (o := get_json(cluster, "tfis", "zero", "-n", namespace))
                       and o.get("status", {}).get("readyReplicas") == 1 and o, 180, op)
        assert obj["status"]["desiredReplicas"] == 1
        base = wait_for("a ready router", lambda: router_url(cluster, namespace), 120, op)

        # idle for scaleToZeroAfterSeconds: the replica is drained, then its Slice deleted
        obj = wait_for("scaled to zero", lambda: (o := get_json(cluster, "tfis", "zero", "-n", namespace))
                       and o["status"].get("desiredReplicas") == 0 and not names(cluster, "slices", namespace) and o,
                       180, op)
        assert condition(obj, "Ready")["reason"] == "ScaledToZero" and condition(obj, "Ready")["status"] == "True"
        assert obj["status"]["autoscaling"]["reason"] == "ScaleToZero"
        events = cluster.kubectl("get", "events", "-n", namespace, "-o", "jsonpath={.items[*].reason}").stdout.split()
        assert "DrainStarted" in events and "ScaledDown" in events

        # a request now is held by the router until the operator has brought a replica up, then answered
        t0 = time.monotonic()
        status, _, body = http("POST", f"{base}/v1/completions",
                               {"model": "tiny", "prompt": "wake up", "max_tokens": 4, "ignore_eos": True}, timeout=300)
        waited = time.monotonic() - t0
        assert status == 200, body[:500]
        assert json.loads(body)["usage"]["completion_tokens"] == 4
        obj = wait_for("the cold start in status", lambda: (o := get_json(cluster, "tfis", "zero", "-n", namespace))
                       and (o["status"].get("autoscaling") or {}).get("lastColdStartSeconds") and o, 60, op)
        assert obj["status"]["desiredReplicas"] >= 1
        assert 0 < obj["status"]["autoscaling"]["lastColdStartSeconds"] <= waited + 1
    finally:
        op.stop()


class RouterMetrics(BaseHTTPRequestHandler):
    """Serves the router metrics the operator's collector reads, from ``server.text``."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = self.server.text.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_autoscaler_scales_above_the_count_the_service_was_created_with(cluster, namespace, tmp_path):
    """spec.replicas is only the starting count: 6 requests in flight on the one replica at a target of 2 per
    replica ask for 3 replicas, and 3 Slices must exist (the Slices once followed spec.replicas only, and the
    reconcile failed on the second one)."""
    install(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log", extra=("--collect-seconds=1",)).start()
    server = None
    try:
        apply(cluster, isvc("up", replicas=1, minReplicas=1, maxReplicas=3,
                            accelerator={"type": "nvidia-h100-80gb", "countPerHost": 1, "hostsPerReplica": 1},
                            autoscaling={"targetRequestsPerReplica": 2}), namespace)
        # the router's pod is faked Ready by KWOK with a loopback IP: the test answers its /metrics there
        router = wait_for("the router pod's IP", lambda: next(
            (p["status"]["podIP"] for p in (get_json(cluster, "pods", "-n", namespace, "-l",
                                                     "tokenfleet.dev/role=router") or {}).get("items", [])
             if (p.get("status") or {}).get("podIP")), None), 120, op)
        wait_for("the first replica ready", lambda: (o := get_json(cluster, "tfis", "up", "-n", namespace))
                 and o.get("status", {}).get("readyReplicas") == 1, 120, op)
        server = ThreadingHTTPServer((router, 8080), RouterMetrics)
        server.text = ('tokenfleet_router_backend_load{backend="up-0-0"} 6\n'  # type: ignore[attr-defined]
                       'tokenfleet_router_backend_kv_cache_usage{backend="up-0-0"} 0.1\n'
                       'tokenfleet_router_pending_requests 0\ntokenfleet_router_seconds_since_last_request 0\n')
        threading.Thread(target=server.serve_forever, daemon=True).start()

        # the Slices are applied before the status is written: read the status after the Slices are seen
        wait_for("3 Slices", lambda: names(cluster, "slices", namespace) == ["up-0", "up-1", "up-2"], 120, op)
        obj = wait_for("desiredReplicas 3 in status", lambda: (o := get_json(cluster, "tfis", "up", "-n", namespace))
                       and o.get("status", {}).get("desiredReplicas") == 3 and o, 60, op)
        assert obj["status"]["autoscaling"]["reason"] == "RequestsPerReplica"
        assert obj["spec"]["replicas"] == 1                       # never written by the operator
        # the look-ahead's startup (kept by the API server's schema): a ready replica's Slice creation (or its
        # leader pod's, if later) to that pod's Ready condition, as the API server recorded them
        def startup(slice_name):
            sl = get_json(cluster, "slices", slice_name, "-n", namespace)
            pod = get_json(cluster, "pods", f"{slice_name}-0", "-n", namespace)
            ready = next((c["lastTransitionTime"] for c in ((pod or {}).get("status") or {}).get("conditions") or []
                          if c["type"] == "Ready" and c["status"] == "True"), None)
            if not sl or not ready:
                return None
            began = max(sl["metadata"]["creationTimestamp"], pod["metadata"]["creationTimestamp"])
            return (dt.datetime.fromisoformat(ready.replace("Z", "+00:00"))
                    - dt.datetime.fromisoformat(began.replace("Z", "+00:00"))).total_seconds()
        obj = wait_for("the startup in status", lambda: (o := get_json(cluster, "tfis", "up", "-n", namespace))
                       and (o["status"].get("autoscaling") or {}).get("replicaStartupSeconds") is not None and o, 60, op)
        assert obj["status"]["autoscaling"]["replicaStartupSeconds"] in {startup(n) for n in ("up-0", "up-1", "up-2")}
    finally:
        if server is not None:
            server.shutdown()
        op.stop()
