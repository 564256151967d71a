"""status.adapters and the AdaptersReady condition, a pure function of spec.adapters and what the ready
replicas report (``controller/collector.py`` reads them, ``pod_metrics.adapters_from_metrics`` parses them).

Per adapter: the replicas that hold it in memory, how many serve it at all, its tokens summed over the ready
replicas, its share of their generated tokens, and that share of the service's dollars per hour (the cost
split by tokens, so a token costs the same whichever adapter it came from).

AdaptersReady:

- ``True`` (AdaptersServed): every ready replica that reported serves every listed adapter;
- ``False`` (AdapterRefused): a replica refused one: the message names the adapter, its spec field, the
  adapter file and the field or tensor at fault, and why; the reconcile also sends a Warning Event;
- ``False`` (AdaptersLoading): some replica does not serve some adapter yet (its file is followed within
  seconds of the ConfigMap reaching the pod);
- ``Unknown`` (AdaptersNotRead): no ready replica has been read yet.
"""
from __future__ import annotations

from typing import Any

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.pod_metrics import ReplicaAdapters

CONDITION = "AdaptersReady"
REFUSED = "AdapterRefused"


def adapters_status(spec: InferenceServiceSpec, replicas: dict[str, ReplicaAdapters], ready_pods: set[str],
                    dollars_per_hour: float) -> tuple[list[dict[str, Any]] | None, cond.Desired | None]:
    """(status.adapters, AdaptersReady) from the reports of the ready serving pods; (None, None) while
    spec.adapters is unset."""
    if spec.adapters is None:
        return None, None
    reports = {pod: r for pod, r in sorted(replicas.items()) if pod in ready_pods}
    total = sum(r.all_generation_tokens for r in reports.values())
    out: list[dict[str, Any]] = []
    refused: list[str] = []
    loading: list[str] = []
    for i, adapter in enumerate(spec.adapters):
        name = adapter.name
        held = [pod for pod, r in reports.items() if dict(r.loaded).get(name) is True]
        serving = [pod for pod, r in reports.items() if name in dict(r.loaded)]
        prompt = sum(dict(r.prompt_tokens).get(name, 0) for r in reports.values())
        generated = sum(dict(r.generation_tokens).get(name, 0) for r in reports.values())
        entry: dict[str, Any] = {"name": name, "replicas": held or None, "servingReplicas": len(serving),
                                 "promptTokens": prompt, "generationTokens": generated}
        if total > 0:
            share = min(1.0, generated / total)
            entry["tokenShare"] = round(share, 4)
            entry["dollarsPerHour"] = round(share * dollars_per_hour, 6)
        why = {(f, fld, reason): pod for pod, r in reports.items() for a, f, fld, reason in r.refused if a == name}
        if why:
            (file, field, reason), _ = sorted(why.items())[0]
            pods = sorted(set(why.values()))
            entry["refused"] = f"{file or '-'}: {field}: {reason}"
            refused.append(f"adapter {name!r} (spec.adapters[{i}]) refused by {', '.join(pods)}: {file or '-'}: "
                           f"{field}: {reason}")
        elif len(serving) < len(reports):
            loading.append(f"{name} ({len(serving)}/{len(reports)} replicas)")
        out.append(entry)
    if refused:
        return out, cond.Desired(CONDITION, "False", REFUSED, "; ".join(refused))
    if not reports:
        return out, cond.Desired(CONDITION, "Unknown", "AdaptersNotRead", "no ready replica has reported its adapters "
                                 "yet")
    if loading:
        return out, cond.Desired(CONDITION, "False", "AdaptersLoading", "not yet served everywhere: " + ", ".join(loading))
    return out, cond.Desired(CONDITION, "True", "AdaptersServed",
                             f"{len(spec.adapters)} adapters served by every ready replica ({len(reports)})")
