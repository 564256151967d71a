"""`kubectl apply -k manifests/monitoring` on the real plane. The prometheus-operator's CRDs are not available
offline, so PodMonitor and PrometheusRule get stand-in CRDs with an open schema (their content is checked by
promtool and the scrape-config equivalence test); the dashboard ConfigMaps and the kustomization itself are real."""
from __future__ import annotations

import json

import yaml

from harness.operator_cluster import REPO, get_json, install


def stand_in_crd(kind: str, plural: str) -> dict:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.monitoring.coreos.com"},
            "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


def test_the_monitoring_kustomization_applies_and_its_dashboards_are_labelled_for_grafana(cluster):
    install(cluster)
    for kind, plural in (("PodMonitor", "podmonitors"), ("PrometheusRule", "prometheusrules")):
        cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(stand_in_crd(kind, plural)))
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{plural}.monitoring.coreos.com", "--timeout=60s")
    out = cluster.kubectl("apply", "-k", str(REPO / "manifests" / "monitoring"))
    assert out.returncode == 0, out.stderr
    again = cluster.kubectl("apply", "-k", str(REPO / "manifests" / "monitoring"))
    assert all(line.endswith("unchanged") for line in again.stdout.strip().splitlines()), again.stdout
    maps = get_json(cluster, "configmaps", "-n", "tokenfleet-system", "-l", "grafana_dashboard=1")["items"]
    assert sorted(m["metadata"]["name"] for m in maps) == [f"tokenfleet-dashboard-{n}" for n in ("fleet", "gang", "service")]
    for m in maps:
        [(name, text)] = m["data"].items()
        assert json.loads(text)["uid"] == "tokenfleet-" + name.removesuffix(".json")
    monitors = get_json(cluster, "podmonitors", "-n", "tokenfleet-system")["items"]
    assert sorted(m["metadata"]["name"] for m in monitors) == ["tokenfleet-operator", "tokenfleet-route", "tokenfleet-router",
                                                              "tokenfleet-serving"]
    rule = get_json(cluster, "prometheusrule", "tokenfleet", "-n", "tokenfleet-system")
    assert rule["spec"] == yaml.safe_load((REPO / "manifests" / "monitoring" / "prometheus" / "rules.yaml").read_text())
