"""Reading what pods report on /metrics: the GET (the thin part), and the pure parser of a batch leader's
checkpoint (the router's metrics are parsed by ``contract.router_metrics``).

- Checkpoints: the leader of a batch gang exports
  ``tokenfleet_batch_checkpoint_timestamp_seconds{checkpoint="ID"}`` (the time of its latest commit) on its
  metrics port: the container port named ``metrics``, else the main container's first port.
- LoRA adapters: a serving replica's ``tokenfleet:lora_adapter_loaded``, per-adapter token counters and
  ``tokenfleet:lora_adapter_error_info`` (``adapters_from_metrics``), for ``status.adapters``.

The collector (``controller/collector.py``) calls these on its own timer, never a reconcile.
"""
from __future__ import annotations

import datetime as dt
import math
import urllib.request
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tokenfleet_serving.contract.lora_adapters import (
    ADAPTER_ERROR_METRIC,
    ADAPTER_GENERATION_TOKENS_METRIC,
    ADAPTER_LOADED_METRIC,
    ADAPTER_PROMPT_TOKENS_METRIC,
)

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


@dataclass(frozen=True)
class ReplicaAdapters:
    """What one serving replica reports about its LoRA adapters (``contract/lora_adapters.py``)."""

    loaded: tuple[tuple[str, bool], ...] = ()             # adapter -> in memory (servable either way)
    prompt_tokens: tuple[tuple[str, int], ...] = ()       # per adapter, since the replica started
    generation_tokens: tuple[tuple[str, int], ...] = ()
    all_generation_tokens: int = 0                        # every model's (vllm:generation_tokens_total)
    refused: tuple[tuple[str, str, str, str], ...] = ()   # (adapter, file, field, reason)


def adapters_from_metrics(text: str) -> ReplicaAdapters:
    """A serving replica's adapters from its /metrics text (empty when it reports none)."""
    def per_adapter(name: str) -> tuple[tuple[str, int], ...]:
        return tuple(sorted((s.labels["adapter"], int(s.value)) for s in samples(text, name)
                            if "adapter" in s.labels and math.isfinite(s.value)))

    loaded = tuple(sorted((s.labels["adapter"], s.value == 1.0) for s in samples(text, ADAPTER_LOADED_METRIC)
                          if "adapter" in s.labels))
    refused = tuple(sorted((s.labels["adapter"], s.labels.get("file", ""), s.labels.get("field", ""),
                            s.labels.get("reason", "")) for s in samples(text, ADAPTER_ERROR_METRIC)
                           if "adapter" in s.labels and s.value == 1.0))
    total = sum(s.value for s in samples(text, "vllm:generation_tokens_total") if math.isfinite(s.value))
    return ReplicaAdapters(loaded, per_adapter(ADAPTER_PROMPT_TOKENS_METRIC),
                           per_adapter(ADAPTER_GENERATION_TOKENS_METRIC), int(total), refused)
