"""The checkpoint a batch gang's leader reports: read from its metrics, for status.checkpoint.

The leader member exports ``tokenfleet_batch_checkpoint_timestamp_seconds{checkpoint="ID"}`` (the
time of its latest commit) on its metrics port: the container port named ``metrics``, else the main
container's first port. Parsing is pure; the GET (``pod_metrics.fetch``) treats an unreachable leader
as "nothing reported".
"""
from __future__ import annotations

import datetime as dt
import math
from typing import Any

from tokenfleet_operator.pod_metrics import fetch, samples

CHECKPOINT_METRIC = "tokenfleet_batch_checkpoint_timestamp_seconds"


def checkpoint_from_metrics(text: str) -> dict[str, str] | None:
    """{latest, savedAt} from the leader's /metrics text, or None when it reports no commit yet."""
    for sample in samples(text, CHECKPOINT_METRIC):
        if sample.labels.get("checkpoint") and math.isfinite(sample.value):
            saved = dt.datetime.fromtimestamp(sample.value, dt.timezone.utc)
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


def read_checkpoint(pod: dict[str, Any], timeout: float = 0.5) -> dict[str, str] | None:
    url = metrics_url(pod)
    text = fetch(url, timeout) if url is not None else None
    return checkpoint_from_metrics(text) if text is not None else None
