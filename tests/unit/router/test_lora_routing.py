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


def test_an_adapters_root_comes_from_its_metrics_and_the_request_hashes_chain_from_it():
    root = adapter_root_hash("sql", "ab" * 32)
    text = f"""# TYPE tokenfleet:lora_adapter_root_info gauge
tokenfleet:lora_adapter_root_info{{model_name="m",adapter="sql",root="{root.hex()}"}} 1.0
tokenfleet:lora_adapter_root_info{{model_name="m",adapter="odd",root="not-hex"}} 1.0
"""
    assert parse_engine_metrics(text).adapter_roots == (("sql", root.hex()),)
    tokens = list(range(64))
    assert block_hashes(tokens, 16, adapter="sql", root=root) == tuple(
        h.hex() for h in hash_prefix_blocks(tokens, 16, parent=root)) != block_hashes(tokens, 16, adapter="sql")
    assert block_hashes(tokens, 16, root=root) == block_hashes(tokens, 16)      # the base model has no root


def test_the_fleet_hashes_an_adapter_from_the_root_most_routable_backends_report():
    from tokenfleet_serving.contract.router_files import Endpoint, parse_router_config
    from tokenfleet_serving.router.state import EngineSample, Fleet

    old, new = adapter_root_hash("sql", "01" * 32).hex(), adapter_root_hash("sql", "02" * 32).hex()
    fleet = Fleet(parse_router_config({"kvBlockSize": 16}))
    fleet.set_endpoints([Endpoint(n, "127.0.0.1", 8000 + i, True) for i, n in enumerate("abc")])
    assert fleet.adapter_root("sql") is None                     # nobody reports one: hashed from the name
    for name, root in (("a", old), ("b", new), ("c", new)):
        fleet.record_poll(name, EngineSample(adapter_roots=(("sql", root),)), frozenset(), 16)
    assert fleet.adapter_root("sql") == bytes.fromhex(new) and fleet.adapter_root(None) is None
