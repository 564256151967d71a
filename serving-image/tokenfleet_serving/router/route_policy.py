"""Which target of a TokenRoute takes a request: pure functions over the targets' state (route mode).

Inputs: the targets in spec order (cheapest first), which of them have a routable router pod now
(``available``), which are saturated now (``saturated``: the operator says so in targets.json, or this router
has ``maxConcurrentRequests`` open at the target), and each target's measured cost per million tokens and
whether it meets its SLO now (targets.json, from its ``status.cost`` and ``status.goodput``).

**difficulty**: the request's score (``difficulty.py``) picks ``targets[min(score, n - 1)]``. When that target
has no routable pod, or is saturated, the request goes to the next larger target that can take it, else to the
nearest smaller one (reason ``spill-unavailable`` / ``spill-saturated``).

**cost**: among the available targets that are not saturated and do not miss their SLO now (an SLO not
measured yet does not count as missed), the one with the lowest cost per million tokens; a target whose cost is
unknown counts as the most expensive (ties: spec order). When a cheaper target was passed over because it is
saturated or misses its SLO, the reason says so (``spill-saturated``, ``spill-slo``); when every available target
is saturated or misses its SLO, the cheapest of them all takes it (``all-degraded``). A decision resting on
unknown costs is ``cost-unknown``.

Every decision carries a label-safe ``reason`` (the metric's label and the response header
``x-tokenfleet-route-reason``) and a ``detail`` in words for the log.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tokenfleet_serving.contract.route_files import TargetStatus

# Reasons (the `reason` label of tokenfleet_router_route_decisions_total).
EASY = "easy"                          # difficulty score 0
HARD = "hard"                          # difficulty score above 0
CLASSIFIER_HARD = "classifier-hard"    # the classifier graded it hard
OVERRIDE = "override"                  # the override header named the target
CHEAPEST = "cheapest"                  # cost: the cheapest target that can take it
COST_UNKNOWN = "cost-unknown"          # cost: chosen among targets of unknown cost (spec order)
SPILL_SATURATED = "spill-saturated"
SPILL_SLO = "spill-slo"
SPILL_UNAVAILABLE = "spill-unavailable"
ALL_DEGRADED = "all-degraded"
REASONS = (EASY, HARD, CLASSIFIER_HARD, OVERRIDE, CHEAPEST, COST_UNKNOWN, SPILL_SATURATED, SPILL_SLO,
           SPILL_UNAVAILABLE, ALL_DEGRADED)


@dataclass(frozen=True)
class RouteDecision:
    target: str
    reason: str
    detail: str


def _order_from(index: int, n: int) -> list[int]:
    """Larger targets from ``index`` on, then the smaller ones nearest first."""
    return list(range(index, n)) + list(range(index - 1, -1, -1))


def by_difficulty(targets: Sequence[str], points: int, reason: str, detail: str, available: Collection[str],
                  saturated: Collection[str]) -> RouteDecision | None:
    """The target for a request of difficulty ``points`` (``reason``/``detail`` say why it has them)."""
    if not targets:
        return None
    want = min(points, len(targets) - 1)
    order = _order_from(want, len(targets))
    for i in order:
        name = targets[i]
        if name in available and name not in saturated:
            if i == want:
                return RouteDecision(name, reason, detail)
            why = SPILL_SATURATED if targets[want] in available else SPILL_UNAVAILABLE
            return RouteDecision(name, why, f"{detail}; {targets[want]} is "
                                 f"{'saturated' if why == SPILL_SATURATED else 'not available'}")
    for i in order:       # every available one is saturated: the wanted one, or the next that exists
        if targets[i] in available:
            return RouteDecision(targets[i], ALL_DEGRADED, f"{detail}; every target is saturated")
    return None


def _cost(status: TargetStatus | None) -> float:
    return math.inf if status is None or status.cost_per_mtok is None else status.cost_per_mtok


def _money(status: TargetStatus | None) -> str:
    c = _cost(status)
    return "unknown (counted as the most expensive)" if c == math.inf else f"{c:.4g} $/Mtok"


def by_cost(targets: Sequence[str], status: Mapping[str, TargetStatus], available: Collection[str],
            saturated: Collection[str]) -> RouteDecision | None:
    """The cheapest target that meets its SLO now and is not saturated."""
    ranked = sorted((i for i, t in enumerate(targets) if t in available),
                    key=lambda i: (_cost(status.get(targets[i])), i))
    if not ranked:
        return None

    def misses_slo(name: str) -> bool:
        s = status.get(name)
        return s is not None and s.slo_met is False

    passed: list[str] = []
    for i in ranked:
        name = targets[i]
        s = status.get(name)
        if name in saturated or misses_slo(name):
            passed.append(f"{name} {'is saturated' if name in saturated else 'misses its SLO'}")
            continue
        if passed:
            reason = SPILL_SATURATED if passed[0].endswith("saturated") else SPILL_SLO
            return RouteDecision(name, reason, f"{name} at {_money(s)}: cheaper " + ", ".join(passed))
        reason = COST_UNKNOWN if _cost(s) == math.inf else CHEAPEST
        return RouteDecision(name, reason, f"{name} at {_money(s)}")
    first = targets[ranked[0]]
    return RouteDecision(first, ALL_DEGRADED, f"{first} at {_money(status.get(first))}: " + ", ".join(passed))
