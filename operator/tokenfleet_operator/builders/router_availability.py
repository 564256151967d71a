"""What keeps a service's router up while its pods come and go: the parts of the router Deployment that decide
how its pods are spread, replaced and stopped, and the router's PodDisruptionBudget.

- **Spreading**: a ``topologySpreadConstraints`` entry over ``kubernetes.io/hostname`` (skew 1), so that one
  node going away takes at most its share of the router pods. ``ScheduleAnyway``: on a cluster of one node the
  pods still run, together.
- **Rolling update**: ``maxUnavailable 0``, ``maxSurge 1``: a new router pod is Ready before an old one is told
  to stop, so the Service never has fewer ready routers than ``routing.replicas``.
- **Stopping**: SIGTERM turns the router's ``/ready`` to 503 and it keeps serving until its open streams are done
  (``--drain-timeout``, ``routing.drainSeconds``); the grace period gives it that long plus
  ``GRACE_MARGIN_SECONDS`` before the SIGKILL.
- **PodDisruptionBudget** ``<service>-router``: ``maxUnavailable 1``, so a node drain evicts one router pod at a
  time and waits for its replacement; with one router pod, the drain may still take it (``minAvailable 1`` would
  block every drain of its node).
"""
from __future__ import annotations

from typing import Any

from tokenfleet_operator.naming import child_metadata, router_name

HOSTNAME_TOPOLOGY_KEY = "kubernetes.io/hostname"
# Seconds between the end of the router's drain and the kubelet's SIGKILL: the runner's shutdown after the drain.
GRACE_MARGIN_SECONDS = 5


def router_spreading(selector: dict[str, str]) -> list[dict[str, Any]]:
    """The router pods' topologySpreadConstraints: at most one more on any node than on another, if it can be."""
    return [{"maxSkew": 1, "topologyKey": HOSTNAME_TOPOLOGY_KEY, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": dict(selector)}}]


def router_strategy() -> dict[str, Any]:
    """The router Deployment's strategy: surge one, never below the ready count (module docstring)."""
    return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def router_grace_seconds(drain_seconds: int) -> int:
    """terminationGracePeriodSeconds of a router pod whose drain may take ``drain_seconds``."""
    return drain_seconds + GRACE_MARGIN_SECONDS


def router_disruption_budget(owner: dict[str, Any], labels: dict[str, str], selector: dict[str, str]) -> dict[str, Any]:
    """The PodDisruptionBudget over the router pods (``selector``), owned by the service."""
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(owner, router_name(name), labels),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(selector)}},
    }
