"""Cost per token from measured throughput: parsing the replicas' metrics, the status fields, and a real scrape."""
import http.server
import threading

import pytest
from operator_samples import isvc_body

from tokenfleet_operator.api import InferenceServiceSpec
from tokenfleet_operator.inference_service_status import SliceState, compute_status
from tokenfleet_operator.throughput import measured_cost, output_rate_from_metrics, scrape_output_tokens_per_second

SERVER_METRICS = """# HELP vllm:generation_tokens_total Generated tokens.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="m"} 1234.0
# HELP tokenfleet:output_tokens_per_second Output tokens per second over the last minute.
# TYPE tokenfleet:output_tokens_per_second gauge
tokenfleet:output_tokens_per_second{model_name="m"} 250.0
"""


def test_output_rate_is_read_from_the_metrics_text():
    assert output_rate_from_metrics(SERVER_METRICS) == 250.0
    assert output_rate_from_metrics("# TYPE x gauge\nx 3\n") is None
    assert output_rate_from_metrics("this is { not prometheus") is None


@pytest.mark.parametrize("dph, tps, expected", [
    (10.0, None, {}),                                                       # no measurement: keep the last one
    (10.0, 0.0, {"tokensPerHour": 0.0, "costPerMillionTokens": None}),      # idle: no cost per token
    (10.0, 250.0, {"tokensPerHour": 900000.0, "costPerMillionTokens": 11.1111}),
    (2.9, 1000.0, {"tokensPerHour": 3600000.0, "costPerMillionTokens": 0.8056}),
])
def test_measured_cost(dph, tps, expected):
    assert measured_cost(dph, tps) == expected


def status(tps, old=None):
    body = isvc_body()
    spec = InferenceServiceSpec.model_validate(body["spec"])
    slices = [SliceState("llama-0", "new", "Ready", True), SliceState("llama-1", "new", "Ready", True)]
    return compute_status(body, spec, "new", slices, 1, old_status=old, now="2026-01-01T00:00:00Z",
                          output_tokens_per_second=tps)


def test_status_carries_cost_per_million_tokens():
    s = status(420.0)
    dph = s["cost"]["dollarsPerHour"]
    assert s["cost"]["tokensPerHour"] == 420.0 * 3600
    assert s["cost"]["costPerMillionTokens"] == round(dph / (420.0 * 3600) * 1e6, 4)
    # A failed scrape keeps the last measurement; an idle fleet drops the cost per token.
    assert status(None, old=s)["cost"] == s["cost"]
    idle = status(0.0, old=s)["cost"]
    assert idle == {"dollarsPerHour": dph, "tokensPerHour": 0.0}


class _Metrics(http.server.BaseHTTPRequestHandler):
    text = SERVER_METRICS

    def do_GET(self):
        body = self.text.encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_scrape_sums_ready_replicas_and_skips_the_unreachable():
    servers = [http.server.HTTPServer(("127.0.0.1", 0), _Metrics) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        eps = [{"ip": "127.0.0.1", "port": s.server_address[1], "ready": True} for s in servers]
        dead = {"ip": "127.0.0.1", "port": 1, "ready": True}
        not_ready = {"ip": "127.0.0.1", "port": servers[0].server_address[1], "ready": False}
        assert scrape_output_tokens_per_second(eps + [dead, not_ready]) == 500.0
        assert scrape_output_tokens_per_second([dead]) is None
        assert scrape_output_tokens_per_second([]) is None
    finally:
        for s in servers:
            s.shutdown()


def test_the_leaders_checkpoint_is_read_from_its_metrics():
    from tokenfleet_operator.checkpoint_report import checkpoint_from_metrics, metrics_url
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
