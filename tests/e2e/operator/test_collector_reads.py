"""The collector reads the routers' and the batch leaders' /metrics over HTTP, on its own thread of work, and
queues the owner only when what it read moved; unreachable pods are backed off instead of read at every period."""
import datetime as dt
import http.server
import threading
import time

import pytest

from tokenfleet_operator.autoscale.measure import KEEP_S, windowed_cost
from tokenfleet_operator.controller.cache import ObjectCache
from tokenfleet_operator.controller.collector import Collector
from tokenfleet_operator.controller.manager import CACHE_INDEXES
from tokenfleet_operator.naming import ROUTER_PORT
from tokenfleet_operator.pod_metrics import CHECKPOINT_METRIC

ROUTER_METRICS = {
    "quiet": """# TYPE tokenfleet_router_output_tokens_total counter
tokenfleet_router_output_tokens_total 100.0
# TYPE tokenfleet_router_backend_load gauge
tokenfleet_router_backend_load{backend="svc-0-0"} 3.0
# TYPE tokenfleet_router_slo_requests_total counter
tokenfleet_router_slo_requests_total{result="met"} 9.0
tokenfleet_router_slo_requests_total{result="missed"} 1.0
""",
    "busy": """# TYPE tokenfleet_router_output_tokens_total counter
tokenfleet_router_output_tokens_total 250.0
# TYPE tokenfleet_router_backend_load gauge
tokenfleet_router_backend_load{backend="svc-0-0"} 5.0
# TYPE tokenfleet_router_slo_requests_total counter
tokenfleet_router_slo_requests_total{result="met"} 20.0
""",
}
LEADER_METRICS = f"""# TYPE {CHECKPOINT_METRIC} gauge
{CHECKPOINT_METRIC}{{checkpoint="step-000042"}} 1.7e9
"""


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    body = ""


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = self.server.body.encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def serve_at():
    servers = []

    def start(ip: str, port: int, body: str) -> _Server:
        server = _Server((ip, port), _Metrics)
        server.body = body
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def pod(name, ip, role, ready=True, **labels):
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": "1",
                         "labels": {"tokenfleet.dev/inference-service": "svc", "tokenfleet.dev/role": role, **labels}},
            "status": {"podIP": ip, "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_router_readings_add_up_over_ready_routers_and_a_change_queues_the_owner(serve_at):
    # router pods listen on the router port of their own address: two live ones on loopback addresses of
    # their own (127.3.x.y: no pod address of the local plane), one that is gone, one not ready
    a = serve_at("127.3.7.1", ROUTER_PORT, ROUTER_METRICS["quiet"])
    serve_at("127.3.7.2", ROUTER_PORT, ROUTER_METRICS["quiet"])
    cache = ObjectCache(CACHE_INDEXES)
    cache.store("InferenceService", {"metadata": {"name": "svc", "namespace": "ns", "resourceVersion": "1"}})
    routers = [pod("r-a", "127.3.7.1", "router"), pod("r-b", "127.3.7.2", "router"),
               pod("r-dead", "127.3.7.3", "router"), pod("r-warming", "127.3.7.1", "router", ready=False)]
    for p in routers + [pod("svc-0-0", "127.3.7.9", "serve", **{"tokenfleet.dev/leader": "true"})]:
        cache.store("Pod", p)
    changed = []
    collector = Collector(cache, on_change=changed.append, period=10.0)
    key = ("InferenceService", "ns", "svc")

    assert collector.collect(key) == 10.0                       # read; next read after the period
    latest = collector.router_history("ns", "svc").latest
    assert latest.reading.output_tokens == 200.0                # two readable routers add up; the dead one is skipped
    assert latest.reading.slo_requests == {"met": 18.0, "missed": 2.0}
    assert latest.reading.backend_load == {"svc-0-0": 3.0}      # the same replica seen by both: not doubled
    assert latest.ready_replicas == 1 and changed == [key]

    assert collector.collect(key) == 10.0 and changed == [key]  # nothing moved: nobody is bothered
    a.body = ROUTER_METRICS["busy"]
    assert collector.collect(key) == 10.0 and changed == [key, key]
    assert collector.router_history("ns", "svc").latest.reading.output_tokens == 350.0

    # no router can be read: the history stands and the target is backed off
    for name in ("r-a", "r-b"):
        cache.forget("Pod", {"metadata": {"name": name, "namespace": "ns"}})
    assert collector.collect(key) == -1.0
    assert collector.router_history("ns", "svc").latest.reading.output_tokens == 350.0
    # no ready router at all: nothing to read, and no failure either
    cache.forget("Pod", {"metadata": {"name": "r-dead", "namespace": "ns"}})
    assert collector.collect(key) == 10.0
    cache.forget("InferenceService", {"metadata": {"name": "svc", "namespace": "ns"}})
    assert collector.collect(key) is None                       # the service is gone: stop reading it


def test_a_batch_leaders_checkpoint_is_read_and_a_new_one_queues_the_slice(serve_at):
    leader = serve_at("127.3.8.1", 9400, LEADER_METRICS)
    cache = ObjectCache(CACHE_INDEXES)
    cache.store("Slice", {"metadata": {"name": "job", "namespace": "ns", "resourceVersion": "1"},
                          "status": {"phase": "Running"}})
    member = pod("job-0", "127.3.8.1", "batch", **{"tokenfleet.dev/slice": "job", "tokenfleet.dev/leader": "true"})
    member["spec"] = {"containers": [{"name": "main", "ports": [{"name": "metrics", "containerPort": 9400}]}]}
    cache.store("Pod", member)
    changed = []
    collector = Collector(cache, on_change=changed.append, checkpoint_period=5.0)
    key = ("Slice", "ns", "job")

    assert collector.collect(key) == 5.0
    assert collector.checkpoint("ns", "job") == {"latest": "step-000042", "savedAt": "2023-11-14T22:13:20Z"}
    assert changed == [key]
    assert collector.collect(key) == 5.0 and changed == [key]   # the same checkpoint: nobody is bothered
    leader.body = LEADER_METRICS.replace("step-000042", "step-000043")
    assert collector.collect(key) == 5.0 and changed == [key, key]
    assert collector.checkpoint("ns", "job")["latest"] == "step-000043"

    leader.shutdown()
    leader.server_close()
    assert collector.collect(key) == -1.0                       # unreachable: backed off, the last value stands
    assert collector.checkpoint("ns", "job")["latest"] == "step-000043"
    cache.store("Slice", {"metadata": {"name": "job", "namespace": "ns", "resourceVersion": "2"},
                          "status": {"phase": "Succeeded"}})
    assert collector.collect(key) is None                       # finished: stop reading it


def test_what_a_new_router_counted_before_the_first_read_falls_in_the_window_since_it_started(serve_at):
    """The first requests after a service comes up are often served before the collector's first read (the
    demo's are): the router's counters started at zero with its process, so they count from its start."""
    serve_at("127.3.9.1", ROUTER_PORT, ROUTER_METRICS["busy"])
    serve_at("127.3.9.2", ROUTER_PORT, ROUTER_METRICS["busy"])
    cache = ObjectCache(CACHE_INDEXES)
    for svc in ("fresh", "old"):
        cache.store("InferenceService", {"metadata": {"name": svc, "namespace": "ns", "resourceVersion": "1"}})
    now = time.time()
    for name, ip, started in (("fresh", "127.3.9.1", now - 30), ("old", "127.3.9.2", now - 3 * KEEP_S)):
        router = pod(f"{name}-router", ip, "router")
        router["metadata"]["labels"]["tokenfleet.dev/inference-service"] = name
        router["status"]["startTime"] = dt.datetime.fromtimestamp(started, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        cache.store("Pod", router)
    collector = Collector(cache, on_change=lambda key: None)

    assert collector.collect(("InferenceService", "ns", "fresh")) == 10.0
    cost = windowed_cost(collector.router_history("ns", "fresh"), dollars_per_hour=3.6)
    assert 245 * 3600 / 31 <= cost["tokensPerHour"] <= 250 * 3600 / 29     # 250 tokens in the 30 s since it started
    # a router that started long before (the operator failed over): its past is not put into one window
    assert collector.collect(("InferenceService", "ns", "old")) == 10.0
    assert windowed_cost(collector.router_history("ns", "old"), dollars_per_hour=3.6) == {"window": "5m",
                                                                                          "minTokens": 1000}
