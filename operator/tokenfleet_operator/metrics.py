"""Prometheus metrics of the operator (served on --metrics-port at /metrics)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "tokenfleet_reconcile_total", "Reconcile passes by kind and result (ok, invalid, retry, error).", ["kind", "result"]
)
RECONCILE_SECONDS = Histogram(
    "tokenfleet_reconcile_duration_seconds", "Wall time of one reconcile pass.", ["kind"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
CHILDREN_APPLIED = Counter("tokenfleet_children_applied_total", "Server-side applies of child objects.", ["kind"])
SLICE_RESTARTS = Counter("tokenfleet_slice_restarts_total", "Whole-gang restarts.", ["namespace", "slice", "reason"])
SLICE_MEMBERS_READY = Gauge("tokenfleet_slice_members_ready", "Ready members of a Slice.", ["namespace", "slice"])
SERVICE_READY_REPLICAS = Gauge(
    "tokenfleet_inferenceservice_ready_replicas", "Ready replicas of an InferenceService.", ["namespace", "service"]
)
SERVICE_COST = Gauge(
    "tokenfleet_inferenceservice_cost_dollars_per_hour", "Cost per hour of an InferenceService at its current size.",
    ["namespace", "service"],
)
