"""SliceQueue: a cluster-scoped admission queue for Slices, with an accelerator
quota, a queueing strategy, a preemption policy and an admission timeout.

A Slice names its queue in ``spec.queue``. The queue ``default`` always
exists: without a SliceQueue of that name it is unlimited, BestEffortFIFO and
never preempts. Any other name must be a SliceQueue, or the Slice waits with
reason ``QueueNotFound``. The queue is cluster-scoped because accelerator
quota is a cluster budget (like Kueue's ClusterQueue).
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from tokenfleet_operator.api.common import RESOURCE_NAME_PATTERN, ApiModel, Conditions, CrdInfo, PrinterColumn, Resource, rule, with_rules

DEFAULT_QUEUE = "default"

QuotaCount = Annotated[int, Field(ge=0, le=10_000_000)]


class RequeuePolicy(ApiModel):
    """How long a Slice that timed out waiting for admission is held back before it queues again."""

    model_config = with_rules(
        rule("self.baseSeconds <= self.maxSeconds", "baseSeconds must not exceed maxSeconds", field_path=".baseSeconds"),
    )

    base_seconds: int = Field(
        default=60, description="Hold-back after the first timeout; it doubles with every further timeout.", ge=1, le=86400
    )
    max_seconds: int = Field(default=3600, description="Upper bound of the hold-back.", ge=1, le=604800)


class SliceQueueSpec(ApiModel):
    """Desired behaviour of a SliceQueue."""

    quota: dict[str, QuotaCount] = Field(
        default_factory=dict,
        description=(
            "Accelerators the queue's Slices may hold at once, per extended resource, e.g. {nvidia.com/gpu: 64}. "
            "A resource that is not listed has quota 0."
        ),
        json_schema_extra={
            "default": {},
            "maxProperties": 64,
            "x-kubernetes-validations": [
                rule(f"self.all(k, k.matches('{RESOURCE_NAME_PATTERN}'))",
                     "quota keys must be extended resource names such as nvidia.com/gpu"),
            ],
        },
    )
    queueing_strategy: Literal["BestEffortFIFO", "StrictFIFO"] = Field(
        default="BestEffortFIFO",
        description=(
            "BestEffortFIFO lets smaller Slices behind a waiting one use free capacity (backfill). StrictFIFO holds "
            "every later Slice of the queue until the waiting head is admitted."
        ),
    )
    preemption: Literal["Never", "LowerPriority"] = Field(
        default="Never",
        description="LowerPriority lets a waiting Slice evict running Slices of strictly lower priority, always as whole gangs.",
    )
    admission_timeout_seconds: int | None = Field(
        default=None,
        description=(
            "How long a Slice may wait for admission before it is requeued (held back for the requeue delay, then "
            "queued again at the back of its priority). Unset: wait forever."
        ),
        ge=1,
        le=604800,
    )
    requeue: RequeuePolicy = Field(
        default_factory=RequeuePolicy,
        description="Exponential hold-back after an admission timeout.",
        json_schema_extra={"default": RequeuePolicy().to_wire()},
    )


class SliceQueueStatus(ApiModel):
    """Observed state of a SliceQueue, written by the gang scheduler after every pass that changes it."""

    pending_slices: int = Field(default=0, description="Slices of this queue waiting for admission.", ge=0)
    admitted_slices: int = Field(default=0, description="Slices of this queue whose members are bound.", ge=0)
    usage: dict[str, int] | None = Field(default=None, description="Accelerators held by admitted Slices, per resource.")
    observed_generation: int | None = Field(default=None, description="The metadata.generation last read by the gang scheduler.")
    conditions: Conditions | None = Field(
        default=None,
        description=(
            "Ready (the spec is in force) and Stalled (the spec cannot be used: its Slices wait with QueueInvalid "
            "until it is fixed), each with a reason and a message."
        ),
    )


class SliceQueue(Resource):
    """A cluster-scoped admission queue with an accelerator quota."""

    cluster_scoped: ClassVar[bool] = True
    crd: ClassVar[CrdInfo] = CrdInfo(
        kind="SliceQueue",
        plural="slicequeues",
        singular="slicequeue",
        short_names=("tfqueue",),
        categories=("tokenfleet",),
        description=(
            "A SliceQueue is a cluster-scoped admission queue for Slices: an accelerator quota per resource, FIFO or "
            "strict FIFO within a priority, optional preemption of lower-priority gangs and an admission timeout with "
            "exponential requeue."
        ),
        printer_columns=(
            PrinterColumn("Strategy", "string", ".spec.queueingStrategy", "Queueing strategy"),
            PrinterColumn("Preemption", "string", ".spec.preemption", "Preemption policy"),
            PrinterColumn("Pending", "integer", ".status.pendingSlices", "Slices waiting for admission"),
            PrinterColumn("Admitted", "integer", ".status.admittedSlices", "Slices with bound members"),
            PrinterColumn("Age", "date", ".metadata.creationTimestamp", "Time since creation"),
            PrinterColumn("Timeout", "integer", ".spec.admissionTimeoutSeconds", "Admission timeout (s)", priority=1),
        ),
        root_validations=(
            rule(
                "self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 63",
                "metadata.name must be a DNS-1123 label (Slices name it in spec.queue)",
                reason="FieldValueInvalid",
            ),
        ),
    )

    kind: str = Field(default="SliceQueue", description="SliceQueue")
    spec: SliceQueueSpec = Field(default_factory=SliceQueueSpec, description="Desired behaviour of the queue.")
    status: SliceQueueStatus | None = Field(default=None, description="Observed state of the queue.")
