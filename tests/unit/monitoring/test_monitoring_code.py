"""Monitoring as code: the files under manifests/monitoring/ are what the code renders; the rules pass promtool
(check and unit tests: every alert fires on a bad series and stays quiet on a good one); the scrape configuration
and the PodMonitors select the same pods with the same labels; the dashboards are well formed."""
from __future__ import annotations

import json
import re

import yaml

from tokenfleet_dev.monitoring import alerts, dashboards, render
from tokenfleet_operator.builders.token_route import route_labels

from harness.monitoring import file_sd_config, pod_targets, run_promtool

SHIPPED = render.OUT
REPO = render.REPO


def test_manifests_monitoring_is_what_the_code_renders():
    assert render.drift() == [], "run `tokenfleet monitoring`"
    assert render.main(["--check"]) == 0


def test_drift_is_noticed(tmp_path):
    out = tmp_path / "monitoring"
    assert render.main(["--out", str(out)]) == 0 and render.drift(out) == []
    (out / "dashboards" / "fleet.json").write_text("{}\n")
    (out / "hand-made.yaml").write_text("x: 1\n")
    assert render.drift(out) == ["dashboards/fleet.json", "hand-made.yaml (not generated)"]
    assert render.main(["--check", "--out", str(out)]) == 1


def test_every_case_of_the_issue_has_an_alert_with_a_runbook():
    names = {a.name for a in alerts.ALERTS}
    for wanted in ("GoodputBudgetBurnFast", "GoodputBudgetBurnSlow", "ReplicasNotReady", "SliceRestartBudgetNearlySpent",
                   "GangStuckInQueue", "KVCacheSaturated", "RouterNoRoutableBackend", "CostAboveBudget",
                   "OperatorDown", "OperatorNoLeader", "OperatorNotReconciling"):
        assert f"Tokenfleet{wanted}" in names
    for a in alerts.ALERTS:
        rule = a.rule()
        assert len(rule["annotations"]["runbook"]) > 100 and rule["annotations"]["summary"]
        assert rule["labels"]["severity"] in ("critical", "warning") and a.signals
    assert yaml.safe_load((SHIPPED / "prometheusrule.yaml").read_text())["spec"] == \
        yaml.safe_load((SHIPPED / "prometheus" / "rules.yaml").read_text())


def test_promtool_checks_the_rules_and_every_alert_fires_only_on_its_bad_series(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text((SHIPPED / "prometheus" / "rules.yaml").read_text())
    check = run_promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert check.returncode == 0 and f"SUCCESS: {len(alerts.ALERTS)} rules found" in check.stdout, check.stdout + check.stderr
    tests = alerts.promtool_tests("rules.yaml")
    assert len(tests["tests"]) == 2 * len(alerts.ALERTS)
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False, width=200))
    run = run_promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr
    # ... and the unit tests can fail: a firing example evaluated before its alert's `for` is up fires nothing
    early = yaml.safe_load((tmp_path / "tests.yaml").read_text())
    early["tests"][0]["alert_rule_test"][0]["eval_time"] = "1m"
    (tmp_path / "early.yaml").write_text(yaml.safe_dump(early, sort_keys=False, width=200))
    failed = run_promtool("test", "rules", "early.yaml", cwd=tmp_path)
    assert failed.returncode != 0 and "FAILED" in failed.stdout + failed.stderr


def test_promtool_checks_the_prometheus_config(tmp_path):
    """Debian's promtool has no Kubernetes discovery: the config is checked with it swapped for file discovery;
    the scrape jobs and their relabelling are the shipped ones."""
    shipped = yaml.safe_load((SHIPPED / "prometheus" / "prometheus.yml").read_text())
    assert all(job["kubernetes_sd_configs"] == [sd] for job, sd in
               zip(shipped["scrape_configs"], [{"role": "pod", "namespaces": {"names": ["tokenfleet-system"]}},
                                               {"role": "pod"}, {"role": "pod"}, {"role": "pod"}]))
    config = file_sd_config(shipped, tmp_path)
    (tmp_path / "rules.yaml").write_text((SHIPPED / "prometheus" / "rules.yaml").read_text())
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    check = run_promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr


def test_pod_monitors_and_the_scrape_config_select_the_same_pods_with_the_same_labels():
    monitors = {m["metadata"]["name"]: m for m in yaml.safe_load_all((SHIPPED / "podmonitors.yaml").read_text())}
    jobs = {j["job_name"]: j for j in yaml.safe_load((SHIPPED / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]}
    assert set(monitors) == set(jobs) == {"tokenfleet-operator", "tokenfleet-router", "tokenfleet-serving", "tokenfleet-route"}
    # a TokenRoute's router pods (role route) are selected, with the route's name, and keep only route-mode series
    route = monitors["tokenfleet-route"]["spec"]
    assert route["selector"]["matchLabels"] == {"tokenfleet.dev/role": "route"}
    assert route_labels("chat")["tokenfleet.dev/role"] == "route" and route_labels("chat")["tokenfleet.dev/token-route"] == "chat"
    assert route["podMetricsEndpoints"][0]["metricRelabelings"] == [
        {"action": "keep", "sourceLabels": ["__name__"], "regex": "tokenfleet_router_route_.*"}]
    assert jobs["tokenfleet-route"]["metric_relabel_configs"] == [
        {"action": "keep", "source_labels": ["__name__"], "regex": "tokenfleet_router_route_.*"}]
    for name, monitor in monitors.items():
        job, spec = jobs[name], monitor["spec"]
        endpoint = spec["podMetricsEndpoints"][0]
        keeps = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"] if r["action"] == "keep"}
        selected = {k: v for k, v in keeps.items() if k.startswith("__meta_kubernetes_pod_label_")}
        assert selected == {"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9]", "_", k): v
                            for k, v in spec["selector"]["matchLabels"].items()}
        assert keeps["__meta_kubernetes_pod_container_port_name"] == endpoint["port"]
        assert job["honor_labels"] == endpoint["honorLabels"] and job["scrape_interval"] == endpoint["interval"]
        names = (spec["namespaceSelector"].get("matchNames"))
        assert (job["kubernetes_sd_configs"][0].get("namespaces") or {}).get("names") == names
        copied = {r["target_label"]: r["source_labels"][0] for r in job["relabel_configs"]
                  if r["action"] == "replace" and r["target_label"] in ("service", "slice", "route")}
        assert copied == {r["targetLabel"]: r["sourceLabels"][0] for r in endpoint["relabelings"] if "sourceLabels" in r}
        assert {"targetLabel": "job", "replacement": name, "action": "replace"} in endpoint["relabelings"]
        assert job.get("metric_relabel_configs", []) == [
            {"action": r["action"], "source_labels": r["sourceLabels"], "regex": r["regex"]}
            for r in endpoint.get("metricRelabelings", [])]


def test_pod_discovery_for_the_test_prometheus_gives_kubernetes_labels():
    pod = {"metadata": {"name": "llama-0-0", "namespace": "prod", "uid": "u",
                        "labels": {"tokenfleet.dev/role": "serve", "tokenfleet.dev/inference-service": "llama"}},
           "spec": {"nodeName": "n1", "containers": [{"name": "serve", "ports": [{"name": "http", "containerPort": 8000}]}]},
           "status": {"podIP": "127.2.0.5", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    unplaced = {"metadata": {"name": "x", "namespace": "prod"}, "spec": {"containers": [{"name": "c"}]}, "status": {}}
    [group] = pod_targets({"role": "pod"}, [pod, unplaced])
    assert group["targets"] == ["127.2.0.5:8000"]
    assert group["labels"]["__meta_kubernetes_pod_label_tokenfleet_dev_inference_service"] == "llama"
    assert group["labels"]["__meta_kubernetes_pod_container_port_name"] == "http"
    assert pod_targets({"role": "pod", "namespaces": {"names": ["tokenfleet-system"]}}, [pod]) == []


def test_three_dashboards_whose_queries_use_only_their_own_variables():
    assert set(dashboards.DASHBOARDS) == {"fleet", "service", "gang"}
    for name in dashboards.DASHBOARDS:
        model = json.loads((SHIPPED / "dashboards" / f"{name}.json").read_text())
        variables = {v["name"] for v in model["templating"]["list"]}
        queries = dashboards.panel_queries(model)
        panels = [p for p in model["panels"] if p["type"] != "row"]
        assert len(queries) >= len(panels) >= 8 and all(p.get("targets") for p in panels)
        assert all(p["description"] for p in panels) and model["uid"].startswith("tokenfleet-")
        for _, expr in queries + dashboards.variable_queries(model):
            used = set(re.findall(r"\$(\w+)", expr)) - {"__rate_interval"}
            assert used <= variables, (name, expr)
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")


def _base(name: str) -> str:
    return re.sub(r"_(total|bucket|sum|count|created)$", "", name)


def test_every_metric_a_query_reads_is_exported_by_the_operator_the_server_or_the_router():
    """A typo in a metric name fails here, not first on a live Prometheus. The router's SLO and goodput series are
    named by the operator/router contract (contract/router_metrics.py) and count as exported by the router."""
    from prometheus_client import REGISTRY

    import tokenfleet_operator.metrics  # noqa: F401  (registers the operator's metrics)
    from tokenfleet_serving.contract import router_metrics

    known = {_base(f.name) for f in REGISTRY.collect()} | {"up"}
    serving = REPO / "serving-image" / "tokenfleet_serving"
    for source in (serving / "server" / "metrics.py", serving / "router" / "metrics.py", serving / "router" / "route_mode.py"):
        known |= {_base(n) for n in re.findall(r'"((?:vllm|tokenfleet):[a-z_]+|tokenfleet_[a-z_]+)"', source.read_text())}
    known |= {_base(v) for k, v in vars(router_metrics).items() if k.isupper() and isinstance(v, str) and v.startswith("tokenfleet_")}
    exprs = [e for d in dashboards.DASHBOARDS for _, e in dashboards.panel_queries(dashboards.build(dashboards.DASHBOARDS[d]))]
    exprs += [s for a in alerts.ALERTS for s in (a.expr, *a.signals)]
    exprs += [q for d in dashboards.DASHBOARDS.values() for _, q in dashboards.variable_queries(dashboards.build(d))]
    used = {_base(n) for e in exprs for n in re.findall(r"\b((?:vllm|tokenfleet):[a-z_]+|tokenfleet_[a-z_]+|up)\b(?=\s*[{\[)])", e)}
    assert used - known == set()
    assert len(used) > 40
