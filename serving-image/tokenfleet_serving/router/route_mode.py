"""Route mode: the router of a TokenRoute, in front of other services' routers (docs/routing.md, "Model
routing").

Its backends are the targets' router pods (endpoints.json, ``tier`` = the target's name) and the classifier's
router pods (tier ``@classifier``). For each request it:

1. checks the request names the route's public model (else 404);
2. takes the override header, when present (an unknown target is a 400), else
3. scores the request (``difficulty.py``; prompt tokens counted with the first target's tokenizer and chat
   template) and, with a classifier, asks it for a grade within its timeout (any failure: the rules decide,
   counted in ``tokenfleet_router_route_classifier_fallbacks_total{reason}``), or ranks the targets by cost
   (``route_policy.by_cost``, from targets.json);
4. rewrites the request's ``model`` to the target's served model name, and hashes the prompt's prefix blocks
   with that target's own tokenizer (each target keeps its own tokenizer and chat template);
5. answers with the target's response as it comes: its usage is the target's, counted by its tokenizer; the
   response carries ``x-tokenfleet-route-target``, ``x-tokenfleet-route-reason`` and
   ``x-tokenfleet-route-detail`` (the reason in words), and the decision is counted
   in ``tokenfleet_router_route_decisions_total{target,reason}``.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenfleet_serving.contract.route_files import CLASSIFIER_TIER, RouteConfig, TargetStatus, parse_targets
from tokenfleet_serving.contract.router_files import ConfigError
from tokenfleet_serving.engine.tokenizer import Tokenizer
from tokenfleet_serving.openai.errors import ApiError
from tokenfleet_serving.router import route_policy as rp
from tokenfleet_serving.router.difficulty import features, grading_prompt, parse_grade, score
from tokenfleet_serving.router.prompt import PromptInfo, prompt_info
from tokenfleet_serving.router.state import Fleet

log = logging.getLogger("tokenfleet.router.route")

TARGET_HEADER = "x-tokenfleet-route-target"
REASON_HEADER = "x-tokenfleet-route-reason"
DETAIL_HEADER = "x-tokenfleet-route-detail"       # the reason in words, e.g. "difficulty 1 (tools)"
FALLBACK_REASONS = ("unavailable", "timeout", "error", "no-grade")


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
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason=reason)
        self._show_targets()

    # ---- targets.json --------------------------------------------------------------------------------
    def reload_targets(self) -> None:
        """Re-read targets.json when its bytes changed; a missing or bad file keeps the last good state (at the
        start: nothing known, every cost unknown)."""
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
            if override not in self.by_name:
                raise ApiError(400, f"the {self.route.override_header} header names no target of this route "
                                    f"(one of: {', '.join(self.names)})", self.route.override_header)
            decision = rp.RouteDecision(override, rp.OVERRIDE, f"{self.route.override_header}: {override}") \
                if override in available else None
        elif self.route.policy == "cost":
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
