"""Types shared by InferenceService and Slice: the base model, conditions,
accelerators, resource quantities, and the CRD metadata each resource carries.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "tokenfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# The regular expression Kubernetes uses for resource.Quantity strings.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# A DNS-1123 label (names of PVCs, queues, priority classes, ...).
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# A label key such as "topology.kubernetes.io/zone" or "rack".
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
# An accelerator topology such as "1", "2x4" or "4x4x8".
TOPOLOGY_PATTERN = r"^[1-9][0-9]{0,3}(x[1-9][0-9]{0,3}){0,2}$"
# An extended resource name such as "nvidia.com/gpu" or "google.com/tpu".
RESOURCE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"

Quantity = Annotated[
    int | str,
    Field(json_schema_extra={"pattern": QUANTITY_PATTERN}),
]


def rule(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict[str, str]:
    """One ``x-kubernetes-validations`` entry: a CEL rule checked by the API server."""
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


class ApiModel(BaseModel):
    """Base for every API type: camelCase on the wire, snake_case in Python.

    Unknown fields are ignored rather than rejected so that an older operator
    can read objects written against a newer CRD (the API server prunes
    fields the installed CRD does not know about anyway).
    """

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def to_wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase, unset fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class Condition(ApiModel):
    """A condition in the style of metav1.Condition: one aspect of the object's state."""

    type: str = Field(
        description="Type of the condition in CamelCase, e.g. Ready.",
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds: True, False or Unknown.")
    reason: str = Field(
        description="A CamelCase, machine-readable reason for the condition's last transition.",
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
    )
    message: str = Field(
        default="",
        description="A human-readable explanation of the condition, saying what to do about it when it is bad.",
        max_length=32768,
    )
    last_transition_time: str = Field(
        description="When the status last changed (RFC 3339). It does not change when only reason or message change.",
        json_schema_extra={"format": "date-time"},
    )
    observed_generation: int | None = Field(
        default=None,
        description="The metadata.generation of the object this condition was computed from.",
        ge=0,
    )


Conditions = Annotated[
    list[Condition],
    Field(json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}),
]


class AcceleratorBase(ApiModel):
    """Which accelerator each host carries and how many of them."""

    type: str = Field(
        description=(
            "Accelerator model, e.g. nvidia-h100-80gb, nvidia-l4, tpu-v5e or cpu. Member pods select nodes whose "
            "tokenfleet.dev/accelerator label has this value; the value cpu requests no accelerator and selects any node."
        ),
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
    )
    resource_name: str = Field(
        default="nvidia.com/gpu",
        description="The extended resource each member pod requests countPerHost of, e.g. nvidia.com/gpu or google.com/tpu. Ignored when type is cpu.",
        max_length=253,
        pattern=RESOURCE_NAME_PATTERN,
    )
    count_per_host: int = Field(
        default=1,
        description="Accelerators per host (per member pod).",
        ge=1,
        le=64,
    )


class ResourceRequirements(ApiModel):
    """CPU and memory (and any other resource) requests and limits for a container."""

    requests: dict[str, Quantity] | None = Field(
        default=None, description="Minimum resources the container needs, e.g. {cpu: '4', memory: 32Gi}."
    )
    limits: dict[str, Quantity] | None = Field(
        default=None, description="Maximum resources the container may use, e.g. {memory: 64Gi}."
    )


@dataclass(frozen=True)
class PrinterColumn:
    """One column of ``kubectl get`` output."""

    name: str
    type: Literal["string", "integer", "number", "boolean", "date"]
    json_path: str
    description: str
    priority: int = 0


@dataclass(frozen=True)
class CrdInfo:
    """What a CustomResourceDefinition needs besides the schema."""

    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    categories: tuple[str, ...]
    description: str
    printer_columns: tuple[PrinterColumn, ...]
    scale: bool = False
    # Kubernetes validates these on the whole object (CEL rules may look at metadata.name).
    root_validations: tuple[dict[str, str], ...] = field(default_factory=tuple)


class Resource(ApiModel):
    """Base of a top-level resource: apiVersion, kind, metadata, spec, status."""

    crd: ClassVar[CrdInfo]

    api_version: str = Field(default=API_VERSION, description="tokenfleet.dev/v1alpha1")
    kind: str = Field(description="The kind of the object.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
