"""A vLLM replica's prefix cache as the replica itself reports it: its KV events (``prefixSource: kvEvents``).

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", ...}'`` publishes every change to its prefix cache on a ZeroMQ PUB socket, one message of three
frames per batch: the topic, a sequence number (8 bytes, big-endian) and a msgpack batch ``{ts, events,
data_parallel_rank}`` (a list in that order in older builds). Three kinds of event are read:

- ``BlockStored``: ``block_hashes`` (vLLM's, one per full block), ``parent_block_hash``, ``token_ids`` (the
  blocks' tokens, ``block_size`` each), ``lora_name`` (or only the deprecated ``lora_id``), ``medium`` and
  ``extra_keys`` (what else went into a block's hash: images, a cache salt);
- ``BlockRemoved``: ``block_hashes`` and ``medium``;
- ``AllBlocksCleared``.

vLLM's block hashes depend on its hash algorithm and seed, which the router does not share. So the router
keys the blocks by its own chained hash (``prefix.block_hashes``: the one it computes for every prompt), which
it computes from the event's tokens, chained from the router hash of the parent block, and keeps a map from
vLLM's hash to its own. A block whose hash took more than tokens (``extra_keys``), or whose parent the router
never saw stored, cannot be named that way and is left out, as are blocks of a lower tier (``medium`` other
than the accelerator's) and blocks of another size than the router's ``kvBlockSize`` (logged once).

The record is bounded like ``RoutedBlocks`` (the replica's ``num_gpu_blocks``, least recently stored first), so
that removals lost in transit age out. A sequence number lower than the last one means the replica's engine
restarted: the record is cleared.

**Replay.** ZeroMQ drops what a subscriber was not yet connected for and what overflows its queue, and vLLM
reports a block once, when it is stored. With ``kvEventsReplayPort`` (vLLM's ``replay_endpoint``, a ROUTER
socket that keeps the last ``buffer_steps`` batches) the router asks for what it lacks: a request is an empty
frame and the first sequence number wanted (8 bytes, big-endian); the answer is one ``[topic, seq, batch]``
per buffered batch from there on, then an end marker with sequence -1. It asks

- once when it starts following a replica, for the whole buffer: a router started after its replicas (a new
  router pod, a rollout) learns what they hold; the live batches that arrive meanwhile and the replay
  overlap, and the live ones the replay already gave are dropped;
- before the first live batch, if that start-up replay found nothing (the replica was not up yet);
- on a gap or a restart, for the missing batches, before the live one that showed it.

Batches the replica no longer keeps (or a replay that does not answer within ``REPLAY_TIMEOUT_S`` per
message) stay a counted gap.

**Bounds.** What a replica's sockets send is read as untrusted input (anyone who can bind or take over the
replica's address can send it), so that nothing it sends can stop the subscription or grow the router without
bound:

- ZeroMQ drops the connection of a peer that sends a message over ``MAX_MESSAGE_BYTES`` (``zmq.MAXMSGSIZE``; the
  subscription reconnects);
- a batch of more than ``MAX_EVENTS_PER_BATCH`` events or ``MAX_BLOCKS_PER_BATCH`` block hashes is skipped whole;
- a malformed event (a hash that is not an integer or a short byte string, tokens that are not integers, ...) is
  skipped and the rest of its batch applied; a message that is no batch at all is skipped;
- every skip is counted (``tokenfleet_router_kv_event_rejected_total{backend,reason}``, reason ``message``,
  ``event`` or ``oversize``) and logged (the first, then every 1000th), and the subscription goes on;
- the record holds at most ``capacity`` blocks (the replica's ``num_gpu_blocks``, at most router.json's
  ``maxRecordedBlocks``), each under one vLLM hash: a block stored again under another hash replaces the old
  one, so the maps between the two hashes are never larger than the record.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenfleet_serving.engine.block_pool import adapter_root_hash, hash_prefix_blocks
from tokenfleet_serving.router.backend_runtime import DEFAULT_RECORDED_BLOCKS, RoutedBlocks

log = logging.getLogger("tokenfleet.router.kv_events")

REPLAY_TIMEOUT_S = 2.0          # the longest wait for one message of a replay
REPLAY_YIELD_BATCHES = 64       # replayed batches applied between two turns of the event loop
MAX_MESSAGE_BYTES = 8 * 2**20   # zmq.MAXMSGSIZE of both sockets: a larger message drops the connection
MAX_EVENTS_PER_BATCH = 4096     # a batch with more events is skipped whole (reason oversize)
MAX_BLOCKS_PER_BATCH = 65536    # ... or with more block hashes over its events
MAX_HASH_BYTES = 64             # a vLLM block hash: an integer, or bytes (a string) of at most this many
REJECT_REASONS = ("message", "event", "oversize")

ACCELERATOR_MEDIA = (None, "GPU", "gpu", "cuda")   # vLLM calls its accelerator tier GPU on every device
# positional fields of the array-like encoding of older vLLM builds (after the tag)
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")


class EventFormatError(ValueError):
    """A message that is not a vLLM KV event batch (or an event that is not a KV event)."""


class OversizeBatchError(EventFormatError):
    """A batch over ``MAX_EVENTS_PER_BATCH`` events or ``MAX_BLOCKS_PER_BATCH`` block hashes."""


def _hash(value: Any, what: str) -> Any:
    """A vLLM block hash as sent: an integer, or bytes or a string of at most ``MAX_HASH_BYTES``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (bytes, str)) and len(value) <= MAX_HASH_BYTES:
        return value
    shown = f"{len(value)} bytes" if isinstance(value, (bytes, str)) else type(value).__name__
    raise EventFormatError(f"{what} must be an integer or at most {MAX_HASH_BYTES} bytes, got {shown}")


def _optional_str(fields: dict, key: str) -> str | None:
    value = fields.get(key)
    if value is not None and not isinstance(value, str):
        raise EventFormatError(f"{key} must be a string, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class KvEvent:
    kind: str                                   # BlockStored | BlockRemoved | AllBlocksCleared
    block_hashes: tuple[Any, ...] = ()
    parent_block_hash: Any = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    medium: str | None = None
    lora: str | None = None                     # the adapter's name; "#<id>" when only lora_id was sent
    extra_keys: tuple[Any, ...] | None = None


def _event(raw: Any) -> KvEvent | None:
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:]))
    else:
        raise EventFormatError(f"an event must be a map or a tagged array, got {type(raw).__name__}")
    if kind == "AllBlocksCleared":
        return KvEvent(kind)
    if kind not in ("BlockStored", "BlockRemoved"):
        return None                             # a kind this router does not read
    raw_hashes = fields.get("block_hashes")
    if not isinstance(raw_hashes, (list, tuple)):
        raise EventFormatError(f"{kind} has no block_hashes list")
    hashes = tuple(_hash(h, "block_hashes[]") for h in raw_hashes)
    medium = _optional_str(fields, "medium")
    if kind == "BlockRemoved":
        return KvEvent(kind, hashes, medium=medium)
    tokens = fields.get("token_ids")
    size = fields.get("block_size")
    if not isinstance(tokens, (list, tuple)) or not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise EventFormatError("BlockStored needs token_ids and a positive block_size")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens):
        raise EventFormatError("BlockStored's token_ids must be integers from 0 to 2^32 - 1")
    parent = fields.get("parent_block_hash")
    lora = _optional_str(fields, "lora_name")
    lora_id = fields.get("lora_id")
    if lora is None and lora_id is not None:
        if not isinstance(lora_id, int) or isinstance(lora_id, bool):
            raise EventFormatError(f"lora_id must be an integer, got {type(lora_id).__name__}")
        lora = f"#{lora_id}"
    extra = fields.get("extra_keys")
    return KvEvent(kind, hashes, None if parent is None else _hash(parent, "parent_block_hash"), tuple(tokens),
                   size, medium, lora, tuple(extra) if isinstance(extra, (list, tuple)) else None)


def decode_batch(payload: bytes, rejected: list[str] | None = None) -> list[KvEvent]:
    """The events of one published batch (msgpack), in order; kinds the router does not read are dropped. A
    malformed event raises EventFormatError, or with ``rejected`` is skipped and why appended there; a batch
    over the bounds raises OversizeBatchError."""
    import msgpack

    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for bad input
        raise EventFormatError(f"not msgpack: {exc}") from None
    if isinstance(batch, dict):
        events = batch.get("events")
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2:
        events = batch[1]
    else:
        raise EventFormatError("a batch must be a map with events or an array [ts, events, ...]")
    if not isinstance(events, (list, tuple)):
        raise EventFormatError("a batch's events must be a list")
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise OversizeBatchError(f"a batch of {len(events)} events (at most {MAX_EVENTS_PER_BATCH} are read)")
    out: list[KvEvent] = []
    for raw in events:
        try:
            event = _event(raw)
        except EventFormatError as exc:
            if rejected is None:
                raise
            rejected.append(str(exc))
            continue
        if event is not None:
            out.append(event)
    blocks = sum(len(e.block_hashes) for e in out)
    if blocks > MAX_BLOCKS_PER_BATCH:
        raise OversizeBatchError(f"a batch of {blocks} block hashes (at most {MAX_BLOCKS_PER_BATCH} are read)")
    return out


class EventBlocks(RoutedBlocks):
    """The router-hash blocks one vLLM replica holds in its accelerator tier, as its KV events tell."""

    def __init__(self, block_size: int, capacity: int = DEFAULT_RECORDED_BLOCKS, name: str = "",
                 routed: RoutedBlocks | None = None):
        super().__init__(capacity)
        self.block_size = block_size
        self.name = name
        # the router's record of what it routed to this replica, which the events correct: a block the replica
        # says it removed (or all of them, or a restart) leaves that record too
        self.routed = routed
        self.ours: dict[Any, str] = {}          # vLLM's hash -> the router's (hex)
        self.theirs: dict[str, Any] = {}        # and back, to forget both when one goes
        self.next_seq: int | None = None
        self.batches = 0                        # batches applied
        self.gaps = 0                           # batches missed (sequence numbers skipped)
        self.unnamed = 0                        # stored blocks the router could not key by its own hash
        self.restarts = 0
        self.replayed = 0                       # batches applied from a replay
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)   # messages, events and batches skipped, by why
        self.reconnects = 0                     # connections dropped and made again (follow)
        self._warned_size = False

    def reject(self, reason: str, why: str, source: str, count: int = 1) -> None:
        """Count (and log the first and every 1000th of) what was skipped from this replica's events."""
        before = sum(self.rejected.values())
        self.rejected[reason] += count
        if before == 0 or before // 1000 != (before + count) // 1000:
            log.warning("backend %s: skipped %d KV-event %s(s) from %s (%d skipped in all): %s", self.name, count,
                        "message" if reason == "message" else "batch" if reason == "oversize" else "event",
                        source, before + count, why)

    # ---- the record ----------------------------------------------------------------------------------------
    def trim(self) -> None:
        while len(self.blocks) > self.capacity:
            ours, _ = self.blocks.popitem(last=False)
            theirs = self.theirs.pop(ours, None)
            if theirs is not None:
                self.ours.pop(theirs, None)

    def clear(self) -> None:
        self.blocks.clear()
        self.ours.clear()
        self.theirs.clear()
        if self.routed is not None:
            self.routed.clear()

    def _forget(self, theirs: Any) -> None:
        ours = self.ours.pop(theirs, None)
        if ours is not None:
            self.theirs.pop(ours, None)
            self.blocks.pop(ours, None)
            if self.routed is not None:
                self.routed.discard(ours)

    def _store(self, e: KvEvent) -> None:
        if e.block_size != self.block_size:
            if not self._warned_size:
                log.warning("backend %s stores blocks of %d tokens but router.json says kvBlockSize %d: its KV "
                            "events cannot name prompt blocks", self.name, e.block_size, self.block_size)
                self._warned_size = True
            self.unnamed += len(e.block_hashes)
            return
        parent: bytes | None
        if e.parent_block_hash is None:
            # an adapter known only by vLLM's number (lora_id) has no root the router can name
            parent = None if (e.lora or "").startswith("#") else adapter_root_hash(e.lora)
        else:
            known = self.ours.get(e.parent_block_hash)
            parent = bytes.fromhex(known) if known is not None else None
        if len(e.token_ids) < len(e.block_hashes) * e.block_size:
            self.unnamed += len(e.block_hashes)
            return
        for i, theirs in enumerate(e.block_hashes):
            if parent is None or (e.extra_keys is not None and i < len(e.extra_keys) and e.extra_keys[i]):
                self.unnamed += len(e.block_hashes) - i
                return                          # this block and its children: hashed with more than tokens
            [digest] = hash_prefix_blocks(e.token_ids[i * e.block_size:(i + 1) * e.block_size], e.block_size,
                                          parent=parent)
            ours = digest.hex()
            self._forget(theirs)
            alias = self.theirs.get(ours)
            if alias is not None:               # the same block under another vLLM hash: that one goes
                self.ours.pop(alias, None)
            self.ours[theirs] = ours
            self.theirs[ours] = theirs
            self.add((ours,))
            parent = digest

    def catch_up_from(self, seq: int) -> int | None:
        """The first sequence number to ask a replay for before applying live batch ``seq``, or None when
        nothing is missing: all of the replica's history when this is the first batch seen or its engine
        restarted, the skipped ones on a gap."""
        if self.next_seq is None or seq < self.next_seq:
            return 0 if seq > 0 else None
        return self.next_seq if seq > self.next_seq else None

    def apply(self, seq: int, events: Sequence[KvEvent]) -> None:
        """Apply one batch with its sequence number."""
        if self.next_seq is not None and seq < self.next_seq:
            log.info("backend %s: KV event sequence went back from %d to %d (its engine restarted): "
                     "its record starts again", self.name, self.next_seq - 1, seq)
            self.clear()
            self.restarts += 1
        elif self.next_seq is not None and seq > self.next_seq:
            self.gaps += seq - self.next_seq
        self.next_seq = seq + 1
        self.batches += 1
        if self.batches == 1:
            log.info("backend %s: following its KV events (sequence %d)", self.name, seq)
        for e in events:
            if e.kind == "AllBlocksCleared":
                self.clear()
            elif e.medium not in ACCELERATOR_MEDIA:
                continue                        # a lower tier's blocks: not what the scorer weighs here
            elif e.kind == "BlockStored":
                self._store(e)
            else:
                for theirs in e.block_hashes:
                    self._forget(theirs)


def _sequence(frames: Sequence[bytes]) -> int:
    if len(frames) != 3 or len(frames[1]) != 8:
        raise EventFormatError(f"a message must be [topic, seq(8 bytes), batch], got {len(frames)} frames")
    return int.from_bytes(frames[1], "big", signed=True)


async def fetch_replay(address: str, start: int, until: int | None = None,
                       timeout_s: float = REPLAY_TIMEOUT_S) -> tuple[list[tuple[int, bytes]], bool]:
    """The batches a replica's replay socket (``tcp://ip:port``) still keeps from sequence ``start`` on, below
    ``until`` if given: ``([(seq, batch), ...], complete)``; ``complete`` is False when it stopped answering
    before its end marker, or sent something that is not a batch (what came before is kept). A socket of its
    own per replay, so that a late answer to one that timed out cannot mix with the next."""
    import zmq

    sock = _bounded_socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 0)              # a whole buffer may come at once: queue it, drop none
    sock.connect(address)
    batches: list[tuple[int, bytes]] = []
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        while await sock.poll(timeout_s * 1000):
            frames = await sock.recv_multipart()
            try:
                seq = _sequence(frames[1:] if frames and frames[0] == b"" else frames)
            except EventFormatError as exc:
                log.warning("a KV-event replay from %s sent a message that is not a batch: %s", address, exc)
                return batches, False
            if seq < 0:
                return batches, True
            if seq >= start and (until is None or seq < until):
                batches.append((seq, frames[-1]))
        return batches, False
    finally:
        sock.close(linger=0)


def read_batch(blocks: EventBlocks, payload: bytes, source: str) -> list[KvEvent] | None:
    """The readable events of one batch, what was skipped counted on ``blocks``; None: skip the whole batch."""
    rejected: list[str] = []
    try:
        events = decode_batch(payload, rejected)
    except OversizeBatchError as exc:
        blocks.reject("oversize", str(exc), source)
        return None
    except EventFormatError as exc:
        blocks.reject("message", str(exc), source)
        return None
    if rejected:
        blocks.reject("event", rejected[0], source, len(rejected))
    return events


def _bounded_socket(kind: int) -> Any:
    import zmq
    import zmq.asyncio

    sock = zmq.asyncio.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    return sock


async def catch_up(address: str, blocks: EventBlocks, start: int, until: int | None = None) -> None:
    """Apply what the replica replays from ``start`` (below ``until``) to its record."""
    batches, complete = await fetch_replay(address, start, until)
    if not complete:
        log.info("backend %s: its KV-event replay (%s) stopped answering after %d batch(es)", blocks.name,
                 address, len(batches))
    if batches and blocks.next_seq is None:
        blocks.gaps += batches[0][0] - start    # history the replica no longer keeps
    for i, (seq, payload) in enumerate(batches):
        if i % REPLAY_YIELD_BATCHES == REPLAY_YIELD_BATCHES - 1:
            await asyncio.sleep(0)              # a whole buffer is thousands of batches: let requests be routed
        events = read_batch(blocks, payload, f"{address} (replayed batch {seq})")
        if events is None:
            continue
        blocks.apply(seq, events)
        blocks.replayed += 1


async def follow(address: str, blocks: EventBlocks, topic: bytes = b"",
                 on_error: Callable[[str], None] | None = None, replay_address: str | None = None) -> None:
    """Subscribe to one replica's publisher (``tcp://ip:port``) and apply its batches until cancelled, asking
    its replay socket for what is missing (module doc). ZeroMQ connects (and reconnects) in the background, so
    a replica that is not publishing yet is no error. Nothing a replica sends ends it: what cannot be read is
    skipped and counted (``EventBlocks.reject``); ``on_error`` is told of each message that is not
    ``[topic, seq, batch]``. ZeroMQ does not reconnect a connection it dropped for a message over
    ``MAX_MESSAGE_BYTES``: a dropped connection is followed again on a new socket (the next batch's gap is
    then asked of the replay socket)."""
    import zmq

    snapshot: int | None = None                 # live batches below this one came with the start-up replay
    first = True
    while True:
        sock = _bounded_socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)                   # first, so that what is published during the replay queues here
        try:
            if first and replay_address is not None:
                await catch_up(replay_address, blocks, 0)
                snapshot = blocks.next_seq
            first = False
            snapshot = await _follow_connection(sock, monitor, address, blocks, on_error, replay_address, snapshot)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        blocks.reconnects += 1
        log.info("backend %s: its KV-event connection (%s) was dropped (the replica went away, or sent a message "
                 "over %d bytes): following it again", blocks.name, address, MAX_MESSAGE_BYTES)


async def _follow_connection(sock: Any, monitor: Any, address: str, blocks: EventBlocks,
                             on_error: Callable[[str], None] | None, replay_address: str | None,
                             snapshot: int | None) -> int | None:
    """Read one socket's batches until its connection drops; returns the snapshot bound still in force."""
    import zmq
    import zmq.asyncio

    poller = zmq.asyncio.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    dropped = False
    while True:
        ready = dict(await poller.poll())
        if monitor in ready:
            await monitor.recv_multipart()      # EVENT_DISCONNECTED: read what came before it, then go
            dropped = True
        if sock not in ready and not (dropped and await sock.poll(0)):
            if dropped:
                return snapshot
            continue
        frames = await sock.recv_multipart()
        try:
            seq = _sequence(frames)
        except EventFormatError as exc:
            blocks.reject("message", str(exc), address)
            if on_error is not None:
                on_error(str(exc))
            continue
        if snapshot is not None and seq < snapshot:
            continue
        snapshot = None
        await _apply_live(blocks, seq, frames[2], address, replay_address)


async def _apply_live(blocks: EventBlocks, seq: int, payload: bytes, address: str,
                      replay_address: str | None) -> None:
    """One live batch: what is missing before it asked for first; a failure of the router's own code on a batch
    (a bug, or input the checks above let through) is logged and counted, and the next batch is read."""
    try:
        events = read_batch(blocks, payload, address)
        if events is None:
            return
        start = blocks.catch_up_from(seq) if replay_address is not None else None
        if start is not None and replay_address is not None:
            await catch_up(replay_address, blocks, start, seq)
        blocks.apply(seq, events)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the subscription must outlive any one batch
        log.exception("backend %s: applying KV-event batch %d from %s failed", blocks.name, seq, address)
        blocks.reject("message", f"{type(exc).__name__}: {exc}", address)


class Subscriptions:
    """One ``follow`` task per backend, started and cancelled as the endpoint list changes."""

    def __init__(self, port: int, topic: str = "", replay_port: int | None = None):
        self.port = port
        self.replay_port = replay_port
        self.topic = topic.encode()
        self.tasks: dict[int, tuple[asyncio.Task, EventBlocks]] = {}

    def sync(self, backends: Iterable[tuple[str, str, EventBlocks]]) -> None:
        """``backends``: (name, ip, its EventBlocks). A backend's record object identifies it: a new pod (or a
        new address) gets a new record and a new subscription."""
        wanted = {id(blocks): (name, ip, blocks) for name, ip, blocks in backends}
        for key in [k for k in self.tasks if k not in wanted]:
            self.tasks.pop(key)[0].cancel()
        for key, (_name, ip, blocks) in wanted.items():
            if key not in self.tasks:
                host = f"[{ip}]" if ":" in ip else ip
                replay = f"tcp://{host}:{self.replay_port}" if self.replay_port is not None else None
                task = asyncio.ensure_future(follow(f"tcp://{host}:{self.port}", blocks, self.topic,
                                                    replay_address=replay))
                self.tasks[key] = (task, blocks)

    async def close(self) -> None:
        for task, _ in self.tasks.values():
            task.cancel()
        await asyncio.gather(*(t for t, _ in self.tasks.values()), return_exceptions=True)
        self.tasks.clear()
