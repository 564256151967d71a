"""Adapter-aware routing: prefer a backend holding the adapter within the load bound, else spread; prefix
affinity within an adapter; the adapters a backend holds, as read from its /metrics."""
from __future__ import annotations

from tokenfleet_serving.engine.block_pool import adapter_root_hash, hash_prefix_blocks
from tokenfleet_serving.router.policy import ADAPTER, LEAST_LOAD, PREFIX_HIT, BackendView, PolicyParams, RouteRequest, choose
from tokenfleet_serving.router.prefix import block_hashes
from tokenfleet_serving.router.state import parse_engine_metrics

PARAMS = PolicyParams("prefix-aware", load_factor=1.25, load_slack=0)


def test_a_backend_holding_the_adapter_is_preferred_within_the_load_bound():
    backends = [BackendView("a", load=3), BackendView("b", load=4, adapters={"sql"}), BackendView("c", load=2)]
    d = choose(RouteRequest(adapter="sql"), backends, PARAMS)
    assert (d.backend, d.reason) == ("b", ADAPTER)
    assert choose(RouteRequest(), backends, PARAMS).backend == "c"       # the base model: least loaded


def test_an_overloaded_holder_spills_to_the_least_loaded_backend():
    backends = [BackendView("a", load=0), BackendView("b", load=10, adapters={"sql"}), BackendView("c", load=1)]
    d = choose(RouteRequest(adapter="sql"), backends, PARAMS)
    assert (d.backend, d.reason) == ("a", LEAST_LOAD)


def test_prefix_affinity_holds_within_an_adapter_only():
    tokens = list(range(64))
    base, sql = block_hashes(tokens, 16), block_hashes(tokens, 16, adapter="sql")
    assert not set(base) & set(sql)
    assert sql == tuple(h.hex() for h in hash_prefix_blocks(tokens, 16, parent=adapter_root_hash("sql")))
    backends = [BackendView("a", cached=set(base), adapters={"sql"}), BackendView("b", cached=set(sql), adapters={"sql"}),
                BackendView("c")]
    d = choose(RouteRequest(block_hashes=sql, adapter="sql"), backends, PARAMS)
    assert (d.backend, d.reason, d.matched_blocks) == ("b", PREFIX_HIT, 4)


def test_the_adapters_of_a_backend_come_from_its_metrics():
    text = """# TYPE tokenfleet:lora_adapter_loaded gauge
tokenfleet:lora_adapter_loaded{model_name="m",adapter="sql"} 1.0
tokenfleet:lora_adapter_loaded{model_name="m",adapter="poem"} 0.0
"""
    sample = parse_engine_metrics(text)
    assert sample.adapters == {"sql"} and sample.served_adapters == {"sql", "poem"}
