"""The router's record of a vLLM replica's cache from its KV events (router/kv_events.py): the batches are built
here with msgpack in the two shapes vLLM publishes (a map per struct, and the older array-like one), and sent over
a real ZeroMQ PUB socket on loopback for the subscription. tests/e2e/router/test_router_vllm.py (marked vllm)
reads the events of a real vLLM replica."""
from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest
import zmq

from tokenfleet_serving.contract.router_files import ConfigError, Endpoint, parse_router_config, router_config_json
from tokenfleet_serving.router.backend_runtime import RUNTIME, TOKENFLEET, VLLM
from tokenfleet_serving.router.kv_events import (
    REPLAY_YIELD_BATCHES,
    EventBlocks,
    EventFormatError,
    catch_up,
    decode_batch,
    fetch_replay,
    follow,
)
from tokenfleet_serving.router.main import main as route_main
from tokenfleet_serving.router.policy import PolicyParams, RouteRequest, choose
from tokenfleet_serving.router.prefix import block_hashes
from tokenfleet_serving.router.state import Fleet

BS = 4
PROMPT = list(range(100, 120))          # 5 full blocks of 4


def stored(hashes, parent, tokens, *, block_size=BS, medium="GPU", lora_name=None, extra_keys=None) -> dict:
    e = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
         "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": lora_name}
    if extra_keys is not None:
        e["extra_keys"] = extra_keys
    return e


def removed(hashes, medium="GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def batch(*events, ts=1.0) -> bytes:
    return msgpack.packb({"ts": ts, "events": list(events), "data_parallel_rank": 0})


def test_stored_blocks_are_keyed_by_the_routers_own_hash_across_events():
    blocks = EventBlocks(BS)
    # the first two blocks in one event, the next three chained on vLLM's hash of the second
    blocks.apply(0, decode_batch(batch(stored([b"h1", b"h2"], None, PROMPT[:8]))))
    blocks.apply(1, decode_batch(batch(stored([31, 32, 33], b"h2", PROMPT[8:20]))))
    assert list(blocks) == list(block_hashes(PROMPT, BS))
    assert blocks.unnamed == 0 and blocks.gaps == 0


def test_the_older_array_like_encoding_reads_the_same():
    old = msgpack.packb([1.0, [["BlockStored", [b"h1", b"h2"], None, PROMPT[:8], BS, None, "GPU"],
                               ["BlockRemoved", [b"h2"], "GPU"], ["AllBlocksCleared"]], 0])
    events = decode_batch(old)
    assert [e.kind for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    blocks = EventBlocks(BS)
    blocks.apply(0, events[:2])
    assert list(blocks) == list(block_hashes(PROMPT[:4], BS))


def test_removed_and_cleared_blocks_are_forgotten_and_lower_tiers_ignored():
    blocks = EventBlocks(BS)
    blocks.apply(0, decode_batch(batch(stored([1, 2, 3], None, PROMPT[:12]))))
    blocks.apply(1, decode_batch(batch(removed([3]), removed([1], medium="CPU"),
                                       stored([9], None, PROMPT[12:16], medium="CPU"))))
    assert list(blocks) == list(block_hashes(PROMPT[:8], BS))   # 3 went; the CPU tier's events changed nothing
    blocks.apply(2, decode_batch(batch({"type": "AllBlocksCleared"})))
    assert len(blocks) == 0 and not blocks.ours and not blocks.theirs


def test_blocks_the_router_cannot_name_are_left_out():
    blocks = EventBlocks(BS)
    # a parent it never saw stored, a block hashed with a cache salt (and its child), another block size
    blocks.apply(0, decode_batch(batch(stored([5], b"unknown", PROMPT[4:8]),
                                       stored([1, 2], None, PROMPT[:8], extra_keys=[None, ["salt"]]),
                                       stored([7], None, PROMPT[:8], block_size=8))))
    assert list(blocks) == list(block_hashes(PROMPT[:4], BS))
    assert blocks.unnamed == 1 + 1 + 1


def test_an_adapters_blocks_chain_from_its_root():
    blocks = EventBlocks(BS)
    blocks.apply(0, decode_batch(batch(stored([1, 2], None, PROMPT[:8], lora_name="ft-1"))))
    assert list(blocks) == list(block_hashes(PROMPT[:8], BS, adapter="ft-1"))
    assert not set(blocks) & set(block_hashes(PROMPT[:8], BS))


def test_sequence_numbers_count_gaps_and_a_restart_clears_the_record():
    blocks = EventBlocks(BS)
    blocks.apply(5, decode_batch(batch(stored([1], None, PROMPT[:4]))))
    blocks.apply(9, [])
    assert blocks.gaps == 3
    blocks.apply(0, decode_batch(batch(stored([2], 1, PROMPT[4:8]))))   # parent 1 went with the restart
    assert blocks.restarts == 1 and len(blocks) == 0


def test_the_record_is_bounded_and_forgets_both_hashes_of_what_it_drops():
    blocks = EventBlocks(BS, capacity=2)
    blocks.apply(0, decode_batch(batch(stored([1, 2, 3], None, PROMPT[:12]))))
    assert list(blocks) == list(block_hashes(PROMPT[:12], BS))[1:]
    assert set(blocks.ours) == {2, 3} and set(blocks.theirs) == set(blocks)


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb("text"), msgpack.packb({"events": 3}),
                                     msgpack.packb({"events": [{"type": "BlockStored", "block_hashes": [1]}]}),
                                     msgpack.packb({"events": [7]})])
def test_a_message_that_is_not_an_event_batch_is_refused(payload):
    with pytest.raises(EventFormatError):
        decode_batch(payload)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_subscription_follows_a_publisher_over_zeromq():
    """A PUB socket on loopback sends [topic, seq, batch] as vLLM's ZmqEventPublisher does; a frame that is not
    a batch is logged and skipped, and the subscription goes on."""
    port = free_port()

    async def scenario() -> EventBlocks:
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"tcp://127.0.0.1:{port}")
        blocks = EventBlocks(BS, name="r0")
        errors: list[str] = []
        task = asyncio.ensure_future(follow(f"tcp://127.0.0.1:{port}", blocks, on_error=errors.append))
        try:
            seq = 0
            for _ in range(200):                # a SUB socket gets nothing sent before it connected: resend
                pub.send_multipart([b"kv", seq.to_bytes(8, "big"), batch(stored([1, 2], None, PROMPT[:8]))])
                seq += 1
                await asyncio.sleep(0.02)
                if len(blocks):
                    break
            pub.send_multipart([b"kv", b"short", b"x"])
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), batch(stored([3], 2, PROMPT[8:12]))])
            for _ in range(200):
                await asyncio.sleep(0.02)
                if len(blocks) == 3:
                    break
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close(linger=0)
        assert errors and "seq(8 bytes)" in errors[0]
        return blocks

    blocks = asyncio.run(scenario())
    assert list(blocks) == list(block_hashes(PROMPT[:12], BS))


def test_what_to_ask_a_replay_for_before_a_live_batch():
    blocks = EventBlocks(BS)
    assert blocks.catch_up_from(0) is None          # the replica's first batch: nothing came before it
    assert blocks.catch_up_from(7) == 0             # followed late: its whole history
    blocks.apply(7, [])
    assert blocks.catch_up_from(8) is None
    assert blocks.catch_up_from(11) == 8            # a gap: the skipped batches
    assert blocks.catch_up_from(3) == 0             # its engine restarted: the new engine's history


class ReplayingPublisher:
    """vLLM's ZmqEventPublisher on the wire: [topic, seq, batch] on a PUB socket, and on a ROUTER socket, for a
    request [empty, seq], every kept batch from seq on as [empty, topic, seq, batch], then [empty, "", -1, ""].
    ``answer`` False: requests are read and left unanswered (a replica whose replay hangs)."""

    def __init__(self, keep: int = 1000):
        import zmq.asyncio
        self.ctx = zmq.asyncio.Context.instance()
        self.pub, self.router = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.kept: list[tuple[int, bytes]] = []
        self.keep = keep
        self.seq = 0
        self.answer = True
        self.requests: list[int] = []
        self.task = asyncio.ensure_future(self.serve())

    async def publish(self, payload: bytes, *, send: bool = True) -> None:
        self.kept = (self.kept + [(self.seq, payload)])[-self.keep:]
        if send:
            await self.pub.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    async def serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            if not self.answer:
                continue
            for seq, payload in self.kept:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def until(check, seconds: float = 30.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)


async def publish_until(pub: ReplayingPublisher, payload: bytes, check, seconds: float = 30.0) -> None:
    """Publish ``payload`` again and again until ``check()`` (a SUB socket gets nothing sent before it connected)."""
    for _ in range(int(seconds / 0.05)):
        if check():
            return
        await pub.publish(payload)
        await asyncio.sleep(0.05)
    raise AssertionError("the subscription never applied a batch")


def test_a_router_that_follows_late_learns_the_replicas_history_by_replay_and_fills_a_gap():
    """The replica stored the prompt's first blocks before the router followed it; its next batch is lost on
    the way (sent to nobody). The start-up replay gives the history, the gap is asked for before the live
    batch that shows it, and the live batches the start-up replay already gave are not applied twice."""
    async def scenario():
        pub = ReplayingPublisher()
        try:
            await pub.publish(batch(stored([1, 2], None, PROMPT[:8])))          # before the router followed
            blocks = EventBlocks(BS, name="r0")
            task = asyncio.ensure_future(follow(f"tcp://127.0.0.1:{pub.pub_port}", blocks,
                                                replay_address=f"tcp://127.0.0.1:{pub.replay_port}"))
            await until(lambda: len(blocks) == 2)
            history = (len(blocks), blocks.replayed, list(pub.requests))
            await publish_until(pub, batch(), lambda: blocks.batches > 1)   # a SUB socket gets nothing sent
            lost = pub.seq
            await pub.publish(batch(stored([3], 2, PROMPT[8:12])), send=False)  # lost on the way
            await pub.publish(batch(stored([4], 3, PROMPT[12:16])))
            await until(lambda: len(blocks) == 4)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return blocks, history, pub.requests, lost
        finally:
            await pub.close()

    blocks, history, requests, lost = asyncio.run(scenario())
    assert history == (2, 1, [0])
    assert requests == [0, lost]                    # the start-up replay, then the gap from the lost batch on
    assert list(blocks) == list(block_hashes(PROMPT[:16], BS))
    assert (blocks.replayed, blocks.gaps, blocks.next_seq) == (2, 0, lost + 2)


def test_a_replay_that_does_not_answer_leaves_a_counted_gap_and_following_goes_on(monkeypatch):
    monkeypatch.setattr("tokenfleet_serving.router.kv_events.REPLAY_TIMEOUT_S", 0.2)

    async def scenario():
        pub = ReplayingPublisher()
        pub.answer = False
        try:
            blocks = EventBlocks(BS, name="r0")
            task = asyncio.ensure_future(follow(f"tcp://127.0.0.1:{pub.pub_port}", blocks,
                                                replay_address=f"tcp://127.0.0.1:{pub.replay_port}"))
            # connected (the start-up replay timed out first)
            await publish_until(pub, batch(stored([1], None, PROMPT[:4])), lambda: blocks.batches > 0)
            applied = blocks.batches
            await pub.publish(batch(stored([2], 1, PROMPT[4:8])), send=False)
            await pub.publish(batch(stored([3], None, PROMPT[:4])))
            await until(lambda: blocks.batches == applied + 1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return blocks
        finally:
            await pub.close()

    blocks = asyncio.run(scenario())
    assert (blocks.replayed, blocks.gaps) == (0, 1)
    assert len(blocks) == 1


def test_applying_a_long_replay_lets_the_event_loop_route_in_between():
    """A replica's whole buffer (thousands of batches) is applied in slices, with the event loop's other work
    (routing requests) run between them, not in one block."""
    async def scenario():
        pub = ReplayingPublisher()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        try:
            for _ in range(600):
                await pub.publish(batch(), send=False)
            blocks = EventBlocks(BS, name="r0")
            seen: list[int] = []
            apply = blocks.apply
            blocks.apply = lambda seq, events: (seen.append(ticks), apply(seq, events))[1]    # type: ignore
            tick = asyncio.ensure_future(ticker())
            await catch_up(f"tcp://127.0.0.1:{pub.replay_port}", blocks, 0)
            tick.cancel()
            await asyncio.gather(tick, return_exceptions=True)
            return blocks, seen
        finally:
            await pub.close()

    blocks, seen = asyncio.run(scenario())
    assert blocks.replayed == 600 and len(seen) == 600
    assert len(set(seen)) >= 600 // REPLAY_YIELD_BATCHES     # other tasks ran between the slices


def test_a_replay_keeps_only_the_batches_asked_for_and_says_when_it_was_cut_short():
    async def scenario():
        pub = ReplayingPublisher(keep=3)
        try:
            for _ in range(5):
                await pub.publish(batch(), send=False)
            kept = await fetch_replay(f"tcp://127.0.0.1:{pub.replay_port}", 0, until=4)
            pub.answer = False
            cut = await fetch_replay(f"tcp://127.0.0.1:{pub.replay_port}", 0, timeout_s=0.2)
            return kept, cut
        finally:
            await pub.close()

    (kept, complete), (cut, cut_complete) = asyncio.run(scenario())
    assert [seq for seq, _ in kept] == [2, 3] and complete
    assert cut == [] and not cut_complete


def test_a_replay_that_sends_garbage_is_cut_short_and_following_goes_on():
    async def scenario():
        pub = ReplayingPublisher()
        pub.answer = False
        blocks = EventBlocks(BS, name="r0")

        async def garbage():
            client, _, _ = await pub.router.recv_multipart()
            await pub.router.send_multipart([client, b"", b"kv", b"short", b"x"])

        pub.task.cancel()
        answer = asyncio.ensure_future(garbage())
        task = asyncio.ensure_future(follow(f"tcp://127.0.0.1:{pub.pub_port}", blocks,
                                            replay_address=f"tcp://127.0.0.1:{pub.replay_port}"))
        try:
            await asyncio.wait_for(answer, 30)
            await publish_until(pub, batch(stored([1], None, PROMPT[:4])), lambda: blocks.batches or task.done())
            return blocks, task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await pub.close()

    blocks, ended = asyncio.run(scenario())
    assert not ended and blocks.replayed == 0 and len(blocks) == 1


def test_prefix_aware_routing_reads_the_event_record():
    config = parse_router_config({"kvBlockSize": BS, "prefixSource": "kvEvents"})
    fleet = Fleet(config, runtime=RUNTIME[VLLM])
    fleet.set_endpoints([Endpoint("a", "127.0.0.1", 1, True), Endpoint("b", "127.0.0.1", 2, True)])
    for b in fleet.backends.values():
        b.polled_at = b.seen_at = fleet.clock()
        assert b.routed is not None and b.events is not None
    fleet.backends["b"].events.apply(0, decode_batch(batch(stored([1, 2, 3, 4], None, PROMPT[:16]))))
    request = RouteRequest(block_hashes(PROMPT, BS))
    decision = choose(request, fleet.views(None), PolicyParams("prefix-aware", 1.25, 0.9, 4))
    assert (decision.backend, decision.matched_blocks) == ("b", 4)
    assert fleet.backends["b"].cached_blocks() == 4
    from prometheus_client import generate_latest

    from tokenfleet_serving.router.metrics import RouterMetrics
    text = generate_latest(RouterMetrics(fleet, tokenizer_loaded=True).registry).decode()
    assert 'tokenfleet_router_kv_event_batches_total{backend="b"} 1.0' in text
    assert 'tokenfleet_router_backend_cached_blocks{backend="b"} 4.0' in text
    fleet.note_routed("a", block_hashes(PROMPT, BS))        # routed, not yet reported: held for a few seconds
    assert {v.name: sum(h in v.cached for h in block_hashes(PROMPT, BS)) for v in fleet.views(None)} == \
        {"a": 5, "b": 4}


def test_the_config_round_trips_and_refuses_an_unknown_source_and_the_bundled_runtime(tmp_path, capsys):
    config = parse_router_config({"prefixSource": "kvEvents", "kvEventsPort": 6000, "kvEventsReplayPort": 6001})
    assert parse_router_config(router_config_json(config)) == config
    assert config.kv_events_replay_port == 6001
    with pytest.raises(ConfigError, match="kvEventsReplayPort"):
        parse_router_config({"kvEventsReplayPort": 6001})                   # routed: nothing to replay
    with pytest.raises(ConfigError, match="kvEventsReplayPort"):
        parse_router_config({"prefixSource": "kvEvents", "kvEventsPort": 6000, "kvEventsReplayPort": 6000})
    assert "prefixSource" not in router_config_json(parse_router_config({}))
    with pytest.raises(ConfigError, match="prefixSource"):
        parse_router_config({"prefixSource": "events"})
    with pytest.raises(ValueError, match="kvEvents"):
        Fleet(config, runtime=RUNTIME[TOKENFLEET])
    path = tmp_path / "router.json"
    path.write_text('{"prefixSource": "kvEvents"}')
    assert route_main(["--config", str(path), "--backend-runtime", "tokenfleet"]) == 2
    assert "prefixSource kvEvents" in capsys.readouterr().err


def test_the_routed_record_stands_in_where_events_are_silent_and_the_events_correct_it():
    """A router that starts after its replicas hears nothing of the prefixes they hold all along (vLLM stores
    a block once): what it routes fills that gap. What the events say is gone leaves the routed record too."""
    config = parse_router_config({"kvBlockSize": BS, "prefixSource": "kvEvents"})
    fleet = Fleet(config, runtime=RUNTIME[VLLM])
    fleet.set_endpoints([Endpoint("a", "127.0.0.1", 1, True), Endpoint("b", "127.0.0.1", 2, True)])
    for b in fleet.backends.values():
        b.polled_at = b.seen_at = fleet.clock()
    b_events = fleet.backends["b"].events
    b_events.apply(0, decode_batch(batch(stored([90], None, list(range(4))))))      # an unrelated prompt
    fleet.note_routed("b", block_hashes(PROMPT, BS))
    request = RouteRequest(block_hashes(PROMPT, BS))
    params = PolicyParams("prefix-aware", 1.25, 0.9, 4)
    assert choose(request, fleet.views(None), params).matched_blocks == 5
    assert fleet.backends["b"].cached_blocks() == 6
    # b stores the prompt's blocks and evicts the last three: they leave both records
    b_events.apply(1, decode_batch(batch(stored([1, 2, 3, 4, 5], None, PROMPT), removed([3, 4, 5]))))
    assert choose(request, fleet.views(None), params).matched_blocks == 2
    assert fleet.backends["b"].cached_blocks() == 3
    b_events.apply(2, decode_batch(batch({"type": "AllBlocksCleared"})))
    decision = choose(request, fleet.views(None), params)
    assert decision.matched_blocks == 0 and fleet.backends["b"].cached_blocks() == 0


# ---- what a hostile or broken publisher sends (docs/routing.md, "KV events": bounds) --------------------------
def test_a_malformed_event_is_skipped_and_counted_and_the_rest_of_its_batch_applied():
    blocks = EventBlocks(BS, name="r0")
    rejected: list[str] = []
    events = decode_batch(batch(stored([[1, 2]], None, PROMPT[:4]),          # a list where a hash belongs
                                stored([1], [9, 9], PROMPT[:4]),            # ... and as the parent
                                stored([b"x" * 65], None, PROMPT[:4]),      # a hash longer than any vLLM sends
                                stored([2], None, [2**40, 1, 2, 3]),        # a token no tokenizer has
                                stored([3], None, PROMPT[:4], lora_name=7),
                                stored([4], None, PROMPT[:4])), rejected)
    assert len(rejected) == 5 and "block_hashes" in rejected[0] and "parent_block_hash" in rejected[1]
    blocks.apply(0, events)
    assert list(blocks) == list(block_hashes(PROMPT[:4], BS))
    with pytest.raises(EventFormatError):           # strict without the list
        decode_batch(batch(stored([[1, 2]], None, PROMPT[:4])))


def test_a_batch_over_the_bounds_is_refused_whole(monkeypatch):
    from tokenfleet_serving.router import kv_events
    monkeypatch.setattr(kv_events, "MAX_EVENTS_PER_BATCH", 3)
    monkeypatch.setattr(kv_events, "MAX_BLOCKS_PER_BATCH", 5)
    with pytest.raises(kv_events.OversizeBatchError, match="4 events"):
        decode_batch(batch(*[removed([i]) for i in range(4)]))
    with pytest.raises(kv_events.OversizeBatchError, match="6 block hashes"):
        decode_batch(batch(removed([1, 2, 3]), removed([4, 5, 6])))
    blocks = EventBlocks(BS, name="r0")
    assert kv_events.read_batch(blocks, batch(*[removed([i]) for i in range(4)]), "test") is None
    assert blocks.rejected == {"message": 0, "event": 0, "oversize": 1}


def test_one_block_under_many_vllm_hashes_keeps_the_maps_as_small_as_the_record():
    """Fake hashes for one block's tokens (600k of them took 120 MB before): each replaces the last."""
    blocks = EventBlocks(BS, capacity=64, name="r0")
    for seq in range(200):
        blocks.apply(seq, decode_batch(batch(*[stored([seq * 100 + i], None, PROMPT[:4]) for i in range(100)])))
    assert len(blocks) == 1 and len(blocks.ours) == 1 and len(blocks.theirs) == 1
    assert blocks.ours == {19999: block_hashes(PROMPT[:4], BS)[0]}
    for seq in range(200, 260):                     # distinct blocks: the least recently stored go first
        blocks.apply(seq, decode_batch(batch(stored([seq], None, [seq, 1, 2, 3]))))
    assert len(blocks) == len(blocks.ours) == len(blocks.theirs) == 61
    blocks.apply(260, decode_batch(batch(*[stored([10**6 + i], None, [i, 7, 7, 7]) for i in range(100)])))
    assert len(blocks) == len(blocks.ours) == len(blocks.theirs) == 64


def test_a_replica_reporting_a_huge_cache_gets_a_record_of_at_most_max_recorded_blocks():
    from tokenfleet_serving.contract.router_files import DEFAULT_MAX_RECORDED_BLOCKS
    from tokenfleet_serving.router.state import EngineSample

    for raw, limit in (({}, DEFAULT_MAX_RECORDED_BLOCKS), ({"maxRecordedBlocks": 2048}, 2048)):
        config = parse_router_config({"kvBlockSize": BS, "prefixSource": "kvEvents", **raw})
        assert parse_router_config(router_config_json(config)) == config
        fleet = Fleet(config, runtime=RUNTIME[VLLM])
        fleet.set_endpoints([Endpoint("a", "127.0.0.1", 1, True)])
        fleet.record_poll("a", EngineSample(cache_blocks=10**9), None, None)
        b = fleet.backends["a"]
        assert b.events is not None and b.routed is not None
        assert b.events.capacity == b.routed.capacity == limit
        fleet.record_poll("a", EngineSample(cache_blocks=1500), None, None)
        assert b.events.capacity == 1500
    with pytest.raises(ConfigError, match="maxRecordedBlocks"):
        parse_router_config({"maxRecordedBlocks": 10})


def test_malformed_and_oversized_messages_leave_the_subscription_following(monkeypatch):
    """Over real ZeroMQ: a list where a hash belongs (which ended the subscription for good before), a message
    over zmq.MAXMSGSIZE (the connection is dropped and made again) and garbage; then a good batch still lands,
    and the skips show in the metric."""
    from prometheus_client import generate_latest

    from tokenfleet_serving.router import kv_events
    from tokenfleet_serving.router.metrics import RouterMetrics
    monkeypatch.setattr(kv_events, "MAX_MESSAGE_BYTES", 4096)
    config = parse_router_config({"kvBlockSize": BS, "prefixSource": "kvEvents"})
    fleet = Fleet(config, runtime=RUNTIME[VLLM])
    fleet.set_endpoints([Endpoint("r0", "127.0.0.1", 1, True)])
    blocks = fleet.backends["r0"].events
    assert blocks is not None

    async def scenario() -> None:
        pub = ReplayingPublisher()
        task = asyncio.ensure_future(follow(f"tcp://127.0.0.1:{pub.pub_port}", blocks))
        try:
            await publish_until(pub, batch(stored([1], [5, 6], PROMPT[:4]), stored([2], None, PROMPT[:4])),
                                lambda: blocks.batches > 0)
            await pub.publish(batch(stored([3], 2, PROMPT[4:8]), stored([4], 3, PROMPT[8:12]),
                                    stored([[7]], 4, PROMPT[12:16])))
            await until(lambda: len(blocks) == 3)
            await pub.publish(b"\x00" * 8192)                    # over MAXMSGSIZE: the connection is dropped
            await until(lambda: blocks.reconnects == 1)
            await publish_until(pub, b"\xc1", lambda: blocks.rejected["message"] > 0)     # not msgpack
            await publish_until(pub, batch(stored([5], 4, PROMPT[12:16])), lambda: len(blocks) == 4)
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await pub.close()

    asyncio.run(scenario())
    assert list(blocks) == list(block_hashes(PROMPT[:16], BS))
    assert blocks.rejected["event"] >= 2 and blocks.rejected["message"] >= 1
    text = generate_latest(RouterMetrics(fleet, tokenizer_loaded=True).registry).decode()
    assert 'tokenfleet_router_kv_event_rejected_total{backend="r0",reason="event"}' in text
