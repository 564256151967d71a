"""Reading what pods report on /metrics: the GET (the thin part), and the pure parser of a batch leader's
checkpoint (the router's metrics are parsed by ``contract.router_metrics``).

- Checkpoints: the leader of a batch gang exports
  ``tokenfleet_batch_checkpoint_timestamp_seconds{checkpoint="ID"}`` (the time of its latest commit) on its
  metrics port: the container port named ``metrics``, else the main container's first port.

The collector (``controller/collector.py``) calls these on its own timer, never a reconcile.
"""
from __future__ import annotations

import datetime as dt
import math
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

USER_AGENT = "tokenfleet-operator"
CHECKPOINT_METRIC = "tokenfleet_batch_checkpoint_timestamp_seconds"


def fetch(url: str, timeout: float = 0.5) -> str | None:
    """The text at ``url``, or None when the pod cannot be read."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": USER_AGENT}),
                                    timeout=timeout) as r:
            return r.read().decode(errors="replace")
    except (OSError, ValueError):
        return None


def samples(text: str, name: str) -> list[Sample]:
    """The samples called ``name`` in a metrics text; none when the text is not Prometheus'."""
    try:
        return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]
    except ValueError:
        return []


def checkpoint_from_metrics(text: str) -> dict[str, str] | None:
    """{latest, savedAt} from the leader's /metrics text, or None when it reports no commit yet."""
    for sample in samples(text, CHECKPOINT_METRIC):
        if sample.labels.get("checkpoint") and math.isfinite(sample.value):
            saved = dt.datetime.fromtimestamp(sample.value, dt.UTC)
            return {"latest": sample.labels["checkpoint"], "savedAt": saved.strftime("%Y-%m-%dT%H:%M:%SZ")}
    return None


def metrics_url(pod: dict[str, Any]) -> str | None:
    """Where a running pod serves its metrics, from its IP and its main container's ports."""
    ip = (pod.get("status") or {}).get("podIP")
    containers = (pod.get("spec") or {}).get("containers") or []
    if not ip or (pod.get("status") or {}).get("phase") != "Running" or not containers:
        return None
    ports = containers[0].get("ports") or []
    port = next((p for p in ports if p.get("name") == "metrics"), ports[0] if ports else None)
    return f"http://{ip}:{port['containerPort']}/metrics" if port else None
