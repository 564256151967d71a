"""How long a replica of a service takes to start: from its Slice's creation to its leader pod's Ready condition.

The autoscaler looks that far ahead along a rising load (``policy``): a replica asked for now serves from then on.
Measured on the replicas that run, not configured: it covers the gang's placement, the pull, the model's load and
the engine's warm-up, whatever they cost on this cluster.
"""
from __future__ import annotations

from typing import Any

from tokenfleet_operator.conditions import parse_rfc3339


def _ready_since(pod: dict[str, Any]) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") == "True":
            return c.get("lastTransitionTime")
    return None


def replica_startup_seconds(replicas: list[tuple[dict[str, Any], dict[str, Any] | None]]) -> float | None:
    """The startup of the newest ready replica among ``(slice, leader pod)`` pairs; None if none is ready yet."""
    newest: tuple[str, float] | None = None
    for slice_obj, pod in replicas:
        created = slice_obj.get("metadata", {}).get("creationTimestamp")
        ready = _ready_since(pod) if pod else None
        if not created or not ready:
            continue
        try:
            seconds = (parse_rfc3339(ready) - parse_rfc3339(created)).total_seconds()
        except ValueError:
            continue
        if seconds >= 0 and (newest is None or created > newest[0]):
            newest = (created, seconds)
    return newest[1] if newest else None
