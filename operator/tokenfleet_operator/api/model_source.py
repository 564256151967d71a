"""Where a model's weights come from: one type for every model source of the API.

The served model (``spec.model``), the draft model of speculative decoding
(``spec.engine.speculativeDecoding.draftModel``) and any source added later are a ``ModelSource`` (or extend
it), so the schema refuses the same paths everywhere and ``model_sources`` finds every one of them in a spec
for the operator's host-path policy (``validation.model_source_problems``). A field that names a PVC or a
host path outside a ``ModelSource`` fails ``tests/unit/operator/test_model_sources.py``.
"""
from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel, Field

from tokenfleet_operator.api.common import ABSOLUTE_PATH_PATTERN, DNS_LABEL_PATTERN, RELATIVE_PATH_PATTERN, ApiModel, rule, with_rules


class PvcSource(ApiModel):
    """Weights on a PersistentVolumeClaim, mounted read-only."""

    claim_name: str = Field(description="Name of the PVC in the InferenceService's namespace.", max_length=253, pattern=DNS_LABEL_PATTERN)
    sub_path: str | None = Field(
        default=None,
        description="Directory inside the volume that holds the model (config.json, weights, tokenizer); relative, "
                    "without '..'.",
        max_length=1024,
        pattern=RELATIVE_PATH_PATTERN,
    )


class HostPathSource(ApiModel):
    """Weights in a directory on every node, mounted read-only.

    A host path reaches into the node, so the operator mounts one only under a prefix a cluster administrator
    allowed (``tokenfleet operator --allow-host-path PREFIX``); otherwise the service is Ready=False with
    reason HostPathNotAllowed."""

    path: str = Field(
        description="Absolute directory on the node, other than / and without '..'; it must lie under a prefix the "
                    "operator was started with (--allow-host-path), else the service is not reconciled "
                    "(reason HostPathNotAllowed).",
        max_length=1024, pattern=ABSOLUTE_PATH_PATTERN)


class ModelSource(ApiModel):
    """A checkpoint directory: exactly one of path (inside the image), pvc or hostPath."""

    model_config = with_rules(
        rule(
            "(has(self.path) ? 1 : 0) + (has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) == 1",
            "exactly one of path, pvc or hostPath must be set",
        ),
    )

    path: str | None = Field(
        default=None, description="Absolute directory inside the serving image, other than / and without '..'.",
        max_length=1024, pattern=ABSOLUTE_PATH_PATTERN,
    )
    pvc: PvcSource | None = Field(default=None, description="Load the weights from a PersistentVolumeClaim.")
    host_path: HostPathSource | None = Field(
        default=None, description="Load the weights from a directory on the node, if a cluster administrator allowed "
        "it (the operator's --allow-host-path).",
    )


def model_sources(obj: BaseModel, at: str = "spec") -> Iterator[tuple[str, ModelSource]]:
    """Every ModelSource set in ``obj``, with its field path as the API names it (camelCase, from ``at``).

    It walks the object itself rather than a list of known fields, so a source added to the API later is
    found (and policed) without touching this function."""
    if isinstance(obj, ModelSource):
        yield at, obj
    for name, info in type(obj).model_fields.items():
        value, field = getattr(obj, name), f"{at}.{info.alias or name}"
        if isinstance(value, dict):
            items = [(f"{field}[{key}]", child) for key, child in value.items()]
        elif isinstance(value, list | tuple):
            items = [(f"{field}[{i}]", child) for i, child in enumerate(value)]
        else:
            items = [(field, value)]
        for path, child in items:
            if isinstance(child, BaseModel):
                yield from model_sources(child, path)
