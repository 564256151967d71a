"""Slice: a gang of member pods (one per host) that is placed, run and
restarted as one unit, like a multi-host TPU slice. A Slice of several hosts
gets a headless Service of its own name, so its members find each other (the
leader at SLICE-0.SLICE.NAMESPACE.svc), as in LeaderWorkerSet.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from tokenfleet_operator.api.common import (
    DNS_LABEL_PATTERN,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    PATH_SEGMENT,
    TOPOLOGY_PATTERN,
    AcceleratorBase,
    ApiModel,
    Conditions,
    CrdInfo,
    PrinterColumn,
    Resource,
    rule,
    with_rules,
)
from tokenfleet_operator.api.pod_template import member_pod_spec_schema
from tokenfleet_serving.contract.termination import CONFIGURATION_EXIT_CODE

SlicePhase = Literal["Pending", "Admitted", "Placing", "Ready", "Degraded", "Restarting", "Failed", "Succeeded"]
SLICE_PHASES: tuple[str, ...] = SlicePhase.__args__  # type: ignore[attr-defined]

DEFAULT_TOPOLOGY_KEY = "topology.kubernetes.io/zone"

# pvc://CLAIM[/PATH], hostpath:///PATH, file:///PATH; no ".." segments, no host or file path that is "/" itself.
# Object stores (s3://, gs://) are refused by a CEL rule with its own message (STORE_SCHEMES): nothing in
# tokenfleet reads or writes them (the batch worker and warm restart need a file system), so a Slice given one
# would run without the checkpoints it asked for. The pattern still takes their shape, because the API server
# checks no CEL rule of an object that fails a pattern, and its pattern error would not say which stores there are.
STORE_PATTERN = (
    rf"^(pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/{PATH_SEGMENT})*/?|(hostpath|file)://(/{PATH_SEGMENT})+/?|"
    r"(s3|gs)://\S+)$"
)
STORE_SCHEMES = ("pvc", "hostpath", "file")
UNSUPPORTED_STORE = ("must be a file system store: pvc://CLAIM[/PATH], hostpath:///PATH or file:///PATH (s3:// and "
                     "gs:// are not supported: nothing reads or writes them)")


def _keys_are_label_keys(what: str) -> dict[str, Any]:
    return {
        "maxProperties": 64,
        "x-kubernetes-validations": [rule(f"self.all(k, size(k) <= 317 && k.matches(r'{LABEL_KEY_PATTERN}'))",
                                          f"{what} keys must be label keys such as app or example.com/team")],
    }


class MemberTemplateMetadata(ApiModel):
    """Labels and annotations copied onto every member pod."""

    labels: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] | None = Field(
        default=None,
        description="Labels added to every member pod; values have at most 63 characters: alphanumerics at both "
                    "ends, '-', '_' and '.' inside.",
        json_schema_extra=_keys_are_label_keys("label"),
    )
    annotations: dict[str, str] | None = Field(default=None, description="Annotations added to every member pod.",
                                               json_schema_extra=_keys_are_label_keys("annotation"))


class MemberTemplate(ApiModel):
    """The pod template every member is made from (a core/v1 PodTemplateSpec)."""

    metadata: MemberTemplateMetadata | None = Field(default=None, description="Labels and annotations for member pods.")
    spec: dict[str, Any] = Field(
        description=(
            "A core/v1 PodSpec. It needs at least one container; the first container is the main one and gets the "
            "accelerator request and the TOKENFLEET_* environment variables. restartPolicy is forced to Never: a "
            "member that exits restarts the whole slice. The fields the operator relies on (containers' names, "
            "images and resources, nodeName, schedulerName, serviceAccountName) are checked here; the rest is "
            "checked by the API server when the member pods are created, and a refusal shows in the Ready "
            "condition and as a Warning Event."
        ),
        json_schema_extra=member_pod_spec_schema(),
    )


class CheckpointSpec(ApiModel):
    """Where and how often the slice saves the state it restarts from."""

    store: str = Field(
        description=(
            "Checkpoint location as a URI: pvc://CLAIM/PATH, hostpath:///PATH or file:///PATH (object stores, "
            "s3:// and gs://, are not supported). Paths have no '..' segment; hostpath:// needs the operator's "
            "--allow-host-path (a cluster administrator's opt-in) to cover PATH."
        ),
        max_length=1024,
        pattern=STORE_PATTERN,
        json_schema_extra={"x-kubernetes-validations": [
            rule("self.matches('^(" + "|".join(STORE_SCHEMES) + ")://')", UNSUPPORTED_STORE)]},
    )

    @field_validator("store", mode="before")
    @classmethod
    def _file_system_store(cls, value: Any) -> Any:
        """The scheme first, with a message that names the stores there are (objects stored before the schema
        refused object stores get it in their condition)."""
        if isinstance(value, str) and value.partition("://")[0] not in STORE_SCHEMES:
            raise ValueError(UNSUPPORTED_STORE)
        return value
    interval_seconds: int = Field(
        default=600, description="Seconds between checkpoints taken by the workload.", ge=30, le=86400
    )
    restore_on_restart: bool = Field(
        default=True,
        description=(
            "Whether a restarted gang is told to resume from the newest checkpoint committed in the store "
            "(TOKENFLEET_RESTORE_FROM is set to the store); otherwise it starts over."
        ),
    )


class RestartPolicy(ApiModel):
    """How the whole gang is restarted when a member fails: a budget and an exponential backoff."""

    model_config = with_rules(
        rule(
            "self.backoffSeconds <= self.maxBackoffSeconds",
            "backoffSeconds must not exceed maxBackoffSeconds",
            field_path=".backoffSeconds",
        ),
    )

    max_restarts: int = Field(
        default=3,
        description="Gang restarts allowed before the slice is marked Failed. 0 means a member failure fails the slice.",
        ge=0,
        le=1000,
    )
    backoff_seconds: int = Field(
        default=10,
        description="Delay before the first restart; it doubles with every further restart up to maxBackoffSeconds.",
        ge=0,
        le=3600,
    )
    max_backoff_seconds: int = Field(default=300, description="Upper bound of the restart delay.", ge=1, le=86400)
    fail_on_exit_codes: list[Annotated[int, Field(ge=1, le=255)]] | None = Field(
        default=None,
        max_length=16,
        description="Exit codes that mean a member's configuration is wrong, so that restarting cannot help: a "
                    "member container that exits with one fails the slice at once (reason ConfigurationError, "
                    "with the container's last words), spending no restart, until the spec changes. Unset means "
                    "[2], the exit code of tokenfleet serve, route and batch for bad flags, files or input; [] "
                    "restarts the gang on every failure.",
    )

    @property
    def permanent_exit_codes(self) -> list[int]:
        """failOnExitCodes, or its default when unset."""
        return [CONFIGURATION_EXIT_CODE] if self.fail_on_exit_codes is None else self.fail_on_exit_codes


class SliceSpec(ApiModel):
    """Desired state of a Slice."""

    model_config = with_rules(
        rule(
            "self.role != 'batch' || has(self.checkpoint)",
            "a batch slice needs checkpoint.store to resume from after a gang restart",
            field_path=".checkpoint",
        ),
        # The gang scheduler places every member of a Slice with an accelerator, within its queue's quota; a
        # template that names a node or another scheduler would bypass both.
        rule(
            "self.accelerator.type == 'cpu' || !has(self.template.spec.nodeName)",
            "a Slice with an accelerator is placed by the gang scheduler: its template must not set nodeName",
            field_path=".template.spec.nodeName",
        ),
        rule(
            "self.accelerator.type == 'cpu' || !has(self.template.spec.schedulerName)",
            "a Slice with an accelerator is placed by the gang scheduler: its template must not set schedulerName",
            field_path=".template.spec.schedulerName",
        ),
        rule(
            "self.accelerator.type == 'cpu' || !has(self.leaderTemplate) || !has(self.leaderTemplate.spec.nodeName)",
            "a Slice with an accelerator is placed by the gang scheduler: its leaderTemplate must not set nodeName",
            field_path=".leaderTemplate.spec.nodeName",
        ),
        rule(
            "self.accelerator.type == 'cpu' || !has(self.leaderTemplate) || "
            "!has(self.leaderTemplate.spec.schedulerName)",
            "a Slice with an accelerator is placed by the gang scheduler: its leaderTemplate must not set "
            "schedulerName",
            field_path=".leaderTemplate.spec.schedulerName",
        ),
    )

    accelerator: AcceleratorBase = Field(description="The accelerator each member (host) carries.")
    hosts: int = Field(default=1, description="Number of hosts, one member pod each.", ge=1, le=256)
    topology: str | None = Field(
        default=None,
        description=(
            "Accelerator topology of the whole slice, e.g. 2x4. Its product must equal hosts * accelerator.countPerHost; "
            "a mismatch is reported as condition Ready=False reason TopologyMismatch."
        ),
        max_length=16,
        pattern=TOPOLOGY_PATTERN,
    )
    topology_key: str = Field(
        default=DEFAULT_TOPOLOGY_KEY,
        description="Node label whose value names a topology domain (rack, node pool, zone); all members are placed in one domain.",
        max_length=317,
        pattern=LABEL_KEY_PATTERN,
    )
    priority: int = Field(
        default=0, description="Placement priority; higher slices are placed first and may preempt lower ones.", ge=-1000, le=1000000
    )
    queue: str = Field(default="default", description="Admission queue the slice waits in.", max_length=63, pattern=DNS_LABEL_PATTERN)
    role: Literal["serve", "batch"] = Field(
        default="serve", description="serve for long-running inference replicas, batch for jobs that resume from checkpoints."
    )
    template: MemberTemplate = Field(description="Template of the member pods (of every member but the leader when "
                                                 "leaderTemplate is set).")
    leader_template: MemberTemplate | None = Field(
        default=None,
        description="Template of the leader (member 0), as in LeaderWorkerSet; unset uses template. It must hold "
                    "as many accelerators as template (the gang scheduler places equal members).",
    )
    checkpoint: CheckpointSpec | None = Field(default=None, description="Checkpoint settings; unset means the gang restarts cold.")
    restart_policy: RestartPolicy = Field(
        default_factory=RestartPolicy,
        description="Gang restart budget and backoff.",
        json_schema_extra={"default": RestartPolicy().to_wire()},
    )


class SliceMembers(ApiModel):
    """Member pod counts."""

    desired: int = Field(default=0, description="Members the slice needs (spec.hosts).", ge=0)
    scheduled: int = Field(default=0, description="Members bound to a node.", ge=0)
    ready: int = Field(default=0, description="Members whose pod is Ready (in a batch slice: or finished).", ge=0)
    succeeded: int | None = Field(default=None, description="Batch slices: members that exited successfully.", ge=0)


class MemberPlacement(ApiModel):
    """Where one member runs."""

    member: int = Field(description="Member index, 0 to hosts-1; member 0 is the leader.", ge=0)
    pod: str = Field(description="Name of the member pod.")
    node: str | None = Field(default=None, description="Node the pod is bound to, if any.")
    domain: str | None = Field(default=None, description="Value of the topology-domain label on that node.")


class LastRestart(ApiModel):
    """The most recent gang restart."""

    time: str = Field(description="When the restart began (RFC 3339).", json_schema_extra={"format": "date-time"})
    reason: str = Field(description="Why: MemberFailed, MemberDeleted, ContainerRestarted or NodeLost.")
    member: int | None = Field(default=None, description="Index of the member that failed first.", ge=0)
    message: str = Field(default="", description="Details, e.g. the failed pod and its exit reason.")


class CheckpointStatus(ApiModel):
    """What the slice knows about its checkpoints."""

    latest: str | None = Field(
        default=None,
        description=(
            "Identifier of the latest committed checkpoint, as the leader member last reported it "
            "(tokenfleet_batch_checkpoint_timestamp_seconds on its metrics port)."
        ),
    )
    saved_at: str | None = Field(default=None, description="When the latest checkpoint was saved (RFC 3339).")
    restored_at: str | None = Field(default=None, description="When the gang last resumed from a checkpoint (RFC 3339).")


class AdmissionStatus(ApiModel):
    """How long the current attempt of the gang waited for the gang scheduler."""

    queued_at: str | None = Field(
        default=None, description="When the current attempt started waiting for admission (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    admitted_at: str | None = Field(
        default=None, description="When every member of the current attempt was bound (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    wait_seconds: int | None = Field(
        default=None, description="Seconds from queuedAt to admittedAt, or waited so far while still pending.", ge=0
    )
    requeues: int | None = Field(
        default=None, description="Admission timeouts so far (each holds the Slice back before it queues again).", ge=0
    )
    requeue_at: str | None = Field(
        default=None, description="While held back after an admission timeout: when the Slice queues again (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )


class SliceStatus(ApiModel):
    """Observed state of a Slice, written only by the operator."""

    phase: SlicePhase = Field(
        default="Pending",
        description=(
            "Pending: waiting for admission (member pods exist but none is bound). Admitted: a placement was found and "
            "the members are being bound. Placing: every member is bound, not all ready. Ready: every member ready. "
            "Degraded: was Ready, a member is not ready. Restarting: the "
            "gang was torn down after a failure and waits for backoff. Failed: restart budget exhausted or invalid spec. "
            "Succeeded: a batch slice whose members all exited successfully (condition Complete)."
        ),
    )
    members: SliceMembers = Field(default_factory=SliceMembers, description="Member counts.")
    placement: list[MemberPlacement] | None = Field(
        default=None,
        description="Where each member runs.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["member"]},
    )
    admission: AdmissionStatus | None = Field(
        default=None, description="Admission wait of the current attempt (gang-scheduled Slices only)."
    )
    restarts: int = Field(default=0, description="Gang restarts since the spec last changed.", ge=0)
    last_restart: LastRestart | None = Field(default=None, description="The most recent gang restart.")
    restart_not_before: str | None = Field(
        default=None, description="Backoff: the gang is not recreated before this time (RFC 3339)."
    )
    revision: str | None = Field(default=None, description="Hash of the spec the current member pods were made from.")
    checkpoint: CheckpointStatus | None = Field(default=None, description="Checkpoint bookkeeping.")
    observed_generation: int | None = Field(default=None, description="The metadata.generation last reconciled.")
    conditions: Conditions | None = Field(
        default=None,
        description=(
            "Admitted, Placed, Ready and Failed (batch Slices also Complete), plus kstatus' Reconciling (the operator "
            "works toward the spec) and Stalled (only a new spec helps), each with a reason and a message."
        ),
    )


class Slice(Resource):
    """A Slice is a gang of member pods placed, run and restarted as one unit."""

    crd: ClassVar[CrdInfo] = CrdInfo(
        kind="Slice",
        plural="slices",
        singular="slice",
        short_names=("tfslice", "gang"),
        categories=("tokenfleet",),
        description=(
            "A Slice is a gang of member pods, one per host, that is admitted, placed, run and restarted as one unit "
            "(all members or none), like a multi-host accelerator slice. An InferenceService makes one per replica."
        ),
        printer_columns=(
            PrinterColumn("Accelerator", "string", ".spec.accelerator.type", "Accelerator type"),
            PrinterColumn("Topology", "string", ".spec.topology", "Accelerator topology"),
            PrinterColumn("Hosts", "integer", ".spec.hosts", "Member pods (hosts)"),
            PrinterColumn("Ready", "integer", ".status.members.ready", "Ready members"),
            PrinterColumn("Phase", "string", ".status.phase", "Lifecycle phase"),
            PrinterColumn("Restarts", "integer", ".status.restarts", "Gang restarts"),
            PrinterColumn("Age", "date", ".metadata.creationTimestamp", "Time since creation"),
            PrinterColumn("Role", "string", ".spec.role", "serve or batch", priority=1),
            PrinterColumn("Queue", "string", ".spec.queue", "Admission queue", priority=1),
            PrinterColumn("Reason", "string", '.status.conditions[?(@.type=="Ready")].reason', "Reason of the Ready condition", priority=1),
            PrinterColumn("Checkpoint", "string", ".status.checkpoint.latest", "Latest checkpoint", priority=1),
        ),
        root_validations=(
            rule(
                "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 55",
                "metadata.name must be a DNS-1035 label of at most 55 characters (member pods are named NAME-INDEX)",
                reason="FieldValueInvalid",
            ),
        ),
    )

    kind: str = Field(default="Slice", description="Slice")
    spec: SliceSpec = Field(description="Desired state of the slice.")
    status: SliceStatus | None = Field(default=None, description="Observed state of the slice.")
