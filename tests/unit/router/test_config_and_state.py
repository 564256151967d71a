"""router.json / endpoints.json parsing, metric parsing, backend state and cost (no network)."""
from __future__ import annotations

import json

import pytest

from tokenfleet_serving.contract.cost import cost_per_million_tokens
from tokenfleet_serving.contract.router_files import (
    ConfigError,
    Endpoint,
    Tier,
    load_endpoints,
    load_router_config,
    parse_endpoints,
    parse_router_config,
)
from tokenfleet_serving.router.state import (
    HASHED_KEY_OVER,
    MAX_SESSION_KEY_CHARS,
    CounterRate,
    EngineSample,
    Fleet,
    SessionTable,
    parse_engine_metrics,
    session_key,
)

OPERATOR_CONFIG = {
    "service": "llama", "namespace": "ns", "models": ["llama-8b", "llama"],
    "policy": "kv-aware", "sessionAffinity": {"enabled": True, "header": "X-Session-Id", "ttlSeconds": 60},
    "kvBlockSize": 32, "slo": {"percentile": 95}, "modelPath": "/models/llama-8b",
    "price": {"perReplicaHour": 21.0, "currency": "EUR"},
}


def test_operator_config_parses():
    c = parse_router_config(OPERATOR_CONFIG)
    assert (c.service, c.policy, c.kv_block_size, c.model_path) == ("llama", "kv-aware", 32, "/models/llama-8b")
    assert c.session_affinity.enabled and c.session_affinity.header == "x-session-id"
    assert c.session_affinity.ttl_seconds == 60
    assert (c.price_per_replica_hour, c.currency) == (21.0, "EUR")
    assert c.tiers == (Tier("default"),)
    assert parse_router_config({}).policy == "prefix-aware"


@pytest.mark.parametrize(("patch", "message"), [
    ({"backends": {"dns": "x"}}, "unknown field(s) backends"),           # a key nothing reads is drift
    ({"price": {"perReplicaHour": 1, "perHour": 2}}, "unknown field(s) price.perHour"),
    ({"slo": {"percentile": 95, "ttft": 5}}, "unknown field(s) slo.ttft"),
    ({"slo": {"timeToFirstTokenMs": 0}}, "field 'slo.timeToFirstTokenMs' must be in [1, 600000]"),
    ({"policy": "random"}, "field 'policy' must be one of round-robin, least-load, prefix-aware, kv-aware"),
    ({"kvBlockSize": "16"}, "field 'kvBlockSize' must be int, got str"),
    ({"kvBlockSize": 0}, "field 'kvBlockSize' must be in [1, 4096], got 0"),
    ({"sessionAffinity": {"enabled": "yes"}}, "field 'sessionAffinity.enabled' must be bool"),
    ({"price": {"perReplicaHour": -1}}, "field 'price.perReplicaHour' must be in [0, 1e+07], got -1"),
    ({"tiers": [{"name": "a"}, {"name": "a"}]}, "field 'tiers' has duplicate names"),
    ({"tiers": [{"model": "x"}]}, "field 'tiers[0].name' is required"),
    ({"tiers": [{"name": "s", "maxPromptTokens": 0}]}, "field 'tiers[0].maxPromptTokens' must be in"),
    ({"loadFactor": 0.5}, "field 'loadFactor' must be in [1, 100]"),
    ({"migrationLimit": -1}, "field 'migrationLimit' must be in [0, 100]"),
    ({"models": ["a", ""]}, "field 'models' must be a list of non-empty strings"),
])
def test_bad_router_config_names_the_field(patch, message):
    with pytest.raises(ConfigError) as err:
        parse_router_config(OPERATOR_CONFIG | patch, "/etc/tokenfleet/router.json")
    assert str(err.value).startswith("/etc/tokenfleet/router.json: ")
    assert message in str(err.value)


def test_config_files_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"router\.json: file not found"):
        load_router_config(tmp_path / "router.json")
    (tmp_path / "router.json").write_text("{")
    with pytest.raises(ConfigError, match=r"router\.json: not valid JSON"):
        load_router_config(tmp_path / "router.json")
    (tmp_path / "endpoints.json").write_text(json.dumps({"endpoints": []}))
    with pytest.raises(ConfigError, match=r"endpoints\.json: must be a JSON list"):
        load_endpoints(tmp_path / "endpoints.json")


def test_endpoints_parse_and_reject_bad_entries():
    eps = parse_endpoints([{"pod": "a-0-0", "slice": "a-0", "ip": "127.2.0.5", "port": 8000, "ready": True},
                           {"pod": "a-1-0", "ip": "fd00::1", "port": 8000, "ready": False, "tier": "large"}])
    assert eps[0] == Endpoint("a-0-0", "127.2.0.5", 8000, True, "a-0")
    assert eps[0].url == "http://127.2.0.5:8000" and eps[1].url == "http://[fd00::1]:8000"
    assert eps[1].tier == "large" and not eps[1].ready
    for bad, message in [
        ([{"pod": "a", "ip": "a.b", "port": 1}], "field '[0].ip' must be an IP address"),
        ([{"pod": "a", "ip": "1.2.3.4"}], "field '[0].port' is required"),
        ([{"pod": "a", "ip": "1.2.3.4", "port": 70000}], "field '[0].port' must be in [1, 65535]"),
        ([{"pod": "a", "ip": "1.2.3.4", "port": 1}, {"pod": "a", "ip": "1.2.3.5", "port": 1}], "repeats pod 'a'"),
        (["x"], "[0] must be a JSON object"),
    ]:
        with pytest.raises(ConfigError, match=None) as err:
            parse_endpoints(bad, "endpoints.json")
        assert message in str(err.value), str(err.value)


SERVER_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:generation_tokens Number of generation tokens processed.
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 1234.0
# HELP tokenfleet:ready 1 when ready.
# TYPE tokenfleet:ready gauge
tokenfleet:ready{engine="0",model_name="tiny"} 0.0
"""


def test_parse_engine_metrics():
    s = parse_engine_metrics(SERVER_METRICS)
    assert s == EngineSample(running=3, waiting=2, kv_usage=0.25, generation_tokens=1234, ready=False)
    assert s.load == 5
    other = parse_engine_metrics('vllm:num_requests_waiting{engine="0"} 1\nvllm:num_requests_waiting{engine="1"} 4\n')
    assert other == EngineSample(waiting=5, generation_tokens=None, ready=None,
                                 signals=frozenset({"vllm:num_requests_waiting"}))


def test_counter_rate_window_and_reset():
    r = CounterRate(window_s=10)
    assert r.rate() == 0
    r.add(0, 100)
    r.add(2, 140)
    assert r.rate() == 20
    r.add(20, 400)  # the window drops samples older than 10 s (keeping one before the window)
    assert r.rate() == pytest.approx((400 - 140) / 18)
    r.add(21, 5)  # restarted backend: start over
    assert r.rate() == 0
    r.add(22, 15)
    assert r.rate() == 10


def test_cost_per_million_tokens():
    assert cost_per_million_tokens(36.0, 10.0) == pytest.approx(1000.0)  # 36 $/h over 36,000 tokens/h
    assert cost_per_million_tokens(36.0, 0.0) is None


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def fleet_with(*endpoints: Endpoint, **config):
    clock = Clock()
    f = Fleet(parse_router_config({"kvBlockSize": 16} | config), interval_s=0.5, clock=clock)
    f.set_endpoints(endpoints)
    return f, clock


A = Endpoint("a", "127.0.0.1", 8001, True)
B = Endpoint("b", "127.0.0.1", 8002, True)


def test_a_backend_is_routable_only_when_ready_fresh_and_reachable():
    f, clock = fleet_with(A, B, Endpoint("c", "127.0.0.1", 8003, False))
    assert f.routable() == []  # never polled
    for name in "abc":
        f.record_poll(name, EngineSample(), frozenset(), 16)
    assert [b.name for b in f.routable()] == ["a", "b"]  # c's pod is not Ready
    f.record_poll("b", EngineSample(ready=False), frozenset(), 16)  # draining
    assert [b.name for b in f.routable()] == ["a"]
    f.mark_failed("a", "connection refused")
    assert f.routable() == []
    f.record_poll("a", EngineSample(), None, None)  # a good poll clears the failure
    assert [b.name for b in f.routable()] == ["a"]
    clock.t += 3.1  # no poll for longer than stale_after
    assert f.routable() == []


def test_a_replica_that_says_it_is_ready_is_routable_before_the_kubelet_updates_the_endpoints_file():
    # a kubelet refreshes a mounted ConfigMap up to a minute after the pod turned Ready; the replica's own
    # tokenfleet:ready comes with the next poll
    f, _ = fleet_with(Endpoint("c", "127.0.0.1", 8003, False))
    f.record_poll("c", EngineSample(), frozenset(), 16)          # another server: no readiness of its own
    assert f.routable() == []
    f.record_poll("c", EngineSample(ready=False), frozenset(), 16)
    assert f.routable() == []
    f.record_poll("c", EngineSample(ready=True), frozenset(), 16)
    assert [b.name for b in f.routable()] == ["c"]
    f.set_endpoints([Endpoint("c", "127.0.0.1", 8003, False, draining=True)])
    assert f.routable() == []                                    # draining wins over everything
    f.set_endpoints([Endpoint("c", "127.0.0.1", 8003, True)])
    f.record_poll("c", EngineSample(ready=True), frozenset(), 16)
    assert [b.name for b in f.routable()] == ["c"]
    # once listed ready, a pod the list calls not ready again (its node was lost) is out, whatever it says
    f.set_endpoints([Endpoint("c", "127.0.0.1", 8003, False)])
    assert f.routable() == []


def test_a_busy_backend_whose_polls_time_out_stays_routable_while_its_responses_flow():
    f, clock = fleet_with(A, B)
    f.note_alive("a")                     # a response from a backend never polled does not make it routable
    assert f.routable() == []
    f.record_poll("a", EngineSample(), frozenset(), 16)
    f.record_poll("b", EngineSample(), frozenset(), 16)
    for _ in range(4):                    # 10 s of polls timing out on both, while a's responses stream
        clock.t += 2.5
        f.note_alive("a")
    assert [b.name for b in f.routable()] == ["a"]      # b showed no sign of life for 10 s
    clock.t += 3.1                        # a's stream ended too and nothing else came from it
    assert f.routable() == []
    f.note_alive("a")
    f.mark_failed("a", "response broken off")           # a broken connection still takes it out at once
    assert f.routable() == []


def test_endpoint_changes_keep_the_state_of_unchanged_pods():
    f, _ = fleet_with(A, B)
    f.record_poll("a", EngineSample(running=4), frozenset({"h"}), 16)
    f.record_poll("b", EngineSample(running=1), frozenset(), 16)
    f.set_endpoints([A, Endpoint("b", "127.0.0.9", 8002, True)])  # b came back with a new IP
    assert f.backends["a"].sample.running == 4 and f.backends["a"].cached == {"h"}
    assert f.backends["b"].sample is None


def test_load_is_the_larger_of_polled_and_in_flight():
    f, _ = fleet_with(A)
    f.record_poll("a", EngineSample(running=1, waiting=1), frozenset(), 16)
    assert f.views(None)[0].load == 2
    f.backends["a"].inflight = 5
    assert f.views(None)[0].load == 5


def test_routed_blocks_count_as_cached_until_a_poll_or_their_expiry():
    f, clock = fleet_with(A)
    f.record_poll("a", EngineSample(), frozenset({"h0"}), 16)
    f.note_routed("a", ["h0", "h1", "h2"])
    view = f.views(None)[0]
    assert all(h in view.cached for h in ("h0", "h1", "h2")) and "h3" not in view.cached
    assert sorted(view.cached) == ["h0", "h1", "h2"] and len(view.cached) == 3
    clock.t += 6  # expired
    f.record_poll("a", EngineSample(), frozenset({"h0"}), 16)
    assert "h1" not in f.views(None)[0].cached


def test_session_table_forgets_idle_sessions():
    t = SessionTable(ttl_s=10)
    t.pin("s", "a", now=0)
    assert t.pinned("s", now=5) == "a"
    t.pin("s", "a", now=5)
    assert t.pinned("s", now=14) == "a"
    assert t.pinned("s", now=15.1) is None


def test_session_table_is_bounded_in_entries_and_key_length_evicting_the_least_recently_used():
    """Issue 37, defect 5: 20,000 distinct long session ids kept 160 MB in the router. The table keeps at
    most ``max_entries`` keys of at most HASHED_KEY_OVER characters, whatever the clients send."""
    import tracemalloc

    t = SessionTable(ttl_s=3600, max_entries=1000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(20_000):
        t.pin(f"{i:06d}-" + "s" * MAX_SESSION_KEY_CHARS, "backend-a", now=i * 1e-3)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(t.entries) == 1000 and t.evicted == 19_000
    assert max(len(k) for k in t.entries) <= HASHED_KEY_OVER
    assert grown < 400_000, f"the table grew by {grown} bytes for 1,000 entries"
    newest, oldest = f"{19_999:06d}-" + "s" * MAX_SESSION_KEY_CHARS, f"{0:06d}-" + "s" * MAX_SESSION_KEY_CHARS
    assert t.pinned(newest, now=21) == "backend-a" and t.pinned(oldest, now=21) is None
    # least recently *used*: re-pinning an old session keeps it over the ones pinned since
    t = SessionTable(ttl_s=3600, max_entries=2)
    t.pin("old", "a", now=0)
    t.pin("mid", "b", now=1)
    t.pin("old", "a", now=2)
    t.pin("new", "c", now=3)
    assert (t.pinned("old", 4), t.pinned("mid", 4), t.pinned("new", 4)) == ("a", None, "c")
    # a short key is kept as it is; two long keys that differ only at the end stay apart
    assert session_key("user-42") == "user-42"
    assert session_key("x" * 200 + "1") != session_key("x" * 200 + "2")


def test_a_backend_silent_past_the_stall_timeout_is_stalled_and_not_routable():
    """Issue 37, defect 6: a frozen replica keeps its connections open and answers nothing. Stalled: no good
    poll and no response byte for the timeout; a byte of any response, or a good poll, is a sign of life."""
    f, clock = fleet_with(A, B)
    f.record_poll("a", EngineSample(), frozenset(), 16)
    f.record_poll("b", EngineSample(), frozenset(), 16)
    clock.t += 2
    f.note_alive("a")
    clock.t += 2.5
    assert not f.stalled("a", 4) and f.stalled("b", 4)
    assert [b.name for b in f.routable()] == ["a"]       # b is stale: no new request goes there
    f.record_poll("b", EngineSample(), frozenset(), 16)  # it answers again (SIGCONT)
    assert not f.stalled("b", 4) and {b.name for b in f.routable()} == {"a", "b"}
    assert not f.stalled("unknown", 4)


def test_generation_rate_sums_fresh_backends_only():
    f, clock = fleet_with(A, B)
    for dt, a, b in ((0, 0, 100), (1, 10, 120), (2, 20, 140)):
        clock.t = 1000 + dt
        f.record_poll("a", EngineSample(generation_tokens=a), None, None)
        f.record_poll("b", EngineSample(generation_tokens=b), None, None)
    assert f.generation_tokens_per_second() == pytest.approx(10 + 20)
    clock.t += 10  # both stale: a dead fleet generates nothing
    assert f.generation_tokens_per_second() == 0


def test_polled_host_and_disk_tiers_reach_the_policy_view():
    f, _ = fleet_with(A)
    f.record_poll("a", EngineSample(), frozenset({"h0"}), 16, (frozenset({"h1"}), frozenset({"h2"})))
    [view] = f.views(None)
    assert "h0" in view.cached and set(view.host_cached) == {"h1"} and set(view.disk_cached) == {"h2"}
    f.record_poll("a", EngineSample(), frozenset({"h0"}), 16)            # a replica without tiers
    [view] = f.views(None)
    assert not view.host_cached and not view.disk_cached
