"""Route mode of the router (a TokenRoute's router): the ``route`` section of ``router.json`` and the
``targets.json`` file next to it. One definition for the operator, which writes them, and the router, which
reads them; a key one side does not know is an error naming the file and the field.

``router.json`` of a route (``models`` is the one public model name)::

    {"service": "chat", "namespace": "ns", "models": ["chat"], "policy": "least-load",
     "route": {"policy": "difficulty",                        # difficulty | cost
               "targets": [{"name": "small", "model": "small-1b", "kvBlockSize": 16, "maxConcurrentRequests": 8},
                           {"name": "large", "model": "large-8b"}],
               "difficulty": {"maxPromptTokens": 512, "maxOutputTokens": 256, "maxTurns": 4,
                              "tools": true, "responseSchema": true},
               "classifier": {"model": "grader", "timeoutMs": 300},      # optional
               "overrideHeader": "x-tokenfleet-route-target",
               "override": "keys",                                   # off (default) | keys | any
               "overrideKeys": "/var/run/tokenfleet/override-keys"}} # with keys: the keys that may override

``endpoints.json`` lists the targets' router pods, each with ``tier`` = its target's name (and the
classifier's router pods with tier ``@classifier``).

``targets.json`` (rewritten by the operator on every pass from the targets' status, not part of the config
hash, re-read by the router every second)::

    [{"name": "small", "costPerMillionTokens": 0.41, "sloMet": true, "saturated": false}]

An absent ``costPerMillionTokens`` is an unknown cost; an absent ``sloMet`` is an SLO not measured yet.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROUTE_POLICIES = ("difficulty", "cost")
CLASSIFIER_TIER = "@classifier"     # not a Kubernetes name: no target can have it
DEFAULT_OVERRIDE_HEADER = "x-tokenfleet-route-target"
HOPS_HEADER = "x-tokenfleet-route-hops"     # routes a request has passed; a route refuses one past MAX_ROUTE_HOPS
MAX_ROUTE_HOPS = 8
# who may send the override header: nobody, the clients whose key is in overrideKeys, or every client
OVERRIDE_ACCESS = ("off", "keys", "any")
# headers that cannot be the override header: hop-by-hop ones, credentials, the body's framing, and the
# router's own (a route strips the override header before it forwards a request)
RESERVED_OVERRIDE_HEADERS = ("authorization", "proxy-authorization", "proxy-authenticate", "cookie", "set-cookie",
                             "host", "content-length", "content-type", "content-encoding", "transfer-encoding",
                             "connection", "keep-alive", "te", "trailer", "upgrade", "expect", "accept-encoding",
                             "forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto",
                             HOPS_HEADER)


@dataclass(frozen=True)
class RouteTarget:
    name: str
    model: str | None = None
    kv_block_size: int = 16
    max_concurrent: int | None = None


@dataclass(frozen=True)
class Difficulty:
    """Thresholds of the rule-based score (``router/difficulty.py``); None turns a rule off."""

    max_prompt_tokens: int | None = 512
    max_output_tokens: int | None = 256
    max_turns: int | None = 4
    tools: bool = True
    response_schema: bool = True


@dataclass(frozen=True)
class Classifier:
    model: str | None = None
    timeout_s: float = 0.3


@dataclass(frozen=True)
class RouteConfig:
    policy: str = "difficulty"
    targets: tuple[RouteTarget, ...] = ()
    difficulty: Difficulty = field(default_factory=Difficulty)
    classifier: Classifier | None = None
    override_header: str = DEFAULT_OVERRIDE_HEADER
    override: str = "off"                   # off | keys | any (OVERRIDE_ACCESS)
    override_keys: str | None = None        # with keys: the key file or directory (router/auth.py's layout)


@dataclass(frozen=True)
class TargetStatus:
    """What the operator knows of a target from its status (``status.cost``, ``status.goodput``, scaling)."""

    name: str
    cost_per_mtok: float | None = None      # None: unknown (the cost policy takes it as the most expensive)
    slo_met: bool | None = None             # None: not measured yet
    saturated: bool = False


def parse_route(f: Any) -> RouteConfig:
    """The ``route`` object of router.json (``f``: router_files._Fields over it)."""
    from tokenfleet_serving.contract.router_files import _Fields

    f.only("policy", "targets", "difficulty", "classifier", "overrideHeader", "override", "overrideKeys")
    policy = f.get("policy", str, "difficulty")
    if policy not in ROUTE_POLICIES:
        raise f.fail("policy", f"must be one of {', '.join(ROUTE_POLICIES)}, got {policy!r}")
    targets = []
    for i, raw in enumerate(f.get("targets", list, [], required=True)):
        t = _Fields(f.source, f"{f.where}.targets[{i}]", raw)
        t.only("name", "model", "kvBlockSize", "maxConcurrentRequests")
        targets.append(RouteTarget(t.get("name", str, required=True), t.get("model", str),
                                   t.integer("kvBlockSize", 16, 1, 4096),
                                   t.optional_integer("maxConcurrentRequests", 1, 100000)))
    if not targets:
        raise f.fail("targets", "must list at least one target")
    names = [t.name for t in targets]
    if len(set(names)) != len(names) or CLASSIFIER_TIER in names:
        raise f.fail("targets", f"has duplicate or reserved names: {names}")
    d = f.sub("difficulty")
    d.only("maxPromptTokens", "maxOutputTokens", "maxTurns", "tools", "responseSchema")
    classifier = None
    if f.obj.get("classifier") is not None:
        c = f.sub("classifier")
        c.only("model", "timeoutMs")
        classifier = Classifier(c.get("model", str), c.integer("timeoutMs", 300, 10, 10000) / 1000)
    header = f.get("overrideHeader", str, DEFAULT_OVERRIDE_HEADER)
    if not header:
        raise f.fail("overrideHeader", "must not be empty")
    if header.lower() in RESERVED_OVERRIDE_HEADERS:
        raise f.fail("overrideHeader", f"must not be {header!r} (a credential, hop-by-hop or router header)")
    override = f.get("override", str, "off")
    if override not in OVERRIDE_ACCESS:
        raise f.fail("override", f"must be one of {', '.join(OVERRIDE_ACCESS)}, got {override!r}")
    keys = f.get("overrideKeys", str)
    if (override == "keys") != bool(keys):
        raise f.fail("overrideKeys", "is required with override keys, and read only then")
    return RouteConfig(
        policy=policy, targets=tuple(targets),
        difficulty=Difficulty(d.optional_integer("maxPromptTokens", 1, 10_000_000),
                              d.optional_integer("maxOutputTokens", 1, 10_000_000),
                              d.optional_integer("maxTurns", 1, 100000),
                              d.get("tools", bool, True), d.get("responseSchema", bool, True)),
        classifier=classifier, override_header=header.lower(), override=override, override_keys=keys or None)


def route_json(r: RouteConfig) -> dict[str, Any]:
    """The ``route`` object of router.json; ``parse_route`` of it gives ``r`` back."""
    def drop_none(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if v is not None}

    out: dict[str, Any] = {
        "policy": r.policy,
        "targets": [drop_none({"name": t.name, "model": t.model, "kvBlockSize": t.kv_block_size,
                               "maxConcurrentRequests": t.max_concurrent}) for t in r.targets],
        "difficulty": {"maxPromptTokens": r.difficulty.max_prompt_tokens,
                       "maxOutputTokens": r.difficulty.max_output_tokens, "maxTurns": r.difficulty.max_turns,
                       "tools": r.difficulty.tools, "responseSchema": r.difficulty.response_schema},
        "overrideHeader": r.override_header,
        "override": r.override,
    }
    if r.override_keys is not None:
        out["overrideKeys"] = r.override_keys
    if r.classifier is not None:
        out["classifier"] = drop_none({"model": r.classifier.model,
                                       "timeoutMs": int(round(r.classifier.timeout_s * 1000))})
    return out


def parse_targets(data: Any, source: str = "targets.json") -> tuple[TargetStatus, ...]:
    from tokenfleet_serving.contract.router_files import ConfigError, _Fields

    if not isinstance(data, list):
        raise ConfigError(f"{source}: must be a JSON list of targets")
    out = []
    for i, raw in enumerate(data):
        t = _Fields(source, f"[{i}]", raw)
        t.only("name", "costPerMillionTokens", "sloMet", "saturated")
        cost = t.get("costPerMillionTokens", float)
        if cost is not None and not cost >= 0:
            raise t.fail("costPerMillionTokens", f"must be at least 0, got {cost}")
        out.append(TargetStatus(t.get("name", str, required=True), cost, t.get("sloMet", bool),
                                t.get("saturated", bool, False)))
    return tuple(out)


def targets_json(targets: list[TargetStatus] | tuple[TargetStatus, ...]) -> list[dict[str, Any]]:
    """targets.json as a JSON-able list; ``parse_targets`` of it gives them back."""
    return [{"name": t.name, "saturated": t.saturated}
            | ({"costPerMillionTokens": t.cost_per_mtok} if t.cost_per_mtok is not None else {})
            | ({"sloMet": t.slo_met} if t.slo_met is not None else {}) for t in targets]
