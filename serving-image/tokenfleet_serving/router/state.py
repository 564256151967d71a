"""What the router knows about each backend, kept fresh by polling.

Every ``interval`` seconds (default 0.5) the poller fetches each listed
endpoint's ``/metrics`` (vLLM names: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:generation_tokens_total``; ``tokenfleet:ready`` when present) and
``/cache/blocks`` (the engine's cached block hashes; a vLLM replica has none: the router keeps its own record
of the blocks it sent there, ``backend_runtime.RoutedBlocks``, or with ``prefixSource: kvEvents`` follows the
replica's KV events, ``kv_events.EventBlocks``, together with the routed record, which the events correct).
Between polls the router
adds the blocks of requests it has just routed to the chosen backend's set for
a few seconds, so a burst of requests sharing a new prefix sticks together
before the next poll can show the prefix as cached.

A backend is routable when its pod is Ready (endpoints.json), it was polled
successfully once, it showed a sign of life less than ``stale_after`` seconds
ago (a successful poll, or bytes of a response the router is relaying from
it: a busy replica whose polls time out while it streams tokens is alive), it
does not report ``tokenfleet:ready 0`` (draining), and no connection to it has
failed since its last good poll.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace

from tokenfleet_serving.contract.lora_adapters import ADAPTER_ROOT_METRIC
from tokenfleet_serving.contract.router_files import Endpoint, RouterConfig
from tokenfleet_serving.router.backend_runtime import DEFAULT_RECORDED_BLOCKS, RUNTIME, TOKENFLEET, VLLM, BackendRuntime, RoutedBlocks
from tokenfleet_serving.router.kv_events import EventBlocks
from tokenfleet_serving.router.policy import BackendView

log = logging.getLogger("tokenfleet.router.state")

RECENT_TTL_S = 5.0
# the load signals the router reads from a replica's /metrics; without them it routes by its own open requests
LOAD_SIGNALS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@dataclass(frozen=True)
class EngineSample:
    """The numbers the router reads from one scrape of a backend's /metrics."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    generation_tokens: float | None = None  # cumulative counter; None: not exported
    ready: bool | None = None               # tokenfleet:ready; None: not exported (another server)
    adapters: frozenset[str] = frozenset()  # LoRA adapters in memory (tokenfleet:lora_adapter_loaded == 1)
    served_adapters: frozenset[str] = frozenset()   # every LoRA adapter it serves (in memory or not)
    signals: frozenset[str] = frozenset(LOAD_SIGNALS)  # which of LOAD_SIGNALS the text had
    cache_blocks: int | None = None         # vllm:cache_config_info's num_gpu_blocks: the KV cache's size
    block_size: int | None = None           # vllm:cache_config_info's block_size
    adapter_roots: tuple[tuple[str, str], ...] = ()   # (adapter, hex root its blocks chain from), if exported

    @property
    def load(self) -> int:
        return int(round(self.running + self.waiting))


def parse_engine_metrics(text: str) -> EngineSample:
    """Parse Prometheus text; values are summed over label sets (several engines in one server)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = collections.defaultdict(float)
    seen: set[str] = set()
    adapters: set[str] = set()
    served: set[str] = set()
    cache_info: dict[str, str] = {}
    roots: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            seen.add(s.name)
            sums[s.name] += s.value
            if s.name == "vllm:cache_config_info" and not cache_info:
                cache_info = dict(s.labels)
            if s.name == "tokenfleet:lora_adapter_loaded" and "adapter" in s.labels:
                served.add(s.labels["adapter"])
                if s.value > 0:
                    adapters.add(s.labels["adapter"])
            if s.name == ADAPTER_ROOT_METRIC and "adapter" in s.labels and _is_root(s.labels.get("root", "")):
                roots[s.labels["adapter"]] = s.labels["root"]
    gen = "vllm:generation_tokens_total"
    if gen not in seen and "vllm:generation_tokens" in seen:
        gen = "vllm:generation_tokens"
    return EngineSample(
        running=sums["vllm:num_requests_running"],
        waiting=sums["vllm:num_requests_waiting"],
        kv_usage=min(1.0, max(0.0, sums["vllm:kv_cache_usage_perc"])),
        generation_tokens=sums[gen] if gen in seen else None,
        ready=(sums["tokenfleet:ready"] > 0) if "tokenfleet:ready" in seen else None,
        adapters=frozenset(adapters),
        served_adapters=frozenset(served),
        signals=frozenset(n for n in LOAD_SIGNALS if n in seen),
        cache_blocks=_label_int(cache_info, "num_gpu_blocks"),
        block_size=_label_int(cache_info, "block_size"),
        adapter_roots=tuple(sorted(roots.items())),
    )


def _is_root(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _label_int(labels: dict[str, str], key: str) -> int | None:
    try:
        value = int(labels[key])
    except (KeyError, ValueError):
        return None
    return value if value > 0 else None


class CounterRate:
    """Per-second rate of a cumulative counter over a sliding window; a counter reset starts over."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.samples: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, t: float, value: float) -> None:
        if self.samples and value < self.samples[-1][1]:
            self.samples.clear()  # the backend restarted
        self.samples.append((t, value))
        while len(self.samples) > 2 and self.samples[1][0] <= t - self.window_s:
            self.samples.popleft()

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self.samples[0], self.samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


class _EitherView:
    """The blocks a replica's KV events report, or the router routed there (without copying either)."""

    def __init__(self, events: EventBlocks, routed: RoutedBlocks):
        self.events, self.routed = events, routed

    def __contains__(self, h: object) -> bool:
        return h in self.events or h in self.routed

    def __iter__(self) -> Iterator[str]:
        yield from self.events
        yield from (h for h in self.routed if h not in self.events)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _CachedView:
    """Polled block hashes plus recently routed ones, without copying the polled set."""

    def __init__(self, polled: frozenset[str], recent: dict[str, float], now: float):
        self.polled, self.recent, self.now = polled, recent, now

    def __contains__(self, h: object) -> bool:
        return h in self.polled or (h in self.recent and self.recent[h] > self.now)  # type: ignore[operator]

    def __iter__(self) -> Iterator[str]:
        yield from self.polled
        yield from (h for h, exp in self.recent.items() if exp > self.now and h not in self.polled)

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass
class BackendState:
    endpoint: Endpoint
    sample: EngineSample | None = None
    cached: frozenset[str] = frozenset()
    host_cached: frozenset[str] = frozenset()     # its host tier's blocks (KV offload)
    disk_cached: frozenset[str] = frozenset()     # its disk tier's blocks
    block_size: int | None = None
    polled_at: float | None = None      # monotonic time of the last good poll
    seen_at: float | None = None        # monotonic time response bytes last arrived from it
    last_error: str | None = None
    failed: bool = False                # a connection failed since the last good poll
    inflight: int = 0                   # requests this router has open to it
    listed_ready: bool = False          # endpoints.json has called this pod ready at some time
    recent: dict[str, float] = field(default_factory=dict)
    tokens: CounterRate = field(default_factory=CounterRate)
    routed: RoutedBlocks | None = None  # the router's record of the blocks it sent here (runtimes without
                                        # /cache/blocks)
    events: EventBlocks | None = None   # the blocks its KV events say it holds (prefixSource: kvEvents)
    max_model_len: int | None = None    # from /v1/models (vLLM): the continuation's token budget
    missing_logged: frozenset[str] | None = None   # the load signals it was last logged to lack

    @property
    def name(self) -> str:
        return self.endpoint.pod

    def load(self) -> int:
        polled = self.sample.load if self.sample else 0
        return max(polled, self.inflight)

    def cached_view(self, now: float) -> Collection[str]:
        """The blocks the policy may count on this backend holding. A vLLM replica: what its KV events report,
        or the router routed there and the events did not say is gone (a router started after its replicas hears no
        event of the prefixes they hold all along, and learns them as it routes); the routed record alone
        without events. The bundled engine: its polled /cache/blocks, with the blocks just routed there
        (``recent``) on top."""
        if self.events is not None and self.routed is not None:
            return _EitherView(self.events, self.routed)
        if self.routed is not None:
            return self.routed
        return _CachedView(self.cached, self.recent, now) if self.recent else self.cached

    def cached_blocks(self) -> int:
        """How many prompt blocks the router believes it holds, whichever source says so (the polled ones only,
        for the bundled engine: not the blocks just routed there)."""
        return len(self.cached) if self.routed is None else len(self.cached_view(0.0))


MAX_SESSIONS = 50_000          # session keys remembered at once; the least recently used goes first
MAX_SESSION_KEY_CHARS = 256    # longer session ids are refused (app.py: 400 naming the header)
HASHED_KEY_OVER = 64           # longer keys are kept as a 32-character digest


def session_key(value: str) -> str:
    """The key a session id is remembered by: itself, or a digest of it when it is long."""
    if len(value) <= HASHED_KEY_OVER:
        return value
    return "#" + hashlib.blake2b(value.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()


class SessionTable:
    """Session key -> (backend, last use), bounded: entries idle for ttl seconds are forgotten, and past
    ``max_entries`` the least recently used one is. Long keys are kept as digests (``session_key``), so
    the table holds at most ``max_entries`` keys of at most ``HASHED_KEY_OVER`` characters."""

    def __init__(self, ttl_s: float, max_entries: int = MAX_SESSIONS):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.entries: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self.evicted = 0               # entries dropped for room (not for age)

    def pinned(self, key: str, now: float) -> str | None:
        self._expire(now)
        entry = self.entries.get(session_key(key))
        return entry[0] if entry else None

    def pin(self, key: str, backend: str, now: float) -> None:
        key = session_key(key)
        self.entries[key] = (backend, now)
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)
            self.evicted += 1

    def _expire(self, now: float) -> None:
        while self.entries:
            key, (_, last) = next(iter(self.entries.items()))
            if now - last < self.ttl_s:
                break
            self.entries.popitem(last=False)


class Fleet:
    """All backends of the service, keyed by pod name."""

    def __init__(self, config: RouterConfig, *, interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 max_sessions: int = MAX_SESSIONS, runtime: BackendRuntime = RUNTIME[TOKENFLEET]):
        self.config = config
        self.runtime = runtime
        self.interval_s = interval_s
        self.stale_after_s = max(3 * interval_s, 3.0)
        self.clock = clock
        self.backends: dict[str, BackendState] = {}
        self.sessions = SessionTable(config.session_affinity.ttl_seconds, max_sessions)
        self.endpoints_loaded = False
        if config.prefix_source == "kvEvents" and runtime.name != VLLM:
            raise ValueError(f"prefixSource kvEvents reads vLLM's KV events; the {runtime.name} runtime's replicas "
                             "report their blocks on /cache/blocks")
        self.uses_kv_events = config.prefix_source == "kvEvents"

    # ---- endpoints -------------------------------------------------------------------------
    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Adopt a new endpoint list; a pod whose address did not change keeps its polled state."""
        fresh: dict[str, BackendState] = {}
        for ep in endpoints:
            old = self.backends.get(ep.pod)
            if old is not None and (old.endpoint.ip, old.endpoint.port) == (ep.ip, ep.port):
                old.endpoint = ep
                old.listed_ready = old.listed_ready or ep.ready
                fresh[ep.pod] = old
            else:
                first = min(DEFAULT_RECORDED_BLOCKS, self.config.max_recorded_blocks)
                routed = RoutedBlocks(first) if self.runtime.records_routed_blocks else None
                fresh[ep.pod] = BackendState(
                    ep, listed_ready=ep.ready, routed=routed,
                    events=EventBlocks(self.config.kv_block_size, first, name=ep.pod, routed=routed)
                    if self.uses_kv_events else None)
        self.backends = fresh
        self.endpoints_loaded = True

    # ---- polling results ---------------------------------------------------------------------
    def record_poll(self, name: str, sample: EngineSample, cached: frozenset[str] | None,
                    block_size: int | None, lower: tuple[frozenset[str], frozenset[str]] | None = None) -> None:
        b = self.backends.get(name)
        if b is None:
            return
        now = self.clock()
        self._note_signals(b, sample)
        if self.runtime.metrics_mean_ready and sample.ready is None and sample.signals:
            sample = replace(sample, ready=True)   # its HTTP server, /metrics included, starts after the engine
        if sample.block_size is not None and block_size is None:
            block_size = sample.block_size
        if sample.cache_blocks is not None:     # as large as its cache, at most maxRecordedBlocks
            capacity = min(sample.cache_blocks, self.config.max_recorded_blocks)
            for record in (b.routed, b.events):
                if record is not None and capacity != record.capacity:
                    record.resize(capacity)
        b.sample, b.polled_at, b.failed, b.last_error = sample, now, False, None
        if cached is not None:
            b.cached = cached
            b.host_cached, b.disk_cached = lower if lower is not None else (frozenset(), frozenset())
            b.recent = {h: exp for h, exp in b.recent.items() if exp > now and h not in cached}
        if block_size is not None and block_size != b.block_size:
            b.block_size = block_size
            if block_size != self.config.kv_block_size:
                log.warning("backend %s reports block size %d but router.json says kvBlockSize %d: "
                            "prefix hits on it cannot be seen", name, block_size, self.config.kv_block_size)
        if sample.generation_tokens is not None:
            b.tokens.add(now, sample.generation_tokens)

    @staticmethod
    def _note_signals(b: BackendState, sample: EngineSample) -> None:
        """Log once (and again when it changes) which load signals a backend's /metrics lacks."""
        missing = frozenset(LOAD_SIGNALS) - sample.signals
        if missing == (b.missing_logged or frozenset()):
            return
        if missing:
            log.warning("backend %s: its /metrics has no %s: routing it by this router's own open requests%s",
                        b.name, ", ".join(sorted(missing)),
                        "" if missing != frozenset(LOAD_SIGNALS) else " (it speaks neither runtime's metrics)")
        elif b.missing_logged:
            log.info("backend %s: its /metrics has every load signal again", b.name)
        b.missing_logged = missing

    def record_poll_failure(self, name: str, error: str) -> None:
        b = self.backends.get(name)
        if b is not None:
            if b.last_error != error:
                log.info("backend %s: %s", name, error)
            b.last_error, b.failed = error, True

    def note_alive(self, name: str) -> None:
        """Bytes of a response arrived from the backend: it is alive even if its polls time out."""
        b = self.backends.get(name)
        if b is not None:
            b.seen_at = self.clock()

    def stalled(self, name: str, timeout_s: float) -> bool:
        """No byte of any response from the backend and no good poll for ``timeout_s``: it is frozen (a stopped
        process, a hung node) or cut off, though its connections stay open."""
        b = self.backends.get(name)
        if b is None or b.polled_at is None:
            return False
        return self.clock() - max(b.polled_at, b.seen_at or b.polled_at) > timeout_s

    def mark_failed(self, name: str, error: str) -> None:
        """A request could not reach the backend: stop routing to it until a poll succeeds again."""
        self.record_poll_failure(name, error)

    # ---- routing inputs ------------------------------------------------------------------------
    def is_routable(self, b: BackendState) -> bool:
        now = self.clock()
        if b.polled_at is None:
            return False
        last_sign_of_life = max(b.polled_at, b.seen_at or b.polled_at)
        # Ready by the pod's condition (endpoints.json); a new pod, never listed ready yet, also by its own
        # tokenfleet:ready as polled: a kubelet updates a mounted ConfigMap up to a minute after the pod turned
        # Ready, and the replica says so at once. A pod listed ready before and not ready now (its node lost,
        # say) waits for the list. The replica's own "not ready" (starting, draining) always wins.
        ready = b.endpoint.ready or (not b.listed_ready and b.sample is not None and b.sample.ready is True)
        return (ready and not b.endpoint.draining and not b.failed
                and now - last_sign_of_life <= self.stale_after_s
                and (b.sample is None or b.sample.ready is not False))

    def routable(self, tier: str | None = None) -> list[BackendState]:
        return [b for b in self.backends.values()
                if self.is_routable(b) and (tier is None or b.endpoint.tier == tier)]

    def tiers_available(self) -> set[str]:
        return {b.endpoint.tier for b in self.routable()}

    def views(self, tier: str | None, exclude: set[str] = frozenset()) -> list[BackendView]:
        now = self.clock()
        return [BackendView(b.name, b.load(), b.sample.kv_usage if b.sample else 0.0, b.cached_view(now),
                            b.sample.adapters if b.sample else frozenset(), b.host_cached, b.disk_cached)
                for b in self.routable(tier) if b.name not in exclude]

    def serves_adapter(self, model: object) -> bool:
        """Whether ``model`` is a LoRA adapter some routable backend serves."""
        return isinstance(model, str) and any(b.sample is not None and model in b.sample.served_adapters
                                              for b in self.routable())

    def adapter_root(self, model: str | None) -> bytes | None:
        """The root a request for the LoRA adapter ``model`` chains its blocks from, as the routable backends
        report it (the one most of them report; None when none does: the router then hashes from the name)."""
        if model is None:
            return None
        votes = collections.Counter(root for b in self.routable() if b.sample is not None
                                    for name, root in b.sample.adapter_roots if name == model)
        return bytes.fromhex(votes.most_common(1)[0][0]) if votes else None

    def note_routed(self, name: str, block_hashes: Sequence[str]) -> None:
        b = self.backends.get(name)
        if b is None or not block_hashes:
            return
        if b.routed is not None:
            b.routed.add(block_hashes)
            return
        expiry = self.clock() + RECENT_TTL_S
        for h in block_hashes:
            if h not in b.cached:
                b.recent[h] = expiry

    # ---- cost ------------------------------------------------------------------------------------
    def generation_tokens_per_second(self) -> float:
        now = self.clock()
        return sum(b.tokens.rate() for b in self.backends.values()
                   if b.polled_at is not None and now - b.polled_at <= self.stale_after_s)


async def poll_backend(session, fleet: Fleet, b: BackendState, api_key: str | None, timeout_s: float) -> None:
    """One poll of one backend: /metrics and /cache/blocks, concurrently."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    base = b.endpoint.url

    async def get_metrics() -> EngineSample:
        async with session.get(f"{base}/metrics", timeout=timeout) as r:
            if r.status in (404, 405):      # a server without /metrics: it lives, and is routed by own counts
                return EngineSample(signals=frozenset())
            if r.status != 200:
                raise RuntimeError(f"/metrics answered {r.status}")
            try:
                return parse_engine_metrics(await r.text())
            except ValueError:              # not Prometheus text
                return EngineSample(signals=frozenset())

    async def get_blocks() -> tuple[frozenset[str] | None, int | None, tuple[frozenset[str], frozenset[str]]]:
        if not fleet.runtime.polls_cache_blocks:
            return None, None, (frozenset(), frozenset())
        async with session.get(f"{base}/cache/blocks", headers=headers, timeout=timeout) as r:
            if r.status in (403, 404, 503):  # closed to us (a server without --api-key), another server,
                return None, None, (frozenset(), frozenset())   # or the model is still loading: no cache
            if r.status != 200:
                raise RuntimeError(f"/cache/blocks answered {r.status}")
            body = await r.json()
            hashes = body.get("block_hashes") if isinstance(body, dict) else None
            if not isinstance(hashes, list):
                raise RuntimeError("/cache/blocks has no block_hashes list")
            size = body.get("block_size")
            lower = tuple(frozenset(h for h in (body.get(key) or []) if isinstance(h, str))
                          for key in ("host_block_hashes", "disk_block_hashes"))
            return (frozenset(h for h in hashes if isinstance(h, str)), size if isinstance(size, int) else None,
                    (lower[0], lower[1]))

    try:
        sample, (cached, block_size, lower) = await asyncio.gather(get_metrics(), get_blocks())
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        # a slow answer (a busy node) is not a failed backend: keep routing on the last poll until it is
        # older than stale_after, or longer while responses still stream from it (note_alive); a refused or
        # broken connection below takes the backend out at once
        log.debug("backend %s: poll timed out", b.name)
        return
    except Exception as exc:
        if fleet.backends.get(b.name) is b:
            fleet.record_poll_failure(b.name, f"poll failed: {type(exc).__name__}: {exc}")
        return
    if fleet.backends.get(b.name) is b:  # not replaced by a new pod of the same name meanwhile
        fleet.record_poll(b.name, sample, cached, block_size, lower)
        if fleet.runtime.name == VLLM and b.max_model_len is None:
            b.max_model_len = await _max_model_len(session, base, headers, timeout)


async def _max_model_len(session, base: str, headers: dict[str, str], timeout) -> int | None:
    """A vLLM replica's context length, from its /v1/models (None when it does not say)."""
    try:
        async with session.get(f"{base}/v1/models", headers=headers, timeout=timeout) as r:
            body = await r.json() if r.status == 200 else None
    except Exception:  # noqa: BLE001 - asked again at the next poll
        return None
    for entry in (body or {}).get("data") or []:
        if isinstance(entry, dict) and isinstance(entry.get("max_model_len"), int):
            return int(entry["max_model_len"])
    return None


async def poll_forever(session, fleet: Fleet, api_key: str | None = None) -> None:
    while True:
        started = fleet.clock()
        backends = list(fleet.backends.values())
        if backends:
            await asyncio.gather(*(poll_backend(session, fleet, b, api_key, max(1.0, 2 * fleet.interval_s))
                                   for b in backends))
        await asyncio.sleep(max(0.05, fleet.interval_s - (fleet.clock() - started)))
