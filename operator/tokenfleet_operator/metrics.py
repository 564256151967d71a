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
SERVICE_COST_PER_MTOK = Gauge(
    "tokenfleet_inferenceservice_cost_per_million_tokens",
    "Dollars per million output tokens: dollars per hour over the output tokens per hour the replicas measured "
    "over their last minute.", ["namespace", "service"],
)

# Gang scheduler.
ADMISSION_WAIT = Histogram(
    "tokenfleet_slice_admission_wait_seconds",
    "Time from a Slice attempt starting to wait to all its members being bound.", ["queue"],
    buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200),
)
SLICES_PENDING = Gauge("tokenfleet_slices_pending", "Slices waiting for admission after the last pass.", ["queue"])
PLACEMENT_SECONDS = Histogram(
    "tokenfleet_placement_duration_seconds",
    "Wall time of one gang-scheduler pass, by stage: snapshot (list objects), plan (pure placement), bind, total.",
    ["stage"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
GANG_BINDS = Counter("tokenfleet_gang_binds_total", "Gangs bound whole, and bind attempts rolled back.", ["result"])
GANG_ROLLBACKS = Counter(
    "tokenfleet_gang_rollbacks_total", "Partially bound gangs whose members were deleted.", ["cause"]
)
GANG_PREEMPTIONS = Counter("tokenfleet_gang_preemptions_total", "Gangs evicted for a higher-priority Slice.")
