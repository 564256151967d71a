"""The three Grafana dashboards, built with Grafana's grafana-foundation-sdk.

- **Fleet**: cost per million tokens, tokens/s, goodput, replicas and accelerators, by InferenceService; the
  TokenRoutes' decisions and classifier fallbacks;
- **Service**: one InferenceService: TTFT/TPOT/ITL/end-to-end percentiles, queue, KV usage, prefix-cache hit
  rate, routing decisions, per-replica load, cold starts;
- **Gang scheduling and recovery**: queue depth, why Slices wait, time to place, preemptions, restarts and restart
  budgets, checkpoint age, placement passes, and the operator's own health.

A dashboard is described here as rows of ``Panel`` values (a title, what it shows, its unit and its PromQL), and
``build`` turns that into the SDK's builders; the JSON under manifests/monitoring/dashboards/ is their output.
Queries use the template variables ``$datasource``, ``$namespace``, ``$service``, ``$queue`` and Grafana's
``$__rate_interval``; metric and label names are those in docs/serving.md, docs/routing.md and docs/api.md.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gs
from grafana_foundation_sdk.builders import timeseries as gt
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
SEL_NS = 'namespace=~"$namespace"'
SEL_SVC = 'namespace="$namespace", service="$service"'
SERVING = 'job="tokenfleet-serving"'
ROUTER = 'job="tokenfleet-router"'
ROUTE = 'job="tokenfleet-route"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"          # timeseries | stat
    width: int = 12
    height: int = 8
    stack: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    name: str
    label: str
    query: str                 # label_values(...)
    multi: bool = False


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = field(default=("tokenfleet",))


def q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


def quantiles(metric: str, selector: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> tuple[Query, ...]:
    """p50/p90/p99 of a histogram over the rate interval (by extra labels, if any)."""
    extra = f", {by}" if by else ""
    prefix = "{{" + by + "}} " if by else ""
    return tuple(q(f"histogram_quantile({x}, sum by (le{extra}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
                   f"{prefix}p{round(x * 100)}") for x in qs)


# ---------------------------------------------------------------------------------------------- Fleet
NAMESPACE = Variable("namespace", "Namespace", "label_values(tokenfleet_inferenceservice_replicas, namespace)", multi=True)
SERVICE_NAMESPACE = Variable("namespace", "Namespace", "label_values(tokenfleet_inferenceservice_replicas, namespace)")
SERVICE = Variable("service", "InferenceService",
                   'label_values(tokenfleet_inferenceservice_replicas{namespace="$namespace"}, service)')
QUEUE = Variable("queue", "SliceQueue", "label_values(tokenfleet_slices_pending, queue)", multi=True)
GANG_NAMESPACE = Variable("namespace", "Namespace", "label_values(tokenfleet_slice_members_ready, namespace)", multi=True)

GOODPUT_RATIO_BY_SERVICE = (
    f'sum by (namespace, service) (rate(tokenfleet_router_slo_requests_total{{{SEL_NS}, result="met"}}[{RATE}]))'
    f" / sum by (namespace, service) (rate(tokenfleet_router_slo_requests_total{{{SEL_NS}}}[{RATE}]))"
)

FLEET = Dashboard(
    "tokenfleet-fleet", "tokenfleet / Fleet",
    "Every InferenceService at a glance: what a token costs, how many are served, how many meet the SLO, and the "
    "replicas and accelerators paid for.",
    (NAMESPACE,),
    (
        Row("Cost and throughput", (
            Panel("Fleet cost per million tokens",
                  "The fleet's dollars per hour (status.cost.dollarsPerHour summed) over the output tokens per hour its "
                  "replicas generate, per million tokens.",
                  (q(f"sum(tokenfleet_inferenceservice_cost_dollars_per_hour{{{SEL_NS}}}) / "
                     f"(sum(rate(vllm:generation_tokens_total{{{SERVING}, {SEL_NS}}}[{RATE}])) * 3600) * 1e6", "$/Mtok"),),
                  unit="currencyUSD", kind="stat", width=6, height=6),
            Panel("Fleet output tokens/s", "Generated tokens per second over every serving replica.",
                  (q(f"sum(rate(vllm:generation_tokens_total{{{SERVING}, {SEL_NS}}}[{RATE}]))", "tokens/s"),),
                  unit="short", kind="stat", width=6, height=6),
            Panel("Fleet goodput", "Share of requests through the routers that met their service's spec.slo.",
                  (q(f'sum(rate(tokenfleet_router_slo_requests_total{{{SEL_NS}, result="met"}}[{RATE}])) / '
                     f"sum(rate(tokenfleet_router_slo_requests_total{{{SEL_NS}}}[{RATE}]))", "goodput"),),
                  unit="percentunit", kind="stat", width=6, height=6),
            Panel("Fleet dollars per hour", "What the replicas cost per hour at their specs' prices.",
                  (q(f"sum(tokenfleet_inferenceservice_cost_dollars_per_hour{{{SEL_NS}}})", "$/h"),),
                  unit="currencyUSD", kind="stat", width=6, height=6),
            Panel("Cost per million tokens by service",
                  "status.cost.costPerMillionTokens: dollars per hour over the tokens generated in the last minute "
                  "(absent while a service is idle).",
                  (q(f"tokenfleet_inferenceservice_cost_per_million_tokens{{{SEL_NS}}}", "{{namespace}}/{{service}}"),),
                  unit="currencyUSD"),
            Panel("Output tokens/s by service", "Generated tokens per second, summed over each service's replicas.",
                  (q(f"sum by (namespace, service) (rate(vllm:generation_tokens_total{{{SERVING}, {SEL_NS}}}[{RATE}]))",
                     "{{namespace}}/{{service}}"),), unit="short"),
        )),
        Row("Goodput", (
            Panel("Goodput by service", "Share of each service's requests that met spec.slo (TTFT and TPOT within "
                  "target), as the router measured them, against the objective (spec.slo.percentile).",
                  (q(GOODPUT_RATIO_BY_SERVICE, "{{namespace}}/{{service}}"),
                   q(f"tokenfleet_inferenceservice_slo_objective_ratio{{{SEL_NS}}}", "{{namespace}}/{{service}} objective")),
                  unit="percentunit"),
            Panel("Good requests/s by service", "Requests per second that met the SLO, and those that missed it.",
                  (q(f"sum by (namespace, service, result) (rate(tokenfleet_router_slo_requests_total{{{SEL_NS}}}[{RATE}]))",
                     "{{namespace}}/{{service}} {{result}}"),), unit="reqps", stack=True),
        )),
        Row("Capacity", (
            Panel("Replicas by service", "spec.replicas and the replicas that are ready.",
                  (q(f"tokenfleet_inferenceservice_replicas{{{SEL_NS}}}", "{{namespace}}/{{service}} desired"),
                   q(f"tokenfleet_inferenceservice_ready_replicas{{{SEL_NS}}}", "{{namespace}}/{{service}} ready")),
                  unit="short"),
            Panel("Accelerators by service", "Accelerators held by each service's replicas.",
                  (q(f"tokenfleet_inferenceservice_accelerators{{{SEL_NS}}}", "{{namespace}}/{{service}}"),),
                  unit="short", stack=True),
            Panel("Dollars per hour by service", "status.cost.dollarsPerHour.",
                  (q(f"tokenfleet_inferenceservice_cost_dollars_per_hour{{{SEL_NS}}}", "{{namespace}}/{{service}}"),),
                  unit="currencyUSD", stack=True),
            Panel("Responses/s by service and code", "What the routers answered clients.",
                  (q(f"sum by (namespace, service, code) (rate(tokenfleet_router_responses_total{{{SEL_NS}}}[{RATE}]))",
                     "{{namespace}}/{{service}} {{code}}"),), unit="reqps"),
        )),
        Row("Model routing (TokenRoute)", (
            Panel("Route decisions/s by target and reason",
                  "Requests each TokenRoute sent to each target, by the decision's reason (easy, hard, "
                  "classifier-hard, cheapest, spill-saturated, spill-slo, ...; docs/routing.md, \"The rules\").",
                  (q(f"sum by (namespace, route, target, reason) "
                     f"(rate(tokenfleet_router_route_decisions_total{{{ROUTE}, {SEL_NS}}}[{RATE}]))",
                     "{{namespace}}/{{route}} -> {{target}} {{reason}}"),), unit="reqps", stack=True),
            Panel("Classifier fallbacks/s by reason",
                  "Requests the rule-based score decided because the route's classifier gave no grade: timeout, "
                  "error, unavailable (no ready classifier pod) or no-grade (an answer that is neither easy nor hard).",
                  (q(f"sum by (namespace, route, reason) "
                     f"(rate(tokenfleet_router_route_classifier_fallbacks_total{{{ROUTE}, {SEL_NS}}}[{RATE}]))",
                     "{{namespace}}/{{route}} {{reason}}"),), unit="reqps", stack=True),
        )),
    ),
)

# -------------------------------------------------------------------------------------------- Service
SERVICE_DASHBOARD = Dashboard(
    "tokenfleet-service", "tokenfleet / Service",
    "One InferenceService: latency percentiles at the router and at the engine, queue, KV cache, prefix cache, "
    "routing decisions and each replica's load.",
    (SERVICE_NAMESPACE, SERVICE),
    (
        Row("Latency at the router (what clients see)", (
            Panel("Time to first token", "From the request's arrival at the router to its first output token.",
                  quantiles("tokenfleet_router_time_to_first_token_seconds", SEL_SVC), unit="s", width=8),
            Panel("Time per output token", "(end-to-end - TTFT) / (output tokens - 1), per request.",
                  quantiles("tokenfleet_router_time_per_output_token_seconds", SEL_SVC), unit="s", width=8),
            Panel("End-to-end latency", "From arrival to the last byte.",
                  quantiles("tokenfleet_router_e2e_request_latency_seconds", SEL_SVC), unit="s", width=8),
            Panel("SLO: requests met and missed", "Requests per second that met spec.slo and that missed it.",
                  (q(f"sum by (result) (rate(tokenfleet_router_slo_requests_total{{{SEL_SVC}}}[{RATE}]))", "{{result}}"),),
                  unit="reqps", stack=True, width=8),
            Panel("Goodput", "Share of requests that met spec.slo, against the objective.",
                  (q(f'sum(rate(tokenfleet_router_slo_requests_total{{{SEL_SVC}, result="met"}}[{RATE}])) / '
                     f"sum(rate(tokenfleet_router_slo_requests_total{{{SEL_SVC}}}[{RATE}]))", "goodput"),
                   q(f"tokenfleet_inferenceservice_slo_objective_ratio{{{SEL_SVC}}}", "objective")),
                  unit="percentunit", width=8),
            Panel("Cold starts", "Time to first token of requests that arrived while no replica was ready.",
                  quantiles("tokenfleet_router_cold_start_seconds", SEL_SVC, qs=(0.5, 0.99)), unit="s", width=8),
        )),
        Row("Latency at the engine (per replica)", (
            Panel("Engine TTFT", "vllm:time_to_first_token_seconds: arrival at the server to the first token.",
                  quantiles("vllm:time_to_first_token_seconds", f"{SERVING}, {SEL_SVC}"), unit="s", width=8),
            Panel("Engine TPOT", "vllm:request_time_per_output_token_seconds.",
                  quantiles("vllm:request_time_per_output_token_seconds", f"{SERVING}, {SEL_SVC}"), unit="s", width=8),
            Panel("Inter-token latency", "vllm:inter_token_latency_seconds: every gap between successive outputs.",
                  quantiles("vllm:inter_token_latency_seconds", f"{SERVING}, {SEL_SVC}"), unit="s", width=8),
        )),
        Row("Queue and cache", (
            Panel("Requests running and waiting", "Per replica: in the engine's batch, and waiting for it; and the "
                  "requests the router holds because no replica is ready.",
                  (q(f"sum by (pod) (vllm:num_requests_running{{{SERVING}, {SEL_SVC}}})", "{{pod}} running"),
                   q(f"sum by (pod) (vllm:num_requests_waiting{{{SERVING}, {SEL_SVC}}})", "{{pod}} waiting"),
                   q(f"sum(tokenfleet_router_pending_requests{{{SEL_SVC}}})", "held by the router")),
                  unit="short"),
            Panel("KV cache usage", "Share of each replica's KV blocks held by live requests.",
                  (q(f"max by (pod) (vllm:kv_cache_usage_perc{{{SERVING}, {SEL_SVC}}})", "{{pod}}"),),
                  unit="percentunit"),
            Panel("Prefix-cache hit rate", "Prompt tokens served from each replica's prefix cache, and the router's "
                  "share of prompt blocks sent where they were cached.",
                  (q(f"sum by (pod) (rate(vllm:prefix_cache_hits_total{{{SERVING}, {SEL_SVC}}}[{RATE}])) / "
                     f"sum by (pod) (rate(vllm:prefix_cache_queries_total{{{SERVING}, {SEL_SVC}}}[{RATE}]))", "{{pod}}"),
                   q(f"sum(rate(tokenfleet_router_prefix_hit_blocks_total{{{SEL_SVC}}}[{RATE}])) / "
                     f"sum(rate(tokenfleet_router_prefix_query_blocks_total{{{SEL_SVC}}}[{RATE}]))", "router")),
                  unit="percentunit"),
            Panel("Preemptions", "Requests the engine preempted (its KV cache ran out) per second.",
                  (q(f"sum by (pod) (rate(vllm:num_preemptions_total{{{SERVING}, {SEL_SVC}}}[{RATE}]))", "{{pod}}"),),
                  unit="short"),
        )),
        Row("Routing and load", (
            Panel("Routing decisions", "Requests routed per second, by why the router chose the backend "
                  "(prefix-hit, load-bound, least-load, session, no-backend, ...).",
                  (q(f"sum by (reason) (rate(tokenfleet_router_requests_total{{{SEL_SVC}}}[{RATE}]))", "{{reason}}"),),
                  unit="reqps", stack=True),
            Panel("Per-replica load", "Running + waiting requests of each backend as the router sees it, and the "
                  "requests the router has open to it.",
                  (q(f"max by (backend) (tokenfleet_router_backend_load{{{SEL_SVC}}})", "{{backend}} load"),
                   q(f"sum by (backend) (tokenfleet_router_backend_inflight{{{SEL_SVC}}})", "{{backend}} in flight")),
                  unit="short"),
            Panel("Backends", "Replicas the routers list, and those they can route to.",
                  (q(f"max by (state) (tokenfleet_router_backends{{{SEL_SVC}}})", "{{state}}"),), unit="short"),
            Panel("Output tokens/s and cost", "Tokens generated per second by each replica, and the cost per "
                  "million tokens each reports (its --price-per-hour over its last minute's tokens).",
                  (q(f"sum by (pod) (rate(vllm:generation_tokens_total{{{SERVING}, {SEL_SVC}}}[{RATE}]))", "{{pod}} tokens/s"),
                   q(f"max by (pod) (tokenfleet:cost_per_million_tokens_usd{{{SERVING}, {SEL_SVC}}})", "{{pod}} $/Mtok")),
                  unit="short"),
        )),
    ),
)

# ---------------------------------------------------------------------------- Gang scheduling and recovery
SEL_QUEUE = 'queue=~"$queue"'
SEL_GANG_NS = 'namespace=~"$namespace"'
GANG = Dashboard(
    "tokenfleet-gang", "tokenfleet / Gang scheduling and recovery",
    "The gang scheduler's queues and placements, and how Slices recover: restarts against their budgets, "
    "checkpoint age, and the operator's own health.",
    (QUEUE, GANG_NAMESPACE),
    (
        Row("Queues", (
            Panel("Queue depth", "Slices waiting for admission after the last scheduler pass.",
                  (q(f"max by (queue) (tokenfleet_slices_pending{{{SEL_QUEUE}}})", "{{queue}}"),), unit="short"),
            Panel("Why Slices wait", "Waiting Slices by queue and the placer's reason: placement failures by reason.",
                  (q(f"max by (queue, reason) (tokenfleet_slices_waiting{{{SEL_QUEUE}}})", "{{queue}} {{reason}}"),),
                  unit="short", stack=True),
            Panel("Time to place", "From a Slice attempt's first queueing to all its members bound.",
                  quantiles("tokenfleet_slice_admission_wait_seconds", SEL_QUEUE, by="queue"), unit="s"),
            Panel("Longest wait against the admission timeout", "The longest-waiting Slice of each queue, and the "
                  "queue's spec.admissionTimeoutSeconds.",
                  (q(f"max by (queue) (tokenfleet_slicequeue_oldest_pending_seconds{{{SEL_QUEUE}}})", "{{queue}} waited"),
                   q(f"max by (queue) (tokenfleet_slicequeue_admission_timeout_seconds{{{SEL_QUEUE}}})", "{{queue}} timeout")),
                  unit="s"),
        )),
        Row("Placement", (
            Panel("Gang binds", "Gangs bound whole, and bind attempts rolled back, per minute.",
                  (q(f"sum by (result) (increase(tokenfleet_gang_binds_total[{RATE}]))", "{{result}}"),), unit="short", width=8),
            Panel("Preemptions", "Gangs evicted for a higher-priority Slice, per minute.",
                  (q(f"sum(increase(tokenfleet_gang_preemptions_total[{RATE}]))", "preempted"),), unit="short", width=8),
            Panel("Scheduler pass duration", "p99 wall time of one gang-scheduler pass, by stage.",
                  (q(f"histogram_quantile(0.99, sum by (le, stage) (rate(tokenfleet_placement_duration_seconds_bucket[{RATE}])))",
                     "{{stage}}"),), unit="s", width=8),
        )),
        Row("Recovery", (
            Panel("Gang restarts", "Whole-gang restarts by Slice and what failed (MemberFailed, MemberLost, ...).",
                  (q(f"sum by (namespace, slice, reason) (increase(tokenfleet_slice_restarts_total{{{SEL_GANG_NS}}}[1h]))",
                     "{{namespace}}/{{slice}} {{reason}}"),), unit="short", width=8),
            Panel("Restart budget used", "Restarts of each Slice's current spec over its maxRestarts: at 1 the next "
                  "failure leaves it Failed.",
                  (q(f"max by (namespace, slice) (tokenfleet_slice_restart_budget_used{{{SEL_GANG_NS}}}) / "
                     f"max by (namespace, slice) (tokenfleet_slice_restart_budget{{{SEL_GANG_NS}}})",
                     "{{namespace}}/{{slice}}"),), unit="percentunit", width=8),
            Panel("Checkpoint age", "Seconds since the newest checkpoint the operator read from each batch Slice's leader.",
                  (q(f"time() - max by (namespace, slice) (tokenfleet_slice_checkpoint_saved_timestamp_seconds{{{SEL_GANG_NS}}})",
                     "{{namespace}}/{{slice}}"),), unit="s", width=8),
            Panel("Members ready", "Ready members of each Slice.",
                  (q(f"max by (namespace, slice) (tokenfleet_slice_members_ready{{{SEL_GANG_NS}}})", "{{namespace}}/{{slice}}"),),
                  unit="short"),
        )),
        Row("Operator", (
            Panel("Reconciles", "Reconcile passes per second by kind and result.",
                  (q(f"sum by (kind, result) (rate(tokenfleet_reconcile_total[{RATE}]))", "{{kind}} {{result}}"),),
                  unit="ops", width=8),
            Panel("Work queue", "Keys waiting, and the p99 time a key waits for a worker.",
                  (q("sum(tokenfleet_workqueue_depth)", "depth"),
                   q(f"histogram_quantile(0.99, sum by (le) (rate(tokenfleet_workqueue_queue_duration_seconds_bucket[{RATE}])))",
                     "p99 wait (s)")), unit="short", width=8),
            Panel("Leader", "1 for the replica that holds the Lease and works the queue.",
                  (q("max by (pod) (tokenfleet_operator_leader)", "{{pod}}"),), unit="short", width=8),
        )),
    ),
)

DASHBOARDS: dict[str, Dashboard] = {"fleet": FLEET, "service": SERVICE_DASHBOARD, "gang": GANG}


# ------------------------------------------------------------------------------------------------ build
def _variable(v: Variable) -> gd.QueryVariable:
    return (gd.QueryVariable(v.name).label(v.label).datasource(DATASOURCE).query(v.query)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(v.multi).include_all(v.multi))


def _panel(p: Panel) -> Any:
    builder: Any = gs.Panel() if p.kind == "stat" else gt.Panel()
    builder.title(p.title).description(p.description).datasource(DATASOURCE).unit(p.unit).span(p.width).height(p.height)
    if p.kind == "timeseries":
        builder.fill_opacity(10).line_width(1)
        if p.stack:
            builder.stacking(__stacking_normal())
    for i, query in enumerate(p.queries):
        target = gp.Dataquery().expr(query.expr).ref_id(chr(ord("A") + i)).datasource(DATASOURCE)
        if query.legend:
            target.legend_format(query.legend)
        builder.with_target(target)
    return builder


def __stacking_normal() -> Any:
    from grafana_foundation_sdk.builders import common as gc
    from grafana_foundation_sdk.models import common as cm
    return gc.StackingConfig().mode(cm.StackingMode.NORMAL)


def build(d: Dashboard) -> dict[str, Any]:
    """The dashboard's JSON model, as a dict."""
    builder = (gd.Dashboard(d.title).uid(d.uid).description(d.description).tags(list(d.tags)).editable()
               .time("now-1h", "now").refresh("30s").timezone("browser").tooltip(dm.DashboardCursorSync.CROSSHAIR)
               .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus")))
    for v in d.variables:
        builder.with_variable(_variable(v))
    for row in d.rows:
        builder.with_row(gd.Row(row.title))
        for p in row.panels:
            builder.with_panel(_panel(p))
    return json.loads(json.dumps(builder.build(), cls=JSONEncoder))


def render(d: Dashboard) -> str:
    return json.dumps(build(d), indent=2, sort_keys=True) + "\n"


def panel_queries(model: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of a dashboard's JSON model: what Grafana would run."""
    out = []
    for panel in model.get("panels", []):
        for target in panel.get("targets") or []:
            if target.get("expr"):
                out.append((panel["title"], target["expr"]))
    return out


def variable_queries(model: dict[str, Any]) -> list[tuple[str, str]]:
    """(variable name, label_values(...) query) of a dashboard's query variables."""
    return [(v["name"], v["query"]) for v in model.get("templating", {}).get("list", []) if v.get("type") == "query"]
