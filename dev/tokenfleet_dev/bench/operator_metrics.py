"""What ``tokenfleet bench operator`` reads from the operator's /metrics, as pure functions.

A ``Scrape`` is one reading of the counters the benchmark needs; the
difference of two scrapes is what happened between them. The operator is a
black box: any operator that exports these series (today's, or a rewrite)
can be measured, and a series it does not export reads as absent (None in
the results), never as zero.

- ``tokenfleet_reconcile_total{kind, result}``: reconcile passes;
- ``tokenfleet_reconcile_duration_seconds{kind}``: their wall time (a histogram);
- ``tokenfleet_operator_api_requests_total{verb, resource}``: requests to the API server;
- ``tokenfleet_object_reconciles_total{kind, namespace, name}``: passes per object.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

RECONCILES = "tokenfleet_reconcile_total"
RECONCILE_SECONDS = "tokenfleet_reconcile_duration_seconds"
API_REQUESTS = "tokenfleet_operator_api_requests_total"
OBJECT_RECONCILES = "tokenfleet_object_reconciles_total"


@dataclass
class Scrape:
    """One reading of the operator's counters (all monotonic)."""

    reconciles: Counter = field(default_factory=Counter)           # kind -> passes
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # kind -> {le: cumulative count}
    api_requests: Counter = field(default_factory=Counter)         # (verb, resource) -> requests
    objects: Counter = field(default_factory=Counter)              # (kind, namespace, name) -> passes
    has_api_requests: bool = False
    has_objects: bool = False

    def __sub__(self, earlier: Scrape) -> Scrape:
        buckets = {kind: {le: count - earlier.buckets.get(kind, {}).get(le, 0.0) for le, count in les.items()}
                   for kind, les in self.buckets.items()}
        return Scrape(_minus(self.reconciles, earlier.reconciles), buckets,
                      _minus(self.api_requests, earlier.api_requests), _minus(self.objects, earlier.objects),
                      self.has_api_requests, self.has_objects)

    @property
    def total_reconciles(self) -> float:
        return float(sum(self.reconciles.values()))

    @property
    def total_api_requests(self) -> float | None:
        return float(sum(self.api_requests.values())) if self.has_api_requests else None

    def merged_buckets(self) -> dict[float, float]:
        """The histogram buckets of every kind added up."""
        out: Counter = Counter()
        for les in self.buckets.values():
            out.update(les)
        return dict(out)

    def object_count(self, kind: str, namespace: str, name: str) -> float | None:
        return float(self.objects.get((kind, namespace, name), 0.0)) if self.has_objects else None


def _minus(later: Counter, earlier: Counter) -> Counter:
    return Counter({k: v - earlier.get(k, 0.0) for k, v in later.items()})


def parse(text: str) -> Scrape:
    """The counters in a Prometheus text exposition (an operator's /metrics)."""
    out = Scrape()
    for family in text_string_to_metric_families(text):
        # A family that exists but has no sample yet still says the operator exports it.
        out.has_api_requests |= family.name == API_REQUESTS.removesuffix("_total")
        out.has_objects |= family.name == OBJECT_RECONCILES.removesuffix("_total")
        for s in family.samples:
            if s.name == RECONCILES:
                out.reconciles[s.labels.get("kind", "")] += s.value
            elif s.name == RECONCILE_SECONDS + "_bucket":
                les = out.buckets.setdefault(s.labels.get("kind", ""), {})
                le = float(s.labels["le"])
                les[le] = les.get(le, 0.0) + s.value
            elif s.name == API_REQUESTS:
                out.api_requests[(s.labels.get("verb", ""), s.labels.get("resource", ""))] += s.value
            elif s.name == OBJECT_RECONCILES:
                out.objects[(s.labels.get("kind", ""), s.labels.get("namespace", ""), s.labels.get("name", ""))] += s.value
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated linearly inside its bucket
    (what PromQL's histogram_quantile does). None when the histogram is empty; the
    highest finite bound when the quantile falls in the +Inf bucket."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank and count > lower_count:
            if math.isinf(le):
                return lower_bound
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        if not math.isinf(le):
            lower_bound = le
        lower_count = count
    return lower_bound


def beyond_last_bucket(q: float, buckets: dict[float, float]) -> bool:
    """Whether the q-quantile lies in the +Inf bucket (histogram_quantile then gives only a floor)."""
    finite = [le for le in buckets if not math.isinf(le)]
    total = max(buckets.values(), default=0.0)
    return bool(finite) and total > 0 and buckets[max(finite)] < q * total


def spread(values: list[float]) -> dict[str, float] | None:
    """min, p50, mean and max of some per-object counts; None for no objects."""
    if not values:
        return None
    ordered = sorted(values)
    return {"objects": len(ordered), "min": ordered[0], "p50": ordered[len(ordered) // 2],
            "mean": round(sum(ordered) / len(ordered), 3), "max": ordered[-1]}
