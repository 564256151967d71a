"""The router's two input files: one definition, used by the operator to write them and by the router to
read them.

``router.json`` (written by the operator into the router ConfigMap; a change rolls the router Deployment)::

    {"service": "llama", "namespace": "ns", "models": ["llama-8b"],
     "policy": "prefix-aware",                 # round-robin | least-load | prefix-aware | kv-aware
     "sessionAffinity": {"enabled": false, "header": "x-session-id", "ttlSeconds": 600},
     "kvBlockSize": 16, "modelPath": "/models/llama-8b",
     "price": {"perReplicaHour": 21.0, "currency": "USD"},
     "slo": {"timeToFirstTokenMs": 500, "timePerOutputTokenMs": 50, "percentile": 95},   # optional
     "scaleFromZero": {"maxPendingRequests": 64, "pendingTimeoutSeconds": 120},   # optional: hold requests
                                               # while no replica is ready, instead of answering 503 at once
     "loadFactor": 1.25, "loadSlack": 4, "kvUsageThreshold": 0.9,   # optional tuning (policy.py)
     "migrationLimit": 3,                      # optional: moves of one broken stream to another replica
     "noReplicaHoldSeconds": 30,               # optional: how long a request waits while no replica is ready
     "prefixSource": "routed", "kvEventsPort": 5557,   # optional, vLLM backends: which blocks a replica holds,
                                               # from the router's record of what it sent ("routed") or from
                                               # the replica's KV events ("kvEvents", router/kv_events.py)
     "kvEventsReplayPort": 5558,               # optional, with kvEvents: where a replica replays the batches
                                               # a router missed (absent: none are replayed)
     "maxRecordedBlocks": 131072,              # optional, vLLM backends: the most prompt blocks the router
                                               # records per replica (routed and KV-event records alike)
     "tiers": [{"name": "small", "model": "llama-1b", "maxPromptTokens": 512, "maxOutputTokens": 256},
               {"name": "large", "model": "llama-70b"}],   # optional difficulty tiers, cheapest first
     "route": {...}}                           # optional: route mode (a TokenRoute's router; route_files.py)

``endpoints.json`` (same ConfigMap, rewritten by the operator whenever the serving pods change, not part of
the config hash, re-read by the router)::

    [{"pod": "llama-0-0", "slice": "llama-0", "ip": "10.0.0.7", "port": 8000, "ready": true,
      "tier": "small",                                      # optional: "default"
      "draining": true}]                                    # optional: no new requests (a scale-down drains it)

``router_config_json`` and ``endpoints_json`` write them; ``parse_router_config`` and ``parse_endpoints``
read them back and refuse a key they do not know, so a key one side writes and the other ignores is an
error, not a silent drift. Every error names the file and the field.
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfleet_serving.contract.route_files import RouteConfig, parse_route, route_json

POLICIES = ("round-robin", "least-load", "prefix-aware", "kv-aware")
PREFIX_SOURCES = ("routed", "kvEvents")
DEFAULT_KV_EVENTS_PORT = 5557
# the most prompt blocks the router records per vLLM replica (what it routed there, what its KV events report),
# however large a cache the replica reports: about 0.5 KB of router memory each
DEFAULT_MAX_RECORDED_BLOCKS = 131072
DEFAULT_KV_EVENTS_REPLAY_PORT = 5558
DEFAULT_TIER = "default"


class ConfigError(ValueError):
    """A router input file is missing or malformed; the message names the file and field."""


@dataclass(frozen=True)
class Tier:
    """A model tier for difficulty routing; a request fits when it is within both limits (None: no limit)."""

    name: str
    model: str | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None


@dataclass(frozen=True)
class SessionAffinity:
    enabled: bool = False
    header: str = "x-session-id"
    ttl_seconds: float = 600.0


@dataclass(frozen=True)
class Slo:
    """Latency objectives of the service; the router counts the requests and tokens that met them."""

    ttft_ms: int | None = None
    tpot_ms: int | None = None
    percentile: float = 95.0


@dataclass(frozen=True)
class ScaleFromZero:
    """While no replica is ready, hold up to ``max_pending`` requests for up to ``timeout_s`` each (the operator
    brings a replica up) instead of answering 503 at once."""

    max_pending: int = 64
    timeout_s: float = 120.0

# The load bound of prefix-aware, kv-aware and session routing (router/policy.py), one default for the API, the
# file and the router. A cache miss of a long shared prompt costs a whole prefill, while a few more requests in a
# batch cost little: the slack lets a replica keep its prefix hits up to 4 requests above the relative bound. On
# W4 (`tokenfleet bench fleet`, 4 replicas, 16 clients) a slack of 1 sent 7 % of the requests away from their
# prefix, and its p95 TTFT was twice that of a bound that sent 0.9 % (docs/routing.md).
DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_LOAD_SLACK = 4


@dataclass(frozen=True)
class RouterConfig:
    service: str = "tokenfleet"
    namespace: str = ""
    models: tuple[str, ...] = ()
    policy: str = "prefix-aware"
    session_affinity: SessionAffinity = field(default_factory=SessionAffinity)
    kv_block_size: int = 16
    model_path: str | None = None
    price_per_replica_hour: float = 0.0
    currency: str = "USD"
    load_factor: float = DEFAULT_LOAD_FACTOR
    load_slack: int = DEFAULT_LOAD_SLACK
    kv_usage_threshold: float = 0.9
    tiers: tuple[Tier, ...] = (Tier(DEFAULT_TIER),)
    slo: Slo = field(default_factory=Slo)
    scale_from_zero: ScaleFromZero | None = None
    migration_limit: int = 3        # a stream cut mid-way moves to another replica at most this often (0: never)
    no_replica_hold_s: float = 30.0  # a request that finds no ready replica waits this long for one (0: 503 at once)
    route: RouteConfig | None = None  # route mode: a TokenRoute's router over other services' routers (route_files.py)
    prefix_source: str = "routed"   # vLLM backends: "routed" (the router's own record) or "kvEvents"
    kv_events_port: int = DEFAULT_KV_EVENTS_PORT   # where a vLLM replica publishes its KV events
    kv_events_replay_port: int | None = None       # where it replays past batches on request (None: it does not)
    max_recorded_blocks: int = DEFAULT_MAX_RECORDED_BLOCKS  # per replica, the routed and KV-event records each


@dataclass(frozen=True)
class Endpoint:
    pod: str
    ip: str
    port: int
    ready: bool
    slice: str = ""
    tier: str = DEFAULT_TIER
    draining: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}"


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


class _Fields:
    """Typed access to one JSON object, with errors that name the file and the field path."""

    def __init__(self, source: str, where: str, obj: Any):
        if not isinstance(obj, dict):
            raise ConfigError(f"{source}: {where or 'the document'} must be a JSON object")
        self.source, self.where, self.obj = source, where, obj

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: field '{self._name(key)}' {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None, *, required: bool = False) -> Any:
        if key not in self.obj or self.obj[key] is None:
            if required:
                raise self.fail(key, "is required")
            return default
        value = self.obj[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(key, f"must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        if float in kinds and isinstance(value, int):
            return float(value)
        if not isinstance(value, kinds):
            raise self.fail(key, f"must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
        return value

    def number(self, key: str, default: float, lo: float, hi: float) -> float:
        value = self.get(key, float, default)
        if not lo <= value <= hi:
            raise self.fail(key, f"must be in [{lo:g}, {hi:g}], got {value:g}")
        return value

    def optional_integer(self, key: str, lo: int, hi: int, *, required: bool = False) -> int | None:
        value = self.get(key, int, None, required=required)
        if value is not None and not lo <= value <= hi:
            raise self.fail(key, f"must be in [{lo}, {hi}], got {value}")
        return value

    def integer(self, key: str, default: int, lo: int, hi: int) -> int:
        value = self.optional_integer(key, lo, hi)
        return default if value is None else value

    def required_integer(self, key: str, lo: int, hi: int) -> int:
        value = self.optional_integer(key, lo, hi, required=True)
        assert value is not None
        return value

    def sub(self, key: str) -> _Fields:
        return _Fields(self.source, self._name(key), self.obj.get(key) or {})

    def only(self, *keys: str) -> None:
        """Refuse keys this reader does not know: a writer's key that nothing reads is drift."""
        unknown = sorted(set(self.obj) - set(keys))
        if unknown:
            raise ConfigError(f"{self.source}: unknown field(s) {', '.join(self._name(k) for k in unknown)}")


ROUTER_KEYS = ("service", "namespace", "models", "policy", "sessionAffinity", "kvBlockSize", "modelPath", "price",
               "slo", "scaleFromZero", "loadFactor", "loadSlack", "kvUsageThreshold", "tiers", "migrationLimit",
               "noReplicaHoldSeconds", "route", "prefixSource", "kvEventsPort", "kvEventsReplayPort",
               "maxRecordedBlocks")


def parse_router_config(data: Any, source: str = "router.json") -> RouterConfig:
    f = _Fields(source, "", data)
    f.only(*ROUTER_KEYS)
    policy = f.get("policy", str, "prefix-aware")
    if policy not in POLICIES:
        raise f.fail("policy", f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    models = f.get("models", list, [])
    if not all(isinstance(m, str) and m for m in models):
        raise f.fail("models", "must be a list of non-empty strings")
    sa = f.sub("sessionAffinity")
    sa.only("enabled", "header", "ttlSeconds")
    header = sa.get("header", str, "x-session-id")
    if not header:
        raise sa.fail("header", "must not be empty")
    price = f.sub("price")
    price.only("perReplicaHour", "currency")
    slo = f.sub("slo")
    slo.only("timeToFirstTokenMs", "timePerOutputTokenMs", "percentile")
    hold = f.sub("scaleFromZero")
    hold.only("maxPendingRequests", "pendingTimeoutSeconds")
    tiers_raw = f.get("tiers", list, [])
    tiers = []
    for i, raw in enumerate(tiers_raw):
        t = _Fields(source, f"tiers[{i}]", raw)
        t.only("name", "model", "maxPromptTokens", "maxOutputTokens")
        tiers.append(Tier(
            name=t.get("name", str, required=True),
            model=t.get("model", str),
            max_prompt_tokens=t.optional_integer("maxPromptTokens", 1, 2**31),
            max_output_tokens=t.optional_integer("maxOutputTokens", 1, 2**31),
        ))
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise f.fail("tiers", f"has duplicate names: {names}")
    model_path = f.get("modelPath", str)
    prefix_source = f.get("prefixSource", str, "routed")
    if prefix_source not in PREFIX_SOURCES:
        raise f.fail("prefixSource", f"must be one of {', '.join(PREFIX_SOURCES)}, got {prefix_source!r}")
    events_port = f.integer("kvEventsPort", DEFAULT_KV_EVENTS_PORT, 1, 65535)
    replay_port = f.optional_integer("kvEventsReplayPort", 1, 65535)
    if replay_port is not None and prefix_source != "kvEvents":
        raise f.fail("kvEventsReplayPort", "is read only with prefixSource kvEvents")
    if replay_port == events_port:
        raise f.fail("kvEventsReplayPort", f"must differ from kvEventsPort ({events_port})")
    return RouterConfig(
        service=f.get("service", str, "tokenfleet"),
        namespace=f.get("namespace", str, ""),
        models=tuple(models),
        policy=policy,
        session_affinity=SessionAffinity(
            enabled=sa.get("enabled", bool, False),
            header=header.lower(),
            ttl_seconds=sa.number("ttlSeconds", 600.0, 1, 86400 * 7),
        ),
        kv_block_size=f.integer("kvBlockSize", 16, 1, 4096),
        model_path=model_path or None,
        price_per_replica_hour=price.number("perReplicaHour", 0.0, 0, 1e7),
        currency=price.get("currency", str, "USD"),
        load_factor=f.number("loadFactor", DEFAULT_LOAD_FACTOR, 1.0, 100.0),
        load_slack=f.integer("loadSlack", DEFAULT_LOAD_SLACK, 0, 10000),
        kv_usage_threshold=f.number("kvUsageThreshold", 0.9, 0.0, 1.0),
        tiers=tuple(tiers) or (Tier(DEFAULT_TIER),),
        slo=Slo(
            ttft_ms=slo.optional_integer("timeToFirstTokenMs", 1, 600_000),
            tpot_ms=slo.optional_integer("timePerOutputTokenMs", 1, 60_000),
            percentile=slo.number("percentile", 95.0, 1e-9, 100.0),
        ),
        scale_from_zero=ScaleFromZero(
            max_pending=hold.integer("maxPendingRequests", 64, 1, 100_000),
            timeout_s=hold.number("pendingTimeoutSeconds", 120.0, 1.0, 3600.0),
        ) if "scaleFromZero" in f.obj else None,
        migration_limit=f.integer("migrationLimit", 3, 0, 100),
        no_replica_hold_s=f.number("noReplicaHoldSeconds", 30.0, 0.0, 3600.0),
        route=parse_route(f.sub("route")) if f.obj.get("route") is not None else None,
        prefix_source=prefix_source,
        kv_events_port=events_port,
        kv_events_replay_port=replay_port,
        max_recorded_blocks=f.integer("maxRecordedBlocks", DEFAULT_MAX_RECORDED_BLOCKS, 1024, 16 * 2**20),
    )


def parse_endpoints(data: Any, source: str = "endpoints.json") -> tuple[Endpoint, ...]:
    if not isinstance(data, list):
        raise ConfigError(f"{source}: must be a JSON list of endpoints")
    out: list[Endpoint] = []
    seen: set[str] = set()
    for i, raw in enumerate(data):
        f = _Fields(source, f"[{i}]", raw)
        f.only("pod", "slice", "ip", "port", "ready", "tier", "draining")
        pod = f.get("pod", str, required=True)
        if pod in seen:
            raise f.fail("pod", f"repeats pod {pod!r}")
        seen.add(pod)
        ip = f.get("ip", str, required=True)
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise f.fail("ip", f"must be an IP address, got {ip!r}") from None
        out.append(Endpoint(
            pod=pod,
            ip=ip,
            port=f.required_integer("port", 1, 65535),
            ready=f.get("ready", bool, False),
            slice=f.get("slice", str, ""),
            tier=f.get("tier", str, DEFAULT_TIER),
            draining=f.get("draining", bool, False),
        ))
    return tuple(out)


def load_router_config(path: str | Path) -> RouterConfig:
    path = Path(path)
    return parse_router_config(_read_json(path), str(path))


def load_endpoints(path: str | Path) -> tuple[Endpoint, ...]:
    path = Path(path)
    return parse_endpoints(_read_json(path), str(path))


# ---- writing ---------------------------------------------------------------------------------------
def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def router_config_json(c: RouterConfig) -> dict[str, Any]:
    """router.json as a JSON-able dict; ``parse_router_config`` of it gives ``c`` back."""
    out: dict[str, Any] = {
        "service": c.service, "namespace": c.namespace, "models": list(c.models), "policy": c.policy,
        "sessionAffinity": {"enabled": c.session_affinity.enabled, "header": c.session_affinity.header,
                            "ttlSeconds": c.session_affinity.ttl_seconds},
        "kvBlockSize": c.kv_block_size, "modelPath": c.model_path,
        "price": {"perReplicaHour": c.price_per_replica_hour, "currency": c.currency},
        "slo": _drop_none({"timeToFirstTokenMs": c.slo.ttft_ms, "timePerOutputTokenMs": c.slo.tpot_ms,
                           "percentile": c.slo.percentile}),
        "loadFactor": c.load_factor, "loadSlack": c.load_slack, "kvUsageThreshold": c.kv_usage_threshold,
        "migrationLimit": c.migration_limit, "noReplicaHoldSeconds": c.no_replica_hold_s,
    }
    if c.prefix_source != "routed" or c.kv_events_port != DEFAULT_KV_EVENTS_PORT:
        out["prefixSource"], out["kvEventsPort"] = c.prefix_source, c.kv_events_port
    if c.kv_events_replay_port is not None:
        out["kvEventsReplayPort"] = c.kv_events_replay_port
    if c.max_recorded_blocks != DEFAULT_MAX_RECORDED_BLOCKS:
        out["maxRecordedBlocks"] = c.max_recorded_blocks
    if c.scale_from_zero is not None:
        out["scaleFromZero"] = {"maxPendingRequests": c.scale_from_zero.max_pending,
                                "pendingTimeoutSeconds": c.scale_from_zero.timeout_s}
    if c.route is not None:
        out["route"] = route_json(c.route)
    if c.tiers != (Tier(DEFAULT_TIER),):
        out["tiers"] = [_drop_none({"name": t.name, "model": t.model, "maxPromptTokens": t.max_prompt_tokens,
                                    "maxOutputTokens": t.max_output_tokens}) for t in c.tiers]
    return _drop_none(out)


def endpoints_json(endpoints: list[Endpoint] | tuple[Endpoint, ...]) -> list[dict[str, Any]]:
    """endpoints.json as a JSON-able list, sorted by pod; ``parse_endpoints`` of it gives them back."""
    return [{"pod": e.pod, "slice": e.slice, "ip": e.ip, "port": e.port, "ready": e.ready}
            | ({"tier": e.tier} if e.tier != DEFAULT_TIER else {}) | ({"draining": True} if e.draining else {})
            for e in sorted(endpoints, key=lambda e: e.pod)]
