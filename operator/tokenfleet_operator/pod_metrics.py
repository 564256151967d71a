"""Reading the Prometheus text a pod serves on /metrics: the GET (the thin part) and the samples of one
metric in it. Used for replicas' throughput (cost per token) and batch leaders' checkpoints."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# The operator's reads say who they are: a batch leader waits for one before it exits (docs/batch.md).
USER_AGENT = "tokenfleet-operator"


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
