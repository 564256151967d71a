"""Prometheus metrics of the operator (served on --metrics-port at /metrics)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "tokenfleet_reconcile_total", "Reconcile passes by kind and result (ok, invalid, retry, error; unchanged: a resync found nothing new; "
    "skipped: a periodic gang pass with nothing waiting).", ["kind", "result"]
)
RECONCILE_SECONDS = Histogram(
    "tokenfleet_reconcile_duration_seconds", "Wall time of one reconcile pass that ran (unchanged and skipped ones are not timed).",
    ["kind"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECONCILES_BY_OBJECT = Counter(
    "tokenfleet_object_reconciles_total",
    "Reconcile passes of one object. One series per object the operator has reconciled: it shows how often a "
    "trigger or the resync reconciles each object (tokenfleet bench operator reads it).",
    ["kind", "namespace", "name"],
)
API_REQUESTS = Counter(
    "tokenfleet_operator_api_requests_total",
    "Requests the operator's own code sent to the API server (tokenfleet_operator.kube; Kopf's watches and its "
    "own annotation patches are not counted), by RBAC verb (get, list, create, apply, patch, update, delete) and "
    "resource (the plural, with a subresource as RBAC writes it: pods/binding, slices/status).",
    ["verb", "resource"],
)
CHILDREN_APPLIED = Counter("tokenfleet_children_applied_total", "Server-side applies of child objects.", ["kind"])
SLICE_RESTARTS = Counter("tokenfleet_slice_restarts_total", "Whole-gang restarts.", ["namespace", "slice", "reason"])
SLICE_MEMBERS_READY = Gauge("tokenfleet_slice_members_ready", "Ready members of a Slice.", ["namespace", "slice"])
SLICE_RESTART_BUDGET_USED = Gauge(
    "tokenfleet_slice_restart_budget_used", "Gang restarts of a Slice's current spec (status.restarts; a new spec starts at 0).",
    ["namespace", "slice"],
)
SLICE_RESTART_BUDGET = Gauge(
    "tokenfleet_slice_restart_budget", "The Slice's restart budget (spec.restartPolicy.maxRestarts).", ["namespace", "slice"]
)
SLICE_CHECKPOINT_SAVED = Gauge(
    "tokenfleet_slice_checkpoint_saved_timestamp_seconds",
    "When the newest checkpoint the operator read from a batch Slice's leader was saved (status.checkpoint.savedAt), "
    "as Unix time.", ["namespace", "slice"],
)
SERVICE_READY_REPLICAS = Gauge(
    "tokenfleet_inferenceservice_ready_replicas", "Ready replicas of an InferenceService.", ["namespace", "service"]
)
SERVICE_REPLICAS = Gauge(
    "tokenfleet_inferenceservice_replicas", "Replicas an InferenceService asks for (spec.replicas).", ["namespace", "service"]
)
SERVICE_ACCELERATORS = Gauge(
    "tokenfleet_inferenceservice_accelerators",
    "Accelerators held by an InferenceService's replicas (status.replicas x accelerators per replica; 0 for cpu).",
    ["namespace", "service"],
)
SERVICE_SLO_OBJECTIVE = Gauge(
    "tokenfleet_inferenceservice_slo_objective_ratio",
    "Share of requests that should meet spec.slo's targets (spec.slo.percentile / 100): the goodput objective.",
    ["namespace", "service"],
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
SLICES_WAITING = Gauge(
    "tokenfleet_slices_waiting", "Slices waiting for admission after the last pass, by queue and the reason they wait "
    "(InsufficientCapacity, QuotaExceeded, DomainTooSmall, QueueNotFound, RequeueBackoff, ...).", ["queue", "reason"],
)
QUEUE_OLDEST_WAIT = Gauge(
    "tokenfleet_slicequeue_oldest_pending_seconds",
    "How long the queue's longest-waiting Slice has waited since its current attempt first queued (0: none waits).",
    ["queue"],
)
QUEUE_ADMISSION_TIMEOUT = Gauge(
    "tokenfleet_slicequeue_admission_timeout_seconds", "spec.admissionTimeoutSeconds of queues that set one.", ["queue"]
)

# The work queue, the collector and leader election (controller/).
QUEUE_DEPTH = Gauge("tokenfleet_workqueue_depth", "Keys waiting in the reconcile queue.")
QUEUE_WAIT = Histogram(
    "tokenfleet_workqueue_queue_duration_seconds", "How long a key waited in the reconcile queue before a worker took it.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
)
TRIGGERS = Counter(
    "tokenfleet_reconcile_triggers_total", "Watch events that asked for a reconcile (before the queue coalesced them), by kind.",
    ["kind"],
)
LEADER = Gauge("tokenfleet_operator_leader", "1 while this replica holds the leader Lease and works the queue, else 0.")
COLLECT_SECONDS = Histogram(
    "tokenfleet_collector_read_duration_seconds", "Wall time of the collector's read of one target's pods.", ["kind"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5),
)
