"""Route mode: the router of a TokenRoute, in front of other services' routers (docs/routing.md, "Model
routing").

Its backends are the targets' router pods (endpoints.json, ``tier`` = the target's name) and the classifier's
router pods (tier ``@classifier``). For each request it:

1. checks the request names the route's public model (else 404), and has passed fewer than ``MAX_ROUTE_HOPS``
   routes (``x-tokenfleet-route-hops``, which it sends on one higher: else 508, a loop of routes);
2. takes the override header, when present and allowed (``override``: off, the default, refuses it with 403;
   keys lets in only the clients whose key is in the override keys; any lets in every client), to the target it
   names (an unknown target is a 400, a saturated one a 429 with Retry-After: an override is never sent past a
   target's ``maxConcurrentRequests``, nor spilled to another target), else
3. scores the request (``difficulty.py``; prompt tokens counted with the first target's tokenizer and chat
   template) and, with a classifier, asks it for a grade within its timeout (any failure: the rules decide,
   counted in ``tokenfleet_router_route_classifier_fallbacks_total{reason}``), or ranks the targets by cost
   (``route_policy.by_cost``, from targets.json);
4. rewrites the request's ``model`` to the target's served model name, and hashes the prompt's prefix blocks
   with that target's own tokenizer (each target keeps its own tokenizer and chat template);
5. forwards it without the override header (a target that is itself a route decides for itself), and
   answers with the target's response as it comes: its usage is the target's, counted by its tokenizer; the
   response carries ``x-tokenfleet-route-target``, ``x-tokenfleet-route-reason`` and
   ``x-tokenfleet-route-detail`` (the reason in words), and the decision is counted
   in ``tokenfleet_router_route_decisions_total{target,reason}``.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenfleet_serving.contract.route_files import CLASSIFIER_TIER, HOPS_HEADER, MAX_ROUTE_HOPS, RouteConfig, TargetStatus, parse_targets
from tokenfleet_serving.contract.router_files import ConfigError
from tokenfleet_serving.engine.tokenizer import Tokenizer
from tokenfleet_serving.openai.errors import ApiError
from tokenfleet_serving.router import route_policy as rp
from tokenfleet_serving.router.auth import ClientKeys, KeyFileError
from tokenfleet_serving.router.difficulty import features, grading_prompt, parse_grade, score
from tokenfleet_serving.router.prompt import PromptInfo, prompt_info
from tokenfleet_serving.router.state import Fleet

log = logging.getLogger("tokenfleet.router.route")

TARGET_HEADER = "x-tokenfleet-route-target"
REASON_HEADER = "x-tokenfleet-route-reason"
DETAIL_HEADER = "x-tokenfleet-route-detail"       # the reason in words, e.g. "difficulty 1 (tools)"
FALLBACK_REASONS = ("unavailable", "timeout", "error", "no-grade")
OVERRIDE_REFUSALS = ("off", "key", "unknown-target", "saturated")


@dataclass(frozen=True)
class Routed:
    """The route's decision for one request, and the prompt as the chosen target tokenizes it."""

    decision: rp.RouteDecision
    model: str | None               # the target's model name (the request's model is rewritten to it)
    info: PromptInfo
    kv_block_size: int


class RouteMode:
    def __init__(self, route: RouteConfig, public_model: str | None, tokenizers: dict[str, Tokenizer | None],
                 targets_path: Path, registry: CollectorRegistry):
        self.route = route
        self.public_model = public_model
        self.tokenizers = tokenizers
        self.targets_path = targets_path
        self.status: dict[str, TargetStatus] = {}
        self._targets_text: bytes | None = None
        self.names = tuple(t.name for t in route.targets)
        self.by_name = {t.name: t for t in route.targets}
        self.decisions = Counter("tokenfleet_router_route_decisions", "Route decisions by target and reason.",
                                 ["target", "reason"], registry=registry)
        self.fallbacks = Counter("tokenfleet_router_route_classifier_fallbacks", "Requests the rule-based score "
                                 "decided because the classifier gave no grade in time, by why.", ["reason"],
                                 registry=registry)
        self.grades = Counter("tokenfleet_router_route_classifier_grades", "Grades the classifier gave.",
                              ["grade"], registry=registry)
        self.scores = Histogram("tokenfleet_router_route_difficulty_score", "Rule-based difficulty scores.",
                                buckets=(0, 1, 2, 3, 4, 5), registry=registry)
        self.target_saturated = Gauge("tokenfleet_router_route_target_saturated", "1 while targets.json says the "
                                      "target is saturated.", ["target"], registry=registry)
        self.target_slo_met = Gauge("tokenfleet_router_route_target_slo_met", "1 while the target meets its SLO, 0 "
                                    "while it misses it (absent: not measured).", ["target"], registry=registry)
        self.target_cost = Gauge("tokenfleet_router_route_target_cost_per_million_tokens", "The target's measured "
                                 "cost per million tokens (absent: unknown).", ["target"], registry=registry)
        self.override_refusals = Counter("tokenfleet_router_route_override_refusals", "Requests refused for their "
                                         "override header, by why.", ["reason"], registry=registry)
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason=reason)
        for reason in OVERRIDE_REFUSALS:
            self.override_refusals.labels(reason=reason)
        self.override_keys: ClientKeys | None = None
        self._load_override_keys()
        self._show_targets()

    # ---- who may override, and how far a request has come ---------------------------------------------
    def _load_override_keys(self) -> None:
        """The override keys (override keys); while they cannot be read, no client may override (logged)."""
        if self.route.override != "keys" or self.route.override_keys is None:
            return
        if self.override_keys is not None:
            self.override_keys.reload()
            return
        try:
            self.override_keys = ClientKeys(self.route.override_keys)
        except KeyFileError as exc:
            log.error("%s: no client may send %s until they can be read", exc, self.route.override_header)

    def checked_override(self, headers: Mapping[str, str]) -> str | None:
        """The target the request's override header names, once the request is let through: fewer than
        MAX_ROUTE_HOPS routes passed (else 508), and a client that may override (else 403)."""
        hops = self.hops(headers)
        if hops >= MAX_ROUTE_HOPS:
            raise ApiError(508, f"the request has passed {hops} routes (at most {MAX_ROUTE_HOPS}): the routes "
                                "send it round in a loop; check their targets' tokenRoute fields", HOPS_HEADER)
        header = self.route.override_header
        override = headers.get(header)
        if override is None:
            return None
        if self.route.override == "off":
            self.override_refusals.labels(reason="off").inc()
            raise ApiError(403, f"this route takes no {header} header (its spec.override is off)", header)
        if self.route.override == "keys" and (self.override_keys is None
                                              or not self.override_keys.allows(headers.get("Authorization"))):
            self.override_refusals.labels(reason="key").inc()
            raise ApiError(403, f"the {header} header is only for the keys in the route's "
                                "spec.overrideKeysSecretName", header)
        return override

    @staticmethod
    def hops(headers: Mapping[str, str]) -> int:
        """The routes the request has passed (its HOPS_HEADER; absent: 0); not a small number: 400."""
        value = headers.get(HOPS_HEADER)
        if value is None:
            return 0
        if not (value.isascii() and value.isdigit() and len(value) <= 3):
            raise ApiError(400, f"the {HOPS_HEADER} header must be a number of routes, 0 to 999", HOPS_HEADER)
        return int(value)

    def forward_headers(self, headers: dict[str, str], received: Mapping[str, str]) -> None:
        """What a target is sent: no override header (a target that is a route decides for itself, by its own
        rules), and one hop more."""
        for name in [k for k in headers if k.lower() in (self.route.override_header, HOPS_HEADER)]:
            del headers[name]
        headers[HOPS_HEADER] = str(self.hops(received) + 1)

    # ---- targets.json --------------------------------------------------------------------------------
    def reload_targets(self) -> None:
        """Re-read targets.json when its bytes changed; a missing or bad file keeps the last good state (at the
        start: nothing known, every cost unknown)."""
        self._load_override_keys()
        try:
            text = self.targets_path.read_bytes()
        except OSError:
            return
        if text == self._targets_text:
            return
        try:
            targets = parse_targets(json.loads(text), str(self.targets_path))
        except (ConfigError, ValueError) as exc:
            log.error("%s (keeping the last good target state)", exc)
            return
        self._targets_text = text
        self.status = {t.name: t for t in targets}
        self._show_targets()

    def _show_targets(self) -> None:
        for name in self.names:
            s = self.status.get(name)
            self.target_saturated.labels(target=name).set(1 if s is not None and s.saturated else 0)
            for gauge, value in ((self.target_slo_met, None if s is None or s.slo_met is None else float(s.slo_met)),
                                 (self.target_cost, None if s is None else s.cost_per_mtok)):
                if value is None:
                    try:
                        gauge.remove(name)
                    except KeyError:
                        pass
                else:
                    gauge.labels(target=name).set(value)

    def saturated(self, fleet: Fleet) -> set[str]:
        out = {name for name, s in self.status.items() if s.saturated}
        for t in self.route.targets:
            if t.max_concurrent is not None:
                inflight = sum(b.inflight for b in fleet.backends.values() if b.endpoint.tier == t.name)
                if inflight >= t.max_concurrent:
                    out.add(t.name)
        return out

    # ---- one request ---------------------------------------------------------------------------------
    def check_model(self, body: Any) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        if self.public_model is not None and isinstance(model, str) and model != self.public_model:
            raise ApiError(404, f"the model '{model}' does not exist; this route serves '{self.public_model}'",
                           "model")

    async def decide(self, kind: str, body: Any, override: str | None, fleet: Fleet,
                     session: aiohttp.ClientSession | None, classifier_headers: dict[str, str]) -> Routed | None:
        """The target for one request, or None when no target has a routable pod."""
        self.check_model(body)
        available = {t for t in fleet.tiers_available() if t in self.by_name}
        first = self.names[0]
        scored = await self._info(first, kind, body)
        decision: rp.RouteDecision | None
        if override is not None:
            return await self._override(override, kind, body, fleet, available, scored)
        if self.route.policy == "cost":
            decision = rp.by_cost(self.names, self.status, available, self.saturated(fleet))
        else:
            s = score(features(kind, body, scored.num_tokens, scored.max_tokens), self.route.difficulty)
            self.scores.observe(s.points)
            points, reason = s.points, (rp.HARD if s.points else rp.EASY)
            detail = f"difficulty {s.points}" + (f" ({', '.join(s.rules)})" if s.rules else "")
            if self.route.classifier is not None and points < len(self.names) - 1:
                grade = await self._grade(kind, body, fleet, session, classifier_headers)
                if grade == "hard":
                    points, reason, detail = len(self.names) - 1, rp.CLASSIFIER_HARD, f"{detail}; classifier: hard"
            decision = rp.by_difficulty(self.names, points, reason, detail, available, self.saturated(fleet))
        if decision is None:
            return None
        self.decisions.labels(target=decision.target, reason=decision.reason).inc()
        target = self.by_name[decision.target]
        info = scored if decision.target == first else await self._info(decision.target, kind, body)
        return Routed(decision, target.model, info, target.kv_block_size)

    async def _override(self, override: str, kind: str, body: Any, fleet: Fleet, available: set[str],
                        scored: PromptInfo) -> Routed | None:
        """The target the override header names, unless it is saturated (429: an override is not spilled)."""
        header = self.route.override_header
        if override not in self.by_name:
            self.override_refusals.labels(reason="unknown-target").inc()
            raise ApiError(400, f"the {header} header names no target of this route (one of: "
                                f"{', '.join(self.names)})", header)
        if override not in available:
            return None
        info = scored if override == self.names[0] else await self._info(override, kind, body)
        # after the last await: nothing runs between this check and the request counted open at the target
        if override in self.saturated(fleet):
            self.override_refusals.labels(reason="saturated").inc()
            limit = self.by_name[override].max_concurrent
            raise ApiError(429, f"the target {override} that the {header} header names is saturated ("
                                + (f"{limit} requests open, its maxConcurrentRequests" if limit is not None
                                   else "its service is at maxReplicas or has no ready replica")
                                + "); retry later, or send the request without the header",
                           header, headers={"Retry-After": "1"})
        decision = rp.RouteDecision(override, rp.OVERRIDE, f"{header}: {override}")
        self.decisions.labels(target=override, reason=rp.OVERRIDE).inc()
        target = self.by_name[override]
        return Routed(decision, target.model, info, target.kv_block_size)

    async def _info(self, target: str, kind: str, body: Any) -> PromptInfo:
        tokenizer = self.tokenizers.get(target)
        if tokenizer is not None and isinstance(body, dict):
            return await asyncio.to_thread(prompt_info, kind, body, tokenizer)
        return prompt_info(kind, body, None)

    async def _grade(self, kind: str, body: Any, fleet: Fleet, session: aiohttp.ClientSession | None,
                     headers: dict[str, str]) -> str | None:
        """The classifier's grade, or None (counted by why) when it gives none within its timeout."""
        classifier = self.route.classifier
        assert classifier is not None
        backends = sorted(fleet.routable(CLASSIFIER_TIER), key=lambda b: (b.inflight, b.name))
        if not backends or session is None:
            self.fallbacks.labels(reason="unavailable").inc()
            return None
        backend = backends[0]
        ask = {"prompt": grading_prompt(kind, body), "max_tokens": 2, "temperature": 0}
        if classifier.model:
            ask["model"] = classifier.model
        backend.inflight += 1
        try:
            async with session.post(backend.endpoint.url + "/v1/completions", json=ask, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=classifier.timeout_s)) as r:
                if r.status != 200:
                    self.fallbacks.labels(reason="error").inc()
                    return None
                answer = await r.json()
        except TimeoutError:
            self.fallbacks.labels(reason="timeout").inc()
            return None
        except (aiohttp.ClientError, ValueError):
            self.fallbacks.labels(reason="error").inc()
            return None
        finally:
            backend.inflight -= 1
        try:
            grade = parse_grade(answer["choices"][0]["text"])
        except (KeyError, IndexError, TypeError):
            grade = None
        if grade is None:
            self.fallbacks.labels(reason="no-grade").inc()
        else:
            self.grades.labels(grade=grade).inc()
        return grade

    def models(self) -> dict[str, Any]:
        """/v1/models of the route: its one public model."""
        return {"object": "list", "data": [{"id": self.public_model, "object": "model", "owned_by": "tokenfleet"}]}
