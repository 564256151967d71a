"""Types shared by InferenceService and Slice: the base model, conditions,
accelerators, resource quantities, and the CRD metadata each resource carries.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "tokenfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Kubernetes' resource.Quantity strings without the minus sign: no resource can be negative, and a negative
# request is refused by the API server only when the operator creates the pod (issue 19, defect 7).
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
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

# The largest quantity the API accepts, 8Pi = 2**53: Kubernetes counts cpu in milli-units in an int64, so
# anything above about 9.2e15 overflows it (issue 37, defect 9: cpu 1e999 was accepted).
MAX_QUANTITY = "8Pi"
MAX_QUANTITY_VALUE = Decimal(2) ** 53
_SUFFIXES: dict[str, Decimal] = {"": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal("1e3"),
             "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"), "P": Decimal("1e15"), "E": Decimal("1e18"),
             **{f"{p}i": Decimal(1024) ** (i + 1) for i, p in enumerate("KMGTPE")}}


def quantity_value(quantity: int | str) -> Decimal | None:
    """The value of a resource.Quantity string (or int); None when it is not one (the schema's pattern says so)."""
    match = re.fullmatch(r"\+?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([a-zA-Z]{0,2}|[eE][-+]?[0-9]+)", str(quantity))
    if match is None:
        return None
    number, suffix = match.groups()
    if suffix in _SUFFIXES:
        return Decimal(number) * _SUFFIXES[suffix]
    return Decimal(number + suffix) if suffix[1:].lstrip("+-").isdigit() else None   # exact, whatever the exponent


def _countable(quantity: int | str) -> int | str:
    value = quantity_value(quantity)
    if value is not None and value > MAX_QUANTITY_VALUE:
        raise ValueError(f"{quantity} is more than Kubernetes can count: at most {MAX_QUANTITY}")
    return quantity


Quantity = Annotated[
    int | str,
    Field(json_schema_extra={
        "pattern": QUANTITY_PATTERN, "minimum": 0, "maximum": int(MAX_QUANTITY_VALUE), "maxLength": 64,
        "x-kubernetes-validations": [{
            "rule": f"!isQuantity(string(self)) || !quantity(string(self)).isGreaterThan(quantity('{MAX_QUANTITY}'))",
            "message": f"must be at most {MAX_QUANTITY} (2^53): a larger quantity overflows Kubernetes' 64-bit count of milli-units"}],
    }),
    AfterValidator(_countable),
]

# One segment of a path that cannot climb out of where it is mounted: anything but "." and "..".
PATH_SEGMENT = r"([^/.][^/]*|[.][^/.][^/]*|[.][.][^/]+)"
# A path below a mount point, e.g. "llama-3/8b" (no "..", no leading "/").
RELATIVE_PATH_PATTERN = rf"^{PATH_SEGMENT}(/{PATH_SEGMENT})*/?$"
# An absolute path other than "/" without "..", e.g. "/data/models".
ABSOLUTE_PATH_PATTERN = rf"^(/{PATH_SEGMENT})+/?$"
# A container image reference: no whitespace anywhere (the API server refuses leading or trailing spaces only
# when the pod is created).
IMAGE_PATTERN = r"^\S+$"
# A label value: at most 63 characters, alphanumerics at both ends, '-', '_' and '.' inside.
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# Resource names a serving pod may request besides its accelerators.
STANDARD_RESOURCE_PATTERN = r"^(cpu|memory|ephemeral-storage|hugepages-[0-9]+(\.[0-9]+)?[KMGTPE]?i?)$"
# Resource names a container may request: the standard ones, or an extended resource with a domain.
CONTAINER_RESOURCE_PATTERN = (
    r"^(cpu|memory|ephemeral-storage|hugepages-[0-9]+(\.[0-9]+)?[KMGTPE]?i?|"
    r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$"
)


def rule(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict[str, Any]:
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


def with_rules(*rules: dict[str, Any]) -> ConfigDict:
    """ApiModel's config plus CEL rules on the object itself (its ``x-kubernetes-validations``)."""
    return ConfigDict(**ApiModel.model_config, json_schema_extra={"x-kubernetes-validations": list(rules)})


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
        description="The extended resource each member pod requests countPerHost of, e.g. nvidia.com/gpu or google.com/tpu. "
                    "Ignored when type is cpu.",
        max_length=253,
        pattern=RESOURCE_NAME_PATTERN,
    )
    count_per_host: int = Field(
        default=1,
        description="Accelerators per host (per member pod).",
        ge=1,
        le=64,
    )


def _request_within_limit() -> dict[str, Any]:
    """CEL: every request is at most its limit (the API server would refuse the pod otherwise)."""
    def q(side: str) -> str:
        return f"string(self.{side}[k])"
    return rule(
        "!has(self.requests) || !has(self.limits) || self.requests.all(k, !(k in self.limits) || "
        f"!isQuantity({q('requests')}) || !isQuantity({q('limits')}) || "
        f"!quantity({q('requests')}).isGreaterThan(quantity({q('limits')})))",
        "every request must be at most its limit (e.g. requests.memory <= limits.memory)",
        field_path=".requests",
    )


def _resource_map(description: str, key_pattern: str, key_message: str) -> Any:
    return Field(default=None, description=description, json_schema_extra={
        "maxProperties": 32,
        "x-kubernetes-validations": [rule(f"self.all(k, k.matches(r'{key_pattern}'))", key_message)],
    })


class ResourceRequirements(ApiModel):
    """CPU and memory requests and limits of a container the operator builds; accelerators come from
    spec.accelerator, so no other resource may be named here."""

    model_config = with_rules(_request_within_limit())

    requests: dict[str, Quantity] | None = _resource_map(
        "Minimum resources the container needs, e.g. {cpu: '4', memory: 32Gi}: cpu, memory, ephemeral-storage or "
        "hugepages-<size>.", STANDARD_RESOURCE_PATTERN,
        "resource names must be cpu, memory, ephemeral-storage or hugepages-<size>; accelerators come from "
        "spec.accelerator")
    limits: dict[str, Quantity] | None = _resource_map(
        "Maximum resources the container may use, e.g. {memory: 64Gi}; at least the request.", STANDARD_RESOURCE_PATTERN,
        "resource names must be cpu, memory, ephemeral-storage or hugepages-<size>; accelerators come from "
        "spec.accelerator")


class ContainerResources(ApiModel):
    """Requests and limits of a container in a Slice's member template (core/v1 ResourceRequirements)."""

    model_config = with_rules(_request_within_limit())

    requests: dict[str, Quantity] | None = _resource_map(
        "Minimum resources the container needs.", CONTAINER_RESOURCE_PATTERN,
        "resource names must be cpu, memory, ephemeral-storage, hugepages-<size> or an extended resource such as "
        "nvidia.com/gpu")
    limits: dict[str, Quantity] | None = _resource_map(
        "Maximum resources the container may use; at least the request.", CONTAINER_RESOURCE_PATTERN,
        "resource names must be cpu, memory, ephemeral-storage, hugepages-<size> or an extended resource such as "
        "nvidia.com/gpu")


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
