"""InferenceService: a model served by N replicas, each replica one Slice,
behind an operator-managed router.
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from tokenfleet_operator.api.common import (
    DNS_LABEL_PATTERN,
    LABEL_KEY_PATTERN,
    TOPOLOGY_PATTERN,
    AcceleratorBase,
    ApiModel,
    Conditions,
    CrdInfo,
    PrinterColumn,
    Resource,
    ResourceRequirements,
    rule,
)
from tokenfleet_operator.api.slice import DEFAULT_TOPOLOGY_KEY, CheckpointSpec, RestartPolicy

DEFAULT_IMAGE = "tokenfleet/serving:0.1.0"


def _defaulted(model: type[ApiModel], description: str):
    """A sub-object that is always present: the API server fills in its defaults even when the user omits it.

    The default is the fully defaulted object (not {}), because the API server
    checks defaults against the CEL rules before filling in nested defaults."""
    return Field(default_factory=model, description=description, json_schema_extra={"default": model().to_wire()})


class PvcSource(ApiModel):
    """Model weights on a PersistentVolumeClaim, mounted read-only at /models."""

    claim_name: str = Field(description="Name of the PVC in the InferenceService's namespace.", max_length=253, pattern=DNS_LABEL_PATTERN)
    sub_path: str | None = Field(
        default=None,
        description="Directory inside the volume that holds the model (config.json, weights, tokenizer).",
        max_length=1024,
        pattern=r"^[^/].*$",
    )


class HostPathSource(ApiModel):
    """Model weights in a directory on every node, mounted read-only at /models."""

    path: str = Field(description="Absolute directory on the node.", max_length=1024, pattern=r"^/.*$")


class ModelSpec(ApiModel):
    """Where the weights come from and the names clients use for the model."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                rule(
                    "(has(self.path) ? 1 : 0) + (has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) == 1",
                    "exactly one of model.path, model.pvc or model.hostPath must be set",
                ),
            ]
        }
    }

    path: str | None = Field(
        default=None, description="Absolute directory of the model inside the serving image.", max_length=1024, pattern=r"^/.*$"
    )
    pvc: PvcSource | None = Field(default=None, description="Load the model from a PersistentVolumeClaim.")
    host_path: HostPathSource | None = Field(default=None, description="Load the model from a directory on the node.")
    served_model_names: list[Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\s]+$")]] = Field(
        description="Names clients pass as 'model' in OpenAI requests; the first one is shown by kubectl get.",
        min_length=1,
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )


class AcceleratorSpec(AcceleratorBase):
    """The accelerators of one replica: countPerHost on each of hostsPerReplica hosts."""

    hosts_per_replica: int = Field(
        default=1, description="Hosts (member pods) per replica; more than one makes a multi-host slice.", ge=1, le=256
    )
    topology: str | None = Field(
        default=None,
        description="Accelerator topology of one replica, e.g. 2x4; its product must equal countPerHost * hostsPerReplica.",
        max_length=16,
        pattern=TOPOLOGY_PATTERN,
    )


class SpeculativeDecoding(ApiModel):
    """Speculative decoding: propose several tokens cheaply and verify them in one step."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                rule(
                    "self.method != 'draft' || has(self.draftModel)",
                    "method draft needs draftModel",
                    field_path=".draftModel",
                ),
            ]
        }
    }

    method: Literal["ngram", "draft"] = Field(
        description="ngram proposes tokens by prompt lookup; draft runs the smaller draftModel."
    )
    num_speculative_tokens: int = Field(default=4, description="Tokens proposed per step.", ge=1, le=16)
    draft_model: str | None = Field(
        default=None, description="Directory of the draft model inside the serving container (method draft).", max_length=1024
    )


class EngineSpec(ApiModel):
    """Settings of the continuously batched engine."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                rule(
                    "!has(self.maxNumBatchedTokens) || self.maxNumBatchedTokens >= self.maxNumSeqs",
                    "maxNumBatchedTokens must be at least maxNumSeqs (every running sequence needs a token per step)",
                    field_path=".maxNumBatchedTokens",
                ),
                rule(
                    "self.quantization == 'none' || self.dtype != 'float32'",
                    "quantized weights need dtype auto, float16 or bfloat16, not float32",
                    field_path=".dtype",
                ),
            ]
        }
    }

    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto", description="Activation and weight dtype; auto uses the model's own."
    )
    max_model_len: int | None = Field(
        default=None, description="Maximum context (prompt + output tokens); unset uses the model's.", ge=16, le=1048576
    )
    kv_block_size: Literal[8, 16, 32, 64, 128] = Field(default=16, description="Tokens per KV-cache block.")
    max_num_batched_tokens: int | None = Field(
        default=None, description="Token budget of one engine step (prefill chunks plus decodes).", ge=16, le=1048576
    )
    max_num_seqs: int = Field(default=256, description="Sequences running at once.", ge=1, le=4096)
    enable_prefix_caching: bool = Field(default=True, description="Reuse KV blocks of shared prompt prefixes.")
    quantization: Literal["none", "int8", "fp8", "awq", "gptq"] = Field(
        default="none", description="Weight quantization method."
    )
    speculative_decoding: SpeculativeDecoding | None = Field(default=None, description="Unset disables speculative decoding.")
    extra_args: list[Annotated[str, Field(max_length=256)]] | None = Field(
        default=None,
        description="Extra command-line flags appended to 'tokenfleet serve' verbatim.",
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )


class SessionAffinity(ApiModel):
    """Send requests of one session to one replica so its KV cache is reused."""

    enabled: bool = Field(default=False, description="Whether session affinity is on.")
    header: str = Field(
        default="x-session-id", description="Request header that names the session.", max_length=128, pattern=r"^[A-Za-z0-9-]+$"
    )
    ttl_seconds: int = Field(default=600, description="Idle seconds after which a session may move.", ge=1, le=86400)


class RoutingSpec(ApiModel):
    """How the router spreads requests over replicas, and the router's own Deployment."""

    policy: Literal["round-robin", "least-load", "prefix-aware", "kv-aware"] = Field(
        default="prefix-aware",
        description=(
            "round-robin cycles; least-load picks the replica with the fewest queued and running requests; prefix-aware "
            "prefers the replica that served the longest shared prompt prefix; kv-aware also weighs KV-cache usage."
        ),
    )
    session_affinity: SessionAffinity = _defaulted(SessionAffinity, "Session affinity.")
    replicas: int = Field(default=1, description="Router pods.", ge=1, le=16)
    resources: ResourceRequirements | None = Field(default=None, description="Resources of each router pod.")


class SloSpec(ApiModel):
    """Latency objectives; goodput counts tokens served within them."""

    time_to_first_token_ms: int | None = Field(
        default=None, description="Target time to first token in milliseconds.", ge=1, le=600000
    )
    time_per_output_token_ms: int | None = Field(
        default=None, description="Target time per output token after the first, in milliseconds.", ge=1, le=60000
    )
    percentile: Literal[50, 90, 95, 99] = Field(default=95, description="Percentile the targets apply to.")


class PriceSpec(ApiModel):
    """What the fleet costs, to report dollars per hour and per million tokens."""

    accelerator_per_hour: float = Field(default=0.0, description="Price of one accelerator for one hour.", ge=0, le=10000)
    overhead_per_hour: float = Field(
        default=0.0, description="Other cost of one replica per hour (CPU, memory, network).", ge=0, le=100000
    )
    currency: str = Field(default="USD", description="ISO 4217 currency code of the prices.", pattern=r"^[A-Z]{3}$")


class SlicePolicy(ApiModel):
    """How the Slice of each replica is placed and restarted."""

    topology_key: str = Field(
        default=DEFAULT_TOPOLOGY_KEY,
        description="Node label naming a topology domain; all hosts of a replica are placed in one domain.",
        max_length=317,
        pattern=LABEL_KEY_PATTERN,
    )
    priority: int = Field(default=0, description="Placement priority of the replicas' slices.", ge=-1000, le=1000000)
    queue: str = Field(default="default", description="Admission queue of the replicas' slices.", max_length=63, pattern=DNS_LABEL_PATTERN)
    restart_policy: RestartPolicy = _defaulted(RestartPolicy, "Gang restart budget and backoff of each replica.")
    checkpoint: CheckpointSpec | None = Field(default=None, description="Warm-restart checkpoint settings of each replica.")


class RolloutSpec(ApiModel):
    """How a spec change rolls over the replicas."""

    max_unavailable: int = Field(
        default=1, description="Ready replicas that may be replaced at the same time during a rollout.", ge=1, le=1000
    )


class InferenceServiceSpec(ApiModel):
    """Desired state of an InferenceService."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                rule(
                    "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
                    "minReplicas must not exceed maxReplicas",
                    field_path=".minReplicas",
                ),
                rule(
                    "!has(self.minReplicas) || self.replicas >= self.minReplicas",
                    "replicas must be at least minReplicas",
                    field_path=".replicas",
                ),
                rule(
                    "!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
                    "replicas must not exceed maxReplicas",
                    field_path=".replicas",
                ),
            ]
        }
    }

    model: ModelSpec = Field(description="The model to serve.")
    replicas: int = Field(default=1, description="Serving replicas; each replica is one Slice.", ge=0, le=1000)
    min_replicas: int | None = Field(default=None, description="Lower bound for autoscaling.", ge=0, le=1000)
    max_replicas: int | None = Field(default=None, description="Upper bound for autoscaling.", ge=1, le=1000)
    accelerator: AcceleratorSpec = Field(description="Accelerators of one replica.")
    engine: EngineSpec = _defaulted(EngineSpec, "Engine settings.")
    routing: RoutingSpec = _defaulted(RoutingSpec, "Routing policy and the router Deployment.")
    slo: SloSpec = _defaulted(SloSpec, "Latency objectives.")
    price: PriceSpec = _defaulted(PriceSpec, "Prices used for cost reporting.")
    image: str = Field(default=DEFAULT_IMAGE, description="Serving image; the router runs from it too.", min_length=1, max_length=512)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Pull policy of the serving and router containers."
    )
    resources: ResourceRequirements = _defaulted(
        ResourceRequirements, "CPU and memory of each serving pod (accelerators come from accelerator)."
    )
    slice_policy: SlicePolicy = _defaulted(SlicePolicy, "Placement and restart policy of each replica's Slice.")
    rollout: RolloutSpec = _defaulted(RolloutSpec, "How spec changes roll over the replicas.")


class SliceSummary(ApiModel):
    """One replica's Slice as seen by its InferenceService."""

    name: str = Field(description="Name of the Slice.")
    phase: str = Field(default="Pending", description="The Slice's phase.")
    ready: bool = Field(default=False, description="Whether every member of the Slice is ready.")
    updated: bool = Field(default=False, description="Whether the Slice runs the current spec.")


class CostStatus(ApiModel):
    """Cost of the service at its current size."""

    dollars_per_hour: float | None = Field(
        default=None, description="Replicas * (accelerators per replica * acceleratorPerHour + overheadPerHour), in price.currency."
    )
    tokens_per_hour: float | None = Field(
        default=None,
        description="Output tokens per hour of the ready replicas, at the rate they measured over their last minute "
        "(tokenfleet:output_tokens_per_second on each replica's /metrics).",
    )
    cost_per_million_tokens: float | None = Field(
        default=None, description="dollarsPerHour / tokensPerHour * 1e6; absent while no tokens are being served."
    )


class GoodputStatus(ApiModel):
    """Share of served tokens that met the SLOs."""

    ratio: float | None = Field(default=None, description="Tokens served within SLO over all tokens served.", ge=0, le=1)
    window: str | None = Field(default=None, description="Window the ratio is measured over, e.g. 1h.")


class InferenceServiceStatus(ApiModel):
    """Observed state of an InferenceService, written only by the operator."""

    replicas: int = Field(default=0, description="Slices that exist for this service.", ge=0)
    ready_replicas: int = Field(default=0, description="Slices whose members are all ready.", ge=0)
    updated_replicas: int = Field(default=0, description="Slices running the current spec.", ge=0)
    selector: str | None = Field(default=None, description="Label selector of the serving pods (for the scale subresource).")
    url: str | None = Field(default=None, description="In-cluster URL of the router.")
    slices: list[SliceSummary] | None = Field(
        default=None,
        description="The replicas' Slices.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    cost: CostStatus | None = Field(default=None, description="Cost at the current size.")
    goodput: GoodputStatus | None = Field(default=None, description="SLO goodput (filled from metrics).")
    observed_generation: int | None = Field(default=None, description="The metadata.generation last reconciled.")
    conditions: Conditions | None = Field(
        default=None, description="Ready, SlicesReady, RouterReady and Degraded, each with a reason and a message."
    )


class InferenceService(Resource):
    """An InferenceService serves one model from N replicas behind a router."""

    crd: ClassVar[CrdInfo] = CrdInfo(
        kind="InferenceService",
        plural="inferenceservices",
        singular="inferenceservice",
        short_names=("tfis", "infsvc"),
        categories=("tokenfleet",),
        description=(
            "An InferenceService serves one model from spec.replicas replicas. Each replica is a Slice (a gang of "
            "hosts placed and restarted together); a router Deployment spreads requests over them."
        ),
        printer_columns=(
            PrinterColumn("Model", "string", ".spec.model.servedModelNames[0]", "First served model name"),
            PrinterColumn("Accelerator", "string", ".spec.accelerator.type", "Accelerator type"),
            PrinterColumn("Desired", "integer", ".spec.replicas", "Desired replicas"),
            PrinterColumn("Ready", "integer", ".status.readyReplicas", "Ready replicas"),
            PrinterColumn("Up-to-date", "integer", ".status.updatedReplicas", "Replicas running the current spec"),
            PrinterColumn("$/h", "number", ".status.cost.dollarsPerHour", "Cost per hour at the current size"),
            PrinterColumn("$/MTok", "number", ".status.cost.costPerMillionTokens", "Cost per million tokens"),
            PrinterColumn("Reason", "string", '.status.conditions[?(@.type=="Ready")].reason', "Reason of the Ready condition"),
            PrinterColumn("Age", "date", ".metadata.creationTimestamp", "Time since creation"),
            PrinterColumn("URL", "string", ".status.url", "Router URL", priority=1),
            PrinterColumn("Goodput", "number", ".status.goodput.ratio", "Share of tokens within SLO", priority=1),
            PrinterColumn("Topology", "string", ".spec.accelerator.topology", "Topology of one replica", priority=1),
        ),
        scale=True,
        root_validations=(
            rule(
                "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 40",
                "metadata.name must be a DNS-1035 label of at most 40 characters (it names Services and Slices)",
                reason="FieldValueInvalid",
            ),
        ),
    )

    kind: str = Field(default="InferenceService", description="InferenceService")
    spec: InferenceServiceSpec = Field(description="Desired state of the service.")
    status: InferenceServiceStatus | None = Field(default=None, description="Observed state of the service.")
