"""What Prometheus scrapes: the operator, the routers, the serving pods and the TokenRoutes' routers.

One table, ``TARGETS``, renders both ways: as prometheus-operator PodMonitors and as a plain ``scrape_configs``
list with Kubernetes pod discovery, with the same selection and the same target labels, so a dashboard or
alert reads the same series whichever way Prometheus was set up. Pods, not Services, are discovered: a
Service's endpoints add nothing (every replica's pod is scraped), and the local plane has none.

Target labels (besides what the metrics carry): ``job`` (the target's name below), ``namespace``, ``pod``,
``container``, and for routers and serving pods ``service`` (the InferenceService, from the pod label
tokenfleet.dev/inference-service) and ``slice``. The operator's series keep their own ``namespace`` and ``service``
labels (honor_labels): they describe the InferenceService, not the operator's pod.

A TokenRoute's router pods (role ``route``) are a job of their own, ``tokenfleet-route``, with the label ``route``
(the TokenRoute, from the pod label tokenfleet.dev/token-route). Only their route-mode series
(``tokenfleet_router_route_*``) are kept: a request through a route is counted again by the target's router, so
the route's request, SLO and latency series would count it twice in the fleet's sums.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPERATOR_NAMESPACE = "tokenfleet-system"
SERVICE_LABEL = "tokenfleet.dev/inference-service"
SLICE_LABEL = "tokenfleet.dev/slice"
ROLE_LABEL = "tokenfleet.dev/role"
ROUTE_LABEL = "tokenfleet.dev/token-route"


@dataclass(frozen=True)
class Target:
    job: str
    description: str
    match_labels: tuple[tuple[str, str], ...]
    port: str                        # the container port's name
    namespace: str | None = None     # None: every namespace
    honor_labels: bool = False
    interval: str = "15s"
    pod_labels: tuple[tuple[str, str], ...] = ((SERVICE_LABEL, "service"), (SLICE_LABEL, "slice"))
    keep_metrics: str | None = None  # a regex of the metric names kept (None: all)


TARGETS: tuple[Target, ...] = (
    Target("tokenfleet-operator", "the operator's replicas: reconciles, work queue, leader, gang scheduler, per-service cost",
           (("app.kubernetes.io/name", "tokenfleet"), ("app.kubernetes.io/component", "operator")), "metrics",
           namespace=OPERATOR_NAMESPACE, honor_labels=True, interval="30s"),
    Target("tokenfleet-router", "every InferenceService's router: routing decisions, backends, SLO and goodput",
           ((ROLE_LABEL, "router"),), "http"),
    Target("tokenfleet-serving", "every serving replica (tokenfleet serve): vLLM's metrics, throughput, cost per token",
           ((ROLE_LABEL, "serve"),), "http"),
    Target("tokenfleet-route", "every TokenRoute's router: route decisions, classifier grades and fallbacks, "
           "what it was told of its targets",
           ((ROLE_LABEL, "route"),), "http", pod_labels=((ROUTE_LABEL, "route"),),
           keep_metrics="tokenfleet_router_route_.*"),
)


def _meta_label(label: str) -> str:
    """A pod label as Kubernetes service discovery names it: __meta_kubernetes_pod_label_<sanitized>."""
    return "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in label)


def _pod_label_targets(t: Target) -> list[tuple[str, str]]:
    """(pod label, target label) copied onto the series; the operator's own series name their service themselves."""
    return [] if t.honor_labels else list(t.pod_labels)


def pod_monitor(t: Target) -> dict[str, Any]:
    relabelings: list[dict[str, Any]] = [
        {"action": "replace", "targetLabel": "job", "replacement": t.job},
        *({"action": "replace", "sourceLabels": [_meta_label(src)], "targetLabel": dst}
          for src, dst in _pod_label_targets(t)),
    ]
    endpoint: dict[str, Any] = {"port": t.port, "path": "/metrics", "interval": t.interval,
                                "honorLabels": t.honor_labels, "relabelings": relabelings}
    if t.keep_metrics:
        endpoint["metricRelabelings"] = [{"action": "keep", "sourceLabels": ["__name__"], "regex": t.keep_metrics}]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": t.job, "namespace": OPERATOR_NAMESPACE,
                     "labels": {"app.kubernetes.io/name": "tokenfleet", "app.kubernetes.io/component": "monitoring"}},
        "spec": {
            "selector": {"matchLabels": dict(t.match_labels)},
            "namespaceSelector": {"matchNames": [t.namespace]} if t.namespace else {"any": True},
            "podMetricsEndpoints": [endpoint],
        },
    }


def scrape_config(t: Target) -> dict[str, Any]:
    """The plain equivalent of ``pod_monitor(t)``: what prometheus-operator generates for it, written out."""
    sd: dict[str, Any] = {"role": "pod"}
    if t.namespace:
        sd["namespaces"] = {"names": [t.namespace]}
    keep = [{"action": "keep", "source_labels": [_meta_label(k)], "regex": v} for k, v in t.match_labels]
    metric_keep = ({"metric_relabel_configs": [{"action": "keep", "source_labels": ["__name__"], "regex": t.keep_metrics}]}
                   if t.keep_metrics else {})
    return {
        "job_name": t.job,
        "scrape_interval": t.interval,
        "metrics_path": "/metrics",
        "honor_labels": t.honor_labels,
        "kubernetes_sd_configs": [sd],
        "relabel_configs": [
            *keep,
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": t.port},
            # pods that are gone or not running yet have nothing to scrape
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
            {"action": "replace", "source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"action": "replace", "source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"action": "replace", "source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            *({"action": "replace", "source_labels": [_meta_label(src)], "target_label": dst}
              for src, dst in _pod_label_targets(t)),
        ],
        **metric_keep,
    }


def pod_monitors() -> list[dict[str, Any]]:
    return [pod_monitor(t) for t in TARGETS]


def scrape_configs() -> list[dict[str, Any]]:
    return [scrape_config(t) for t in TARGETS]
