"""Alert rules with their runbooks, and the synthetic series that make each fire or stay quiet.

Every alert carries:

- ``expr``: the rule; ``for_``: how long it must hold;
- ``signals``: the queries the rule is built from, without its thresholds. On a healthy fleet the rule
  returns nothing (it is not firing), so what a live Prometheus can show is that every signal returns data:
  the e2e test checks exactly that;
- ``firing`` and ``healthy``: promtool unit tests (input series in promtool's notation, the time to evaluate at,
  and the labels of the alert expected to fire), so each alert is shown to fire on a bad series and to stay
  quiet on a good one.

Annotations use ``{{ $labels.NAME }}`` only (no ``$value``), so the tests can say the exact text expected.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# The budget of the cost alert, in the currency of the InferenceServices' spec.price, per million output tokens.
# Change it here (then `tokenfleet monitoring`) or patch the rule with kustomize.
COST_BUDGET_PER_MTOK = 2.0
# How long a Slice may wait for admission in a queue without spec.admissionTimeoutSeconds.
QUEUE_WAIT_WITHOUT_TIMEOUT_S = 1800

SERVICE = "namespace, service"


@dataclass(frozen=True)
class Example:
    """A promtool unit test: series (promtool notation), when to evaluate, which alerts are expected."""
    series: dict[str, str]
    eval_time: str
    alerts: tuple[dict[str, str], ...] = ()    # the labels of each expected alert (besides alertname and severity)


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    runbook: str
    signals: tuple[str, ...]
    firing: Example
    healthy: Example
    labels: dict[str, str] = field(default_factory=dict)

    def rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity, **self.labels},
            "annotations": {"summary": self.summary, "description": self.description, "runbook": self.runbook},
        }


def goodput_burn(window: str) -> str:
    """How fast a service spends its error budget: the share of requests that missed spec.slo over ``window``,
    divided by the share the objective allows (1 - percentile/100). 1 spends it exactly over the period."""
    met = f'sum by ({SERVICE}) (rate(tokenfleet_router_slo_requests_total{{result="met"}}[{window}]))'
    total = f"sum by ({SERVICE}) (rate(tokenfleet_router_slo_requests_total[{window}]))"
    objective = f"max by ({SERVICE}) (tokenfleet_inferenceservice_slo_objective_ratio)"
    return f"(1 - {met} / {total}) / (1 - {objective})"


def _slo_series(met: str, missed: str) -> dict[str, str]:
    router = 'job="tokenfleet-router",namespace="prod",service="llama",pod="llama-router-a"'
    return {
        f'tokenfleet_router_slo_requests_total{{{router},result="met"}}': met,
        f'tokenfleet_router_slo_requests_total{{{router},result="missed"}}': missed,
        'tokenfleet_inferenceservice_slo_objective_ratio{job="tokenfleet-operator",namespace="prod",service="llama"}': "0.95+0x400",
    }


LLAMA = {"namespace": "prod", "service": "llama"}
REPLICAS = f"max by ({SERVICE}) (tokenfleet_inferenceservice_replicas)"
READY_REPLICAS = f"max by ({SERVICE}) (tokenfleet_inferenceservice_ready_replicas)"
RESTARTS_LEFT = ("max by (namespace, slice) (tokenfleet_slice_restart_budget)"
                 " - max by (namespace, slice) (tokenfleet_slice_restart_budget_used)")
RESTARTS = "max by (namespace, slice) (tokenfleet_slice_restart_budget_used)"
OLDEST_WAIT = "max by (queue) (tokenfleet_slicequeue_oldest_pending_seconds)"
QUEUE_TIMEOUT = "max by (queue) (tokenfleet_slicequeue_admission_timeout_seconds)"
KV_USAGE = 'max by (namespace, service, pod) (vllm:kv_cache_usage_perc{job="tokenfleet-serving"})'
WAITING = 'max by (namespace, service, pod) (vllm:num_requests_waiting{job="tokenfleet-serving"})'
ROUTABLE = f'max by ({SERVICE}) (tokenfleet_router_backends{{state="routable"}})'
LISTED = f'max by ({SERVICE}) (tokenfleet_router_backends{{state="listed"}})'
COST = f"max by ({SERVICE}) (tokenfleet_inferenceservice_cost_per_million_tokens)"
RECONCILES = "sum(rate(tokenfleet_reconcile_total[10m]))"
QUEUE_DEPTH = "sum(tokenfleet_workqueue_depth)"
ERROR_RATIO = ('(sum by (kind) (rate(tokenfleet_reconcile_total{result="error"}[10m]))'
               " or sum by (kind) (rate(tokenfleet_reconcile_total[10m])) * 0)"
               " / sum by (kind) (rate(tokenfleet_reconcile_total[10m]))")

OP = 'job="tokenfleet-operator",namespace="prod",service="llama"'
SERVING = 'job="tokenfleet-serving",namespace="prod",service="llama",pod="llama-0-0"'
ROUTER = 'job="tokenfleet-router",namespace="prod",service="llama",pod="llama-router-a"'

ALERTS: tuple[Alert, ...] = (
    Alert(
        "TokenfleetGoodputBudgetBurnFast",
        f"{goodput_burn('1h')} > 14.4 and {goodput_burn('5m')} > 14.4", "2m", "critical",
        "{{ $labels.namespace }}/{{ $labels.service }} spends its goodput error budget 14x too fast",
        "Over the last hour and the last 5 minutes, the share of requests of InferenceService {{ $labels.namespace }}/"
        "{{ $labels.service }} that missed spec.slo (TTFT or TPOT above target, or failed) is more than 14.4 times what "
        "its objective (spec.slo.percentile) allows: at this pace a 30-day budget is gone in 2 days.",
        "Open the Service dashboard for the service. If TTFT rose with queue depth and KV usage, the replicas are "
        "saturated: raise spec.replicas (or maxReplicas), or lower engine.maxNumSeqs to trade throughput for latency. "
        "If TPOT rose alone, look for preemptions (vllm:num_preemptions) and long prompts. If errors rose, check the "
        "router's responses by code and the serving pods' logs (kubectl logs -l tokenfleet.dev/inference-service=NAME).",
        (goodput_burn("1h"), goodput_burn("5m")),
        Example(_slo_series("0+1x120", "0+9x120"), "30m", (LLAMA,)),
        Example(_slo_series("0+100x120", "0+1x120"), "30m"),
    ),
    Alert(
        "TokenfleetGoodputBudgetBurnSlow",
        f"{goodput_burn('6h')} > 6 and {goodput_burn('30m')} > 6", "15m", "warning",
        "{{ $labels.namespace }}/{{ $labels.service }} spends its goodput error budget 6x too fast",
        "Over the last 6 hours and the last 30 minutes, InferenceService {{ $labels.namespace }}/{{ $labels.service }} "
        "missed spec.slo on more than 6 times the share of requests its objective allows: a 30-day budget lasts 5 days.",
        "The same checks as for the fast burn, without the hurry: compare TTFT and TPOT percentiles with the targets "
        "on the Service dashboard, the tokens/s the fleet serves with what it was sized for, and whether a change "
        "(a new spec, a new model, a routing policy) started it. Add replicas or change the SLO to what the "
        "hardware can do.",
        (goodput_burn("6h"), goodput_burn("30m")),
        Example(_slo_series("0+3x400", "0+2x400"), "3h", (LLAMA,)),
        Example(_slo_series("0+100x400", "0+1x400"), "3h"),
    ),
    Alert(
        "TokenfleetReplicasNotReady",
        f"{REPLICAS} - {READY_REPLICAS} > 0", "15m", "warning",
        "{{ $labels.namespace }}/{{ $labels.service }} has replicas that are not ready",
        "InferenceService {{ $labels.namespace }}/{{ $labels.service }} has had fewer ready replicas than spec.replicas "
        "for 15 minutes.",
        "kubectl get tfis {{ $labels.service }} -n {{ $labels.namespace }} -o wide shows the Ready reason; "
        "kubectl get tfslice -n {{ $labels.namespace }} -l tokenfleet.dev/inference-service={{ $labels.service }} shows "
        "each replica's phase. Pending: the Admitted condition says why the gang scheduler cannot place it (capacity, "
        "quota, topology) - free capacity, add nodes or lower the ask. Restarting or Failed: see the Slice's "
        "lastRestart and the pod logs. Placing for long: the readiness probe fails - look at the serving pod's log.",
        (REPLICAS, READY_REPLICAS),
        Example({f"tokenfleet_inferenceservice_replicas{{{OP}}}": "2+0x30",
                 f"tokenfleet_inferenceservice_ready_replicas{{{OP}}}": "1+0x30"}, "20m", (LLAMA,)),
        Example({f"tokenfleet_inferenceservice_replicas{{{OP}}}": "2+0x30",
                 f"tokenfleet_inferenceservice_ready_replicas{{{OP}}}": "1 1 1 2+0x27"}, "20m"),
    ),
    Alert(
        "TokenfleetSliceRestartBudgetNearlySpent",
        f"{RESTARTS_LEFT} <= 1 and {RESTARTS} > 0", "0m", "warning",
        "Slice {{ $labels.namespace }}/{{ $labels.slice }} has at most one gang restart left",
        "Slice {{ $labels.namespace }}/{{ $labels.slice }} restarted its gang and has one restart or none left "
        "(spec.restartPolicy.maxRestarts). With none left, the next failure leaves it Failed (Stalled) with no pods "
        "until its spec changes.",
        "kubectl get tfslice {{ $labels.slice }} -n {{ $labels.namespace }} -o yaml: status.lastRestart says which "
        "member failed and why (MemberFailed, ContainerRestarted, MemberLost for a lost node, MemberDeleted). Fix that "
        "cause (a node, an OOM, a crash in the workload), then reset the budget by changing the spec (any change, "
        "e.g. an annotation in the pod template), or raise maxRestarts.",
        (RESTARTS_LEFT, RESTARTS),
        Example({'tokenfleet_slice_restart_budget{job="tokenfleet-operator",namespace="prod",slice="llama-0"}': "3+0x10",
                 'tokenfleet_slice_restart_budget_used{job="tokenfleet-operator",namespace="prod",slice="llama-0"}': "0 1 2+0x8"},
                "5m", ({"namespace": "prod", "slice": "llama-0"},)),
        Example({'tokenfleet_slice_restart_budget{job="tokenfleet-operator",namespace="prod",slice="llama-0"}': "3+0x10",
                 'tokenfleet_slice_restart_budget_used{job="tokenfleet-operator",namespace="prod",slice="llama-0"}': "0 1+0x9"},
                "5m"),
    ),
    Alert(
        "TokenfleetGangStuckInQueue",
        f"({OLDEST_WAIT} > {QUEUE_TIMEOUT})"
        f" or ({OLDEST_WAIT} > {QUEUE_WAIT_WITHOUT_TIMEOUT_S} unless on (queue) {QUEUE_TIMEOUT})",
        "5m", "warning",
        "A Slice has waited in queue {{ $labels.queue }} past its admission timeout",
        "The longest-waiting Slice of SliceQueue {{ $labels.queue }} has waited for admission longer than the queue's "
        f"spec.admissionTimeoutSeconds (or {QUEUE_WAIT_WITHOUT_TIMEOUT_S // 60} minutes for a queue without one), "
        "counted from its first queueing across requeues.",
        "kubectl get tfslice -A -o wide lists the Pending Slices with their reason; the Gang scheduling dashboard "
        "shows why Slices wait per queue (InsufficientCapacity, QuotaExceeded, DomainTooSmall, BlockedByQueueHead, "
        "RequeueBackoff). Capacity: free or add nodes in one topology domain. Quota: raise spec.quota of the "
        "SliceQueue or wait for its Slices to finish. DomainTooSmall: the gang can never fit one domain: change its "
        "hosts or topologyKey. BlockedByQueueHead under StrictFIFO: the head Slice holds the queue.",
        (OLDEST_WAIT, QUEUE_TIMEOUT),
        Example({'tokenfleet_slicequeue_oldest_pending_seconds{job="tokenfleet-operator",queue="research"}': "0+60x50",
                 'tokenfleet_slicequeue_admission_timeout_seconds{job="tokenfleet-operator",queue="research"}': "600+0x50",
                 'tokenfleet_slicequeue_oldest_pending_seconds{job="tokenfleet-operator",queue="default"}': "0+60x50"},
                "40m", ({"queue": "default"}, {"queue": "research"})),
        Example({'tokenfleet_slicequeue_oldest_pending_seconds{job="tokenfleet-operator",queue="research"}': "0+5x50",
                 'tokenfleet_slicequeue_admission_timeout_seconds{job="tokenfleet-operator",queue="research"}': "600+0x50",
                 'tokenfleet_slicequeue_oldest_pending_seconds{job="tokenfleet-operator",queue="default"}': "0+40x50"},
                "40m"),
    ),
    Alert(
        "TokenfleetKVCacheSaturated",
        f"{KV_USAGE} > 0.9 and {WAITING} > 0", "10m", "warning",
        "Serving pod {{ $labels.namespace }}/{{ $labels.pod }} has a full KV cache and a queue",
        "Replica {{ $labels.pod }} of {{ $labels.namespace }}/{{ $labels.service }} has used more than 90% of its KV "
        "cache blocks for 10 minutes while requests wait: new requests queue (TTFT grows) and running ones may be "
        "preempted and recomputed.",
        "Add replicas (spec.replicas or maxReplicas), give each more KV memory (a larger accelerator, a shorter "
        "engine.maxModelLen), or lower engine.maxNumSeqs. If one replica is full and others are not, the routing is "
        "unbalanced: check the router's decisions by reason on the Service dashboard (a hot prefix or session).",
        (KV_USAGE, WAITING),
        Example({f'vllm:kv_cache_usage_perc{{{SERVING},model_name="llama"}}': "0.97+0x20",
                 f'vllm:num_requests_waiting{{{SERVING},model_name="llama"}}': "4+0x20"},
                "15m", ({"namespace": "prod", "service": "llama", "pod": "llama-0-0"},)),
        Example({f'vllm:kv_cache_usage_perc{{{SERVING},model_name="llama"}}': "0.97+0x20",
                 f'vllm:num_requests_waiting{{{SERVING},model_name="llama"}}': "0+0x20"}, "15m"),
    ),
    Alert(
        "TokenfleetRouterNoRoutableBackend",
        f"{ROUTABLE} == 0 and {LISTED} > 0", "2m", "critical",
        "The router of {{ $labels.namespace }}/{{ $labels.service }} has no backend it can route to",
        "Every replica the router of InferenceService {{ $labels.namespace }}/{{ $labels.service }} knows is "
        "unroutable (not ready, draining, or refusing connections): clients get 503.",
        "kubectl get pods -n {{ $labels.namespace }} -l tokenfleet.dev/inference-service={{ $labels.service }} -o wide: "
        "are the serving pods Ready? If they are, the router cannot reach them: check the router's log for poll "
        "errors and that the replicas accept the router's key (--api-key). If they are not, see the Slices' phase "
        "and the serving pods' /ready reason (loading, draining, engine stalled).",
        (ROUTABLE, LISTED),
        Example({f'tokenfleet_router_backends{{{ROUTER},state="routable"}}': "2 0+0x10",
                 f'tokenfleet_router_backends{{{ROUTER},state="listed"}}': "2+0x10"}, "5m", (LLAMA,)),
        Example({f'tokenfleet_router_backends{{{ROUTER},state="routable"}}': "2 1+0x10",
                 f'tokenfleet_router_backends{{{ROUTER},state="listed"}}': "2+0x10"}, "5m"),
    ),
    Alert(
        "TokenfleetCostAboveBudget",
        f"{COST} > {COST_BUDGET_PER_MTOK:g}", "30m", "warning",
        "{{ $labels.namespace }}/{{ $labels.service }} costs more per million tokens than the budget",
        f"InferenceService {{{{ $labels.namespace }}}}/{{{{ $labels.service }}}} has cost more than "
        f"{COST_BUDGET_PER_MTOK:g} per million output tokens (status.cost.costPerMillionTokens: its price per hour over "
        "the tokens it generated in the last minute) for 30 minutes.",
        "A high cost per token is idle capacity or slow tokens. Compare tokens/s with replicas on the Fleet "
        "dashboard: few tokens on many replicas means over-provisioning (lower spec.replicas or minReplicas); slow "
        "tokens at full load mean a bigger batch (engine.maxNumSeqs), prefix caching and prefix-aware routing, or a "
        "cheaper accelerator. The budget is COST_BUDGET_PER_MTOK in dev/tokenfleet_dev/monitoring/alerts.py.",
        (COST,),
        Example({f"tokenfleet_inferenceservice_cost_per_million_tokens{{{OP}}}": "8+0x60"}, "45m", (LLAMA,)),
        Example({f"tokenfleet_inferenceservice_cost_per_million_tokens{{{OP}}}": "0.4+0x60"}, "45m"),
    ),
    Alert(
        "TokenfleetOperatorDown",
        'absent(up{job="tokenfleet-operator"} == 1)', "5m", "critical",
        "No tokenfleet operator replica is up",
        "Prometheus has reached no replica of the tokenfleet operator for 5 minutes: nothing reconciles "
        "InferenceServices or Slices, and no gang is placed or restarted.",
        "kubectl get pods -n tokenfleet-system -l app.kubernetes.io/component=operator; kubectl describe and kubectl "
        "logs of a replica. CrashLoopBackOff: read the log's last lines (RBAC denials name the missing rule; check "
        "the ClusterRole of manifests/base). Pods Running but the target down: the metrics port (9090) is not "
        "reachable from Prometheus (a NetworkPolicy?).",
        ('up{job="tokenfleet-operator"}',),
        Example({'up{job="tokenfleet-operator",pod="op-a"}': "1 1 0+0x20"}, "10m", ({},)),
        Example({'up{job="tokenfleet-operator",pod="op-a"}': "1 1 0+0x20",
                 'up{job="tokenfleet-operator",pod="op-b"}': "1+0x22"}, "10m"),
    ),
    Alert(
        "TokenfleetOperatorNoLeader",
        "max(tokenfleet_operator_leader) == 0", "2m", "critical",
        "No tokenfleet operator replica leads",
        "Every operator replica that is up stands by: none holds the Lease tokenfleet-system/tokenfleet-operator, "
        "so none reconciles.",
        "kubectl get lease -n tokenfleet-system tokenfleet-operator -o yaml: the holder and its renew time. A holder "
        "that is gone expires within about 12 s; if none takes over, the replicas cannot write the Lease (RBAC: the "
        "Role tokenfleet-operator-leader-election) or their clocks jumped. The replicas' logs say which.",
        ("max(tokenfleet_operator_leader)",),
        Example({'tokenfleet_operator_leader{job="tokenfleet-operator",pod="op-a"}': "1 0+0x10",
                 'tokenfleet_operator_leader{job="tokenfleet-operator",pod="op-b"}': "0+0x11"}, "5m", ({},)),
        Example({'tokenfleet_operator_leader{job="tokenfleet-operator",pod="op-a"}': "1 0+0x10",
                 'tokenfleet_operator_leader{job="tokenfleet-operator",pod="op-b"}': "0 1+0x10"}, "5m"),
    ),
    Alert(
        "TokenfleetOperatorNotReconciling",
        f"{QUEUE_DEPTH} > 0 and {RECONCILES} == 0", "10m", "critical",
        "The tokenfleet operator has work queued and does not reconcile",
        "Keys wait in the operator's work queue and no reconcile pass has finished for 10 minutes: the workers are "
        "stuck (an API call that never returns) or the leader lost its way.",
        "Take a thread dump of the leader (kill -USR1 is not handled: use py-spy dump --pid) or restart it: "
        "kubectl delete pod of the leader (the Lease holder); the standby takes over within about 12 s and lists "
        "everything again. Report the log of the stuck replica.",
        (QUEUE_DEPTH, RECONCILES),
        Example({'tokenfleet_workqueue_depth{job="tokenfleet-operator",pod="op-a"}': "3+0x30",
                 'tokenfleet_reconcile_total{job="tokenfleet-operator",pod="op-a",kind="Slice",result="ok"}': "5+0x30"},
                "25m", ({},)),
        Example({'tokenfleet_workqueue_depth{job="tokenfleet-operator",pod="op-a"}': "3+0x30",
                 'tokenfleet_reconcile_total{job="tokenfleet-operator",pod="op-a",kind="Slice",result="ok"}': "5+2x30"},
                "25m"),
    ),
    Alert(
        "TokenfleetReconcileErrors",
        f"{ERROR_RATIO} > 0.1", "15m", "warning",
        "More than 10% of the operator's {{ $labels.kind }} reconciles fail",
        "Over 10 minutes, more than a tenth of the operator's {{ $labels.kind }} passes ended in an error (an API call "
        "that failed, a bug), and it has lasted 15 minutes. Failed keys are retried with a backoff of up to 5 minutes.",
        "The leader's log has the traceback of each error (logger tokenfleet.*). 403: a missing RBAC rule (compare "
        "with manifests/base/clusterrole.yaml). 409s are retried and harmless unless they persist. 422: an object the "
        "API server rejects - the message names the field.",
        (ERROR_RATIO,),
        Example({'tokenfleet_reconcile_total{job="tokenfleet-operator",pod="op-a",kind="Slice",result="ok"}': "0+5x40",
                 'tokenfleet_reconcile_total{job="tokenfleet-operator",pod="op-a",kind="Slice",result="error"}': "0+5x40"},
                "30m", ({"kind": "Slice"},)),
        Example({'tokenfleet_reconcile_total{job="tokenfleet-operator",pod="op-a",kind="Slice",result="ok"}': "0+5x40"},
                "30m"),
    ),
)

GROUP = "tokenfleet"


def rule_groups() -> dict[str, Any]:
    """The rule file (Prometheus' format; also the spec of the PrometheusRule)."""
    return {"groups": [{"name": GROUP, "rules": [a.rule() for a in ALERTS]}]}


def prometheus_rule() -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "tokenfleet", "namespace": "tokenfleet-system",
                     "labels": {"app.kubernetes.io/name": "tokenfleet", "app.kubernetes.io/component": "monitoring"}},
        "spec": rule_groups(),
    }


_TEMPLATE = re.compile(r"\{\{\s*\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def expand(text: str, labels: dict[str, str]) -> str:
    """Alertmanager-style template expansion for the one construct the annotations use: {{ $labels.NAME }}."""
    rest = _TEMPLATE.sub("", text)
    if "{{" in rest:
        raise ValueError(f"an annotation uses a template construct other than $labels: {text!r}")
    return _TEMPLATE.sub(lambda m: labels.get(m.group(1), ""), text)


def promtool_tests(rule_file: str) -> dict[str, Any]:
    """A `promtool test rules` file: for every alert, its firing example fires it (with the expected labels and
    annotations) and its healthy example fires nothing."""
    tests = []
    for alert in ALERTS:
        for example, expect in ((alert.firing, True), (alert.healthy, False)):
            if expect and not example.alerts:
                raise ValueError(f"{alert.name}: the firing example expects no alert")
            exp = []
            for labels in example.alerts if expect else ():
                full = {"severity": alert.severity, **alert.labels, **labels}
                exp.append({"exp_labels": full,
                            "exp_annotations": {k: expand(v, full) for k, v in alert.rule()["annotations"].items()}})
            tests.append({
                "name": f"{alert.name} {'fires' if expect else 'stays quiet'}",
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in example.series.items()],
                "alert_rule_test": [{"eval_time": example.eval_time, "alertname": alert.name, "exp_alerts": exp}],
            })
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests}
