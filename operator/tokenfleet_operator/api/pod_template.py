"""The part of a Slice's member PodSpec the API server checks up front.

A Slice's ``template.spec`` is a whole core/v1 PodSpec, kept verbatim (``x-kubernetes-preserve-unknown-fields``).
The fields below are typed on top of that, so that a template the API server would refuse as a pod is refused
as a Slice already, with a message naming the field, instead of failing later when the operator creates the
member pods: container names (a DNS label, unique across containers and initContainers), images (no
whitespace), resource names and quantities (no negative quantity, no request above its limit), the
serviceAccountName's form, and whether nodeName or schedulerName is set (a gang-scheduled Slice may set
neither: ``SliceSpec``'s rules).

What the schema cannot know (a ServiceAccount that does not exist, PodSecurity admission of the namespace) is
refused when the pods are created; the Slice then shows the API server's reason and message.
"""
from __future__ import annotations

from typing import Any

from tokenfleet_operator.api.common import DNS_LABEL_PATTERN, IMAGE_PATTERN, ContainerResources

DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MAX_CONTAINERS = 32


def _resources_schema() -> dict[str, Any]:
    schema = ContainerResources.model_json_schema(by_alias=True)
    assert "$defs" not in schema, "ContainerResources must render without references"
    return {**schema, "description": "Requests and limits of the container (core/v1 ResourceRequirements)."}


def _container_schema(what: str) -> dict[str, Any]:
    return {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "required": ["name", "image"],
        "properties": {
            "name": {"type": "string", "description": f"Name of the {what}: a DNS label, unique in the pod.",
                     "maxLength": 63, "pattern": DNS_LABEL_PATTERN},
            "image": {"type": "string", "description": f"Image of the {what}, without whitespace.",
                      "minLength": 1, "maxLength": 1024, "pattern": IMAGE_PATTERN},
            "resources": _resources_schema(),
        },
    }


def _containers(description: str, what: str, min_items: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "array",
        "description": description,
        "maxItems": MAX_CONTAINERS,
        "items": _container_schema(what),
        # names are unique: the API server refuses a second container of one name here already
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    }
    if min_items:
        out["minItems"] = min_items
    return out


def member_pod_spec_schema() -> dict[str, Any]:
    """The typed part of ``template.spec`` (merged into the field's schema; everything else is kept as is)."""
    return {
        "x-kubernetes-preserve-unknown-fields": True,
        "required": ["containers"],
        "properties": {
            "containers": _containers(
                "The member's containers; the first is the main one (accelerators, TOKENFLEET_* environment).",
                "container", 1),
            "initContainers": _containers("Init containers; their accelerator requests count too.", "init container", 0),
            "nodeName": {"type": "string", "description": (
                "Not allowed for Slices with an accelerator (the gang scheduler places them); a cpu Slice may "
                "name a node.")},
            "schedulerName": {"type": "string", "description": (
                "Not allowed for Slices with an accelerator (the gang scheduler places them).")},
            "serviceAccountName": {"type": "string", "description": (
                "ServiceAccount the members run as; it must exist when the pods are created."),
                "maxLength": 253, "pattern": DNS_SUBDOMAIN_PATTERN},
        },
        "x-kubernetes-validations": [{
            "rule": "!has(self.initContainers) || self.initContainers.all(i, self.containers.all(c, c.name != i.name))",
            "message": "container names must be unique across containers and initContainers",
            "fieldPath": ".initContainers",
        }],
    }
