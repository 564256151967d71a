"""Reconcile one InferenceService: apply what differs among its children, roll its Slices, write its status.

Inputs come from the cache: the service, its Slices, its serving (leader) pods, its router Deployment,
ConfigMap and Services, and the PersistentVolumeClaim of its model. The serving pods' addresses go into the
router ConfigMap's endpoints.json. A child is written only when it differs from what is cached
(``drift.needs_apply``), the status only when it changed: a pass over an unchanged service makes no request.

Nothing here waits for anything: a missing PVC, a held-back rollout or a replica that is not ready yet is
looked at again when its own watch event arrives (the PVC is created, a Slice turns Ready, a pod's
readiness changes), with the resync as the safety net.

The replica count is spec.replicas, or with maxReplicas set the built-in autoscaler's choice
(``autoscale/policy.py``) from the router's readings (the collector's history). A replica beyond the count is
drained before it is deleted (``autoscale/drain.py``). Goodput and the cost per token over a window come from
the same readings (``autoscale/measure.py``).
"""
from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

from pydantic import ValidationError

from tokenfleet_operator import conditions as cond
from tokenfleet_operator import metrics
from tokenfleet_operator.adapter_status import CONDITION as ADAPTERS_CONDITION
from tokenfleet_operator.adapter_status import REFUSED as ADAPTER_REFUSED
from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.api.model_source import model_sources
from tokenfleet_operator.autoscale.drain import plan_drain
from tokenfleet_operator.autoscale.measure import (
    GOODPUT_WINDOW_S,
    ReadingHistory,
    capacity_candidate,
    cold_start_seconds,
    goodput,
    signals,
    windowed_cost,
)
from tokenfleet_operator.autoscale.policy import Targets, recommend
from tokenfleet_operator.autoscale.startup import replica_startup_seconds, serving_seconds, starting_replicas
from tokenfleet_operator.builders.auth import DEFAULT_OPERATOR_NAMESPACE, Wiring, replica_key_secret_name
from tokenfleet_operator.builders.inference_service import accelerators_per_replica, desired_children, endpoints_config, hourly_cost
from tokenfleet_operator.builders.model_shape import needs_model_shape
from tokenfleet_operator.builders.rollout import ObservedSlice, plan_rollout
from tokenfleet_operator.controller.collector import ready_serving_pods
from tokenfleet_operator.controller.errors import InvalidSpec
from tokenfleet_operator.controller.manager import Context
from tokenfleet_operator.inference_service_status import (
    WAITING_REASONS,
    AdapterReports,
    Measured,
    Scaling,
    compute_status,
    deployment_ready_replicas,
    invalid_status,
    slice_state,
)
from tokenfleet_operator.kube import KubeError
from tokenfleet_operator.naming import LEADER_LABEL, REVISION_LABEL, ROLE_LABEL, SERVICE_LABEL, member_pod_name, router_name, slice_index
from tokenfleet_operator.policy import DENY_HOST_PATHS, OperatorPolicy
from tokenfleet_operator.reconcile import child_errors
from tokenfleet_operator.reconcile.child_errors import Refusal
from tokenfleet_operator.reconcile.drift import needs_apply
from tokenfleet_operator.reconcile.model_shape import ShapeStep, model_shape_step
from tokenfleet_operator.reconcile.replica_key import ReplicaKeys, known_key_id
from tokenfleet_operator.validation import Problem, check_inference_service

log = logging.getLogger("tokenfleet.inferenceservice")


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


def _parse_spec(body: dict[str, Any]) -> InferenceServiceSpec:
    try:
        return InferenceServiceSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        first = e.errors()[0]
        field = "spec." + ".".join(str(p) for p in first["loc"])
        raise InvalidSpec(Problem("InvalidSpec", field, first["msg"])) from None


def write_status(ctx: Context, body: dict[str, Any], status: dict[str, Any]) -> None:
    """Write the status if it changed, with an Event for each transition a human should see."""
    old = body.get("status") or {}
    if status == old:
        return
    ctx.apply_status(body, status)
    before, after = cond.find(old.get("conditions"), "Ready"), cond.find(status["conditions"], "Ready")
    if (before and after and before.get("status") == after.get("status") == "False"
            and before.get("reason") in WAITING_REASONS and after.get("reason") not in WAITING_REASONS):
        # still not ready, but no longer for a wait the operator sees through: a problem for a person
        ctx.event(body, "Warning", after["reason"], after.get("message", ""))
    for t in cond.transitions(old.get("conditions"), status["conditions"]):
        if t.type == "Ready":
            kind = "Normal" if t.new_status == "True" else "Warning"
            if t.old_status is None and t.new_status != "True" and t.reason in ("SlicesNotReady", "ReadingModel"):
                continue  # a brand-new service is expected to be not ready yet
            ctx.event(body, kind, t.reason, t.message)
        elif t.type in ("Degraded", "ScalingLimited") and t.new_status == "True":
            ctx.event(body, "Warning", t.reason, t.message)
    refused_before = cond.find(old.get("conditions"), ADAPTERS_CONDITION) or {}
    refused_now = cond.find(status["conditions"], ADAPTERS_CONDITION) or {}
    if refused_now.get("reason") == ADAPTER_REFUSED and (refused_before.get("reason"), refused_before.get("message")) \
            != (refused_now.get("reason"), refused_now.get("message")):
        ctx.event(body, "Warning", ADAPTER_REFUSED, refused_now.get("message", ""))


def _serving_pods(ctx: Context, namespace: str, name: str) -> list[dict[str, Any]]:
    return [p for p in ctx.cache.by_label("Pod", namespace, SERVICE_LABEL, name)
            if (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == "serve"
            and (p["metadata"].get("labels") or {}).get(LEADER_LABEL) == "true"]


# Children whose refusal shows in RouterReady (besides Ready); a refused Slice shows in SlicesReady.
ROUTER_KINDS = ("ConfigMap", "Deployment", "Service")
DEFAULT_KEYS = ReplicaKeys()


def _condition_of(refusal: Refusal, name: str) -> str:
    if refusal.kind == "Slice":
        return "SlicesReady"
    if refusal.reason == "RouterPodsRefused" or (refusal.kind in ROUTER_KINDS and refusal.name in (name, router_name(name))):
        return "RouterReady"
    return "Ready"


# While the autoscaler is on, a service is looked at again at least this often (its stabilization windows
# move with time even when no reading changes).
AUTOSCALE_SECONDS = 15.0


def _targets(spec: InferenceServiceSpec) -> Targets:
    a = spec.autoscaling
    assert spec.max_replicas is not None
    minimum = 1 if spec.min_replicas is None else spec.min_replicas
    return Targets(minimum, spec.max_replicas, a.target_requests_per_replica, a.target_kv_cache_usage,
                   spec.slo.percentile / 100 if spec.slo.time_to_first_token_ms or spec.slo.time_per_output_token_ms
                   else 0.0,
                   a.scale_up_stabilization_seconds, a.scale_down_stabilization_seconds, a.max_scale_up_replicas,
                   a.max_scale_down_replicas, a.scale_to_zero_after_seconds, a.target_waiting_per_replica or 0.0,
                   (spec.slo.time_to_first_token_ms or 0) / 1000)


def _scale(ctx: Context, body: dict[str, Any], spec: InferenceServiceSpec, ready_pods: set[str],
           history: ReadingHistory | None, startup_s: float | None,
           replicas: list[tuple[int, dict[str, Any], dict[str, Any] | None]]
           ) -> tuple[int, dict[str, Any] | None, cond.Desired | None]:
    """The replica count to run, status.autoscaling and the ScalingLimited condition (autoscaler on only)."""
    if spec.max_replicas is None:
        return spec.replicas, None, None
    t = _targets(spec)
    old = body.get("status") or {}
    current = old.get("desiredReplicas")
    if current is None or old.get("autoscaling") is None:      # the autoscaler was just turned on
        current = max(t.min_replicas, min(t.max_replicas, spec.replicas))
    now = dt.datetime.now(dt.UTC)
    sig = signals(history, ready_pods, spec.autoscaling.metric_window_seconds, startup_s, spec.slo.percentile / 100,
                  serving_seconds([pod for _, _, pod in replicas], now))
    starting = starting_replicas(current, replicas, now, startup_s)
    rec = recommend(t, current, sig, ctx.memory.recommendations, time.monotonic(), starting)
    status: dict[str, Any] = {
        "reason": rec.reason.value, "message": rec.message,
        "lastScaleTime": (old.get("autoscaling") or {}).get("lastScaleTime"),
        "requestsPerReplica": round(sig.requests / max(sig.ready_replicas, 1), 3) if sig else None,
        "waitingPerReplica": round(sig.waiting / max(sig.ready_replicas, 1), 3) if sig else None,
        "runningPerReplica": round(sig.running / max(sig.ready_replicas, 1), 3) if sig else None,
        "kvCacheUsage": round(sig.kv_cache_usage, 4) if sig and sig.kv_cache_usage is not None else None,
        "pendingRequests": sig.pending if sig else None,
        "requestsRisePerSecond": round(sig.requests_trend, 4) if sig else None,
        "replicaStartupSeconds": startup_s,
        "lastColdStartSeconds": cold_start_seconds(history),
    }
    if rec.replicas != current:
        status["lastScaleTime"] = cond.now_rfc3339()
        verb = "ScaledUp" if rec.replicas > current else "ScaledDown"
        ctx.event(body, "Normal", verb, f"{current} -> {rec.replicas} replicas: {rec.reason.value}: {rec.message}")
    limited = (cond.Desired("ScalingLimited", "True", "AtMaxReplicas",
                            f"the signals ask for more than maxReplicas ({t.max_replicas}): {rec.message}")
               if rec.limited else
               cond.Desired("ScalingLimited", "False", "WithinBounds", f"{rec.replicas} replicas within "
                            f"[{t.min_replicas}, {t.max_replicas}]"))
    return rec.replicas, status, limited


def _measure(ctx: Context, spec: InferenceServiceSpec, replicas: int, history: ReadingHistory | None,
             old_status: dict[str, Any]) -> Measured:
    now = time.monotonic()
    ctx.memory.prices.add(now, hourly_cost(spec, replicas))
    mean_price = ctx.memory.prices.mean(now, GOODPUT_WINDOW_S) or hourly_cost(spec, replicas)
    capacity = capacity_candidate(history, spec.slo.percentile, hourly_cost(spec, 1))
    best = (old_status.get("cost") or {}).get("capacity")
    if capacity and best and capacity["tokensPerHourPerReplica"] <= best.get("tokensPerHourPerReplica", 0):
        capacity = None                        # not better than the best minute so far
    return Measured(cost=windowed_cost(history, mean_price), goodput=goodput(history, spec.slo.percentile),
                    capacity=capacity)


def reconcile_inference_service(ctx: Context, namespace: str, name: str, *, policy: OperatorPolicy = DENY_HOST_PATHS,
                                keys: ReplicaKeys = DEFAULT_KEYS,
                                operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE) -> float | None:
    """One level-based pass. Returns seconds until the next pass is needed, or None.

    ``policy``: what a cluster administrator allows (host paths); ``keys``: the replica-key ledger;
    ``operator_namespace``: where the operator's pods run (the replicas' NetworkPolicy lets them in)."""
    cached = ctx.cache.get("InferenceService", namespace, name)
    if cached is None or cached["metadata"].get("deletionTimestamp"):
        return None  # children go with their owner (ownerReferences)
    body = {**cached, "apiVersion": API_VERSION, "kind": "InferenceService"}
    meta = body["metadata"]
    uid = meta["uid"]
    owner = {"apiVersion": API_VERSION, "kind": "InferenceService", "metadata": meta}
    old_status = body.get("status") or {}

    shape = ShapeStep()
    try:
        spec = _parse_spec(body)
        problems = check_inference_service(spec, policy)
        if not problems and needs_model_shape(spec):
            shape = model_shape_step(ctx, owner, spec, old_status)
            problems = [shape.problem] if shape.problem else check_inference_service(spec, policy, shape.shape)
        if problems:
            raise InvalidSpec(problems[0])
    except InvalidSpec as e:
        status = invalid_status(owner, e.problem, old_status)
        if shape.status is not None:
            status["modelShape"] = shape.status
        write_status(ctx, body, status)
        if e.problem.reason == "ReadingModel":
            return None          # the pod's progress is a watch event that brings us back
        raise

    for field, source in model_sources(spec):
        claim = source.pvc.claim_name if source.pvc is not None else None
        if claim is not None and ctx.cache.get("PersistentVolumeClaim", namespace, claim) is None:
            problem = Problem("ModelSourceNotFound", f"{field}.pvc.claimName",
                              f"PersistentVolumeClaim {claim} does not exist in {namespace}; create it")
            write_status(ctx, body, invalid_status(owner, problem, old_status))
            log.info("InferenceService %s/%s waits for %s", namespace, name, problem)
            return None          # the claim's creation is a watch event that brings us back

    history = ctx.collector.router_history(namespace, name)
    existing = [s for s in ctx.cache.by_label("Slice", namespace, SERVICE_LABEL, name) if _owned_by(s, uid)]
    serving_pods = _serving_pods(ctx, namespace, name)
    pods_by_name = {p["metadata"]["name"]: p for p in serving_pods}
    indexed = [(i, s, pods_by_name.get(_leader_pod_name(s["metadata"]["name"]))) for s in existing
               if (i := slice_index(name, s["metadata"]["name"])) is not None]
    startup_s = replica_startup_seconds([(s, pod) for _, s, pod in indexed])
    replicas, autoscaling, limited = _scale(ctx, body, spec, ready_serving_pods(ctx.cache, namespace, name), history,
                                            startup_s, indexed)
    victims = {s["metadata"]["name"]: _leader_pod_name(s["metadata"]["name"]) for i, s, _ in indexed if i >= replicas}
    drain = plan_drain(victims, old_status.get("draining") or [], history.latest.reading if history and history.latest
                       else None, dt.datetime.now(dt.UTC), spec.autoscaling.drain_timeout_seconds)
    for slice_name in drain.started:
        ctx.event(body, "Normal", "DrainStarted", f"replica {slice_name} gets no new requests; it is removed once "
                  f"its open requests finished (at most {spec.autoscaling.drain_timeout_seconds} s)")
    draining = {d["name"] for d in drain.draining}
    refused: list[tuple[str, Refusal]] = []
    first_error: KubeError | None = None

    def refuse(kind: str, child: str, error: KubeError) -> None:
        nonlocal first_error
        refusal = child_errors.refusal_of(kind, child, error)
        if refusal is None:
            raise error
        refused.append((_condition_of(refusal, name), refusal))
        first_error = first_error or error

    router = ctx.cache.get("Deployment", namespace, router_name(name))
    built_with = [c for c in (router, *existing) if c is not None]
    try:
        key_id = keys.ensure(ctx, body, built_with)
    except KubeError as e:
        refuse("Secret", replica_key_secret_name(name), e)
        key_id = known_key_id(built_with)          # keep the pods as they are until the Secret can be made
    endpoints = endpoints_config(serving_pods, draining)
    children = desired_children(owner, spec, endpoints, Wiring(key_id, operator_namespace), replicas)
    live: dict[str, dict[str, Any]] = {}
    for manifest in children.others:
        current = ctx.cache.get(manifest["kind"], namespace, manifest["metadata"]["name"])
        if needs_apply(manifest, current):
            try:
                current = ctx.apply(manifest)
            except KubeError as e:
                refuse(manifest["kind"], manifest["metadata"]["name"], e)
                current = ctx.cache.get(manifest["kind"], namespace, manifest["metadata"]["name"])
            else:
                metrics.CHILDREN_APPLIED.labels(kind=manifest["kind"]).inc()
        if current is not None:
            live[manifest["kind"]] = current
    router_pods = child_errors.router_pods_refusal(live.get("Deployment"))
    if router_pods is not None:
        refused.append(("RouterReady", router_pods))

    states = {s["metadata"]["name"]: s for s in existing}
    observed = [
        ObservedSlice(s["metadata"]["name"], (s["metadata"].get("labels") or {}).get(REVISION_LABEL), slice_state(s).ready)
        for s in existing
    ]
    plan = plan_rollout(name, replicas, children.revision, observed, spec.rollout.max_unavailable)
    created: list[tuple[int, str]] = []
    for index in plan.apply:
        manifest = children.slices[index]
        slice_name = manifest["metadata"]["name"]
        if not needs_apply(manifest, states.get(slice_name)):
            continue
        is_new = slice_name not in states
        try:
            states[slice_name] = ctx.apply(manifest)
        except KubeError as e:
            refuse("Slice", slice_name, e)
            continue
        metrics.CHILDREN_APPLIED.labels(kind="Slice").inc()
        if is_new:
            created.append((index, slice_name))
    if created:       # one Event per pass, however many replicas it made
        ctx.event(body, "Normal", "SliceCreated", "created " + ", ".join(
            f"Slice {slice_name} for replica {index}" for index, slice_name in created))
    for slice_name in plan.delete:
        if slice_name in draining:
            continue                               # drained first (autoscale/drain.py)
        if ctx.delete(API_VERSION, "Slice", namespace, slice_name):
            why = "drained" if slice_name in drain.delete else "not a replica of this service"
            ctx.event(body, "Normal", "SliceDeleted", f"deleted Slice {slice_name} ({why}; {replicas} replicas)")
        states.pop(slice_name, None)

    status = compute_status(
        owner, spec, children.revision, [slice_state(s) for s in states.values()],
        deployment_ready_replicas(live.get("Deployment")), old_status=old_status,
        scaling=Scaling(replicas, autoscaling, limited, drain.draining),
        measured=_measure(ctx, spec, len(states), history, old_status),
        adapter_reports=_adapter_reports(ctx, spec, namespace, name),
    )
    if shape.status is not None:
        status["modelShape"] = shape.status
    status = child_errors.with_refusals(status, old_status.get("conditions"), refused)
    write_status(ctx, body, status)
    for refusal in child_errors.news(old_status.get("conditions"), refused, status["conditions"]):
        ctx.event(body, "Warning", refusal.reason, refusal.message)
    metrics.SERVICE_READY_REPLICAS.labels(namespace=namespace, service=name).set(status["readyReplicas"])
    metrics.SERVICE_REPLICAS.labels(namespace=namespace, service=name).set(replicas)
    metrics.SERVICE_ACCELERATORS.labels(namespace=namespace, service=name).set(status["replicas"] * accelerators_per_replica(spec))
    metrics.SERVICE_SLO_OBJECTIVE.labels(namespace=namespace, service=name).set(spec.slo.percentile / 100)
    metrics.SERVICE_COST.labels(namespace=namespace, service=name).set(status["cost"]["dollarsPerHour"])
    if "costPerMillionTokens" in status["cost"]:
        metrics.SERVICE_COST_PER_MTOK.labels(namespace=namespace, service=name).set(status["cost"]["costPerMillionTokens"])
    if first_error is not None:
        raise first_error          # shown above; tried again with the queue's backoff
    if spec.max_replicas is not None or draining:
        return AUTOSCALE_SECONDS
    return None


def _adapter_reports(ctx: Context, spec: InferenceServiceSpec, namespace: str, name: str) -> AdapterReports | None:
    if spec.adapters is None:
        return None
    readings = ctx.collector.adapter_readings(namespace, name)
    return AdapterReports(dict(readings.replicas) if readings is not None else {},
                          frozenset(ready_serving_pods(ctx.cache, namespace, name)))


def _leader_pod_name(slice_name: str) -> str:
    return member_pod_name(slice_name, 0)
