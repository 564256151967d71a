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
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tokenfleet_operator import conditions as cond
from tokenfleet_operator import metrics
from tokenfleet_operator.adapter_status import CONDITION as ADAPTERS_CONDITION
from tokenfleet_operator.adapter_status import REFUSED as ADAPTER_REFUSED
from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.api.inference_service import DEFAULT_IMAGE, InferenceServiceSpec
from tokenfleet_operator.api.model_source import model_sources
from tokenfleet_operator.autoscale.drain import DrainPlan, plan_drain
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
from tokenfleet_operator.builders.inference_service import (
    Children,
    accelerators_per_replica,
    desired_children,
    endpoints_config,
    hourly_cost,
)
from tokenfleet_operator.builders.model_shape import needs_model_shape
from tokenfleet_operator.builders.rollout import ObservedSlice, RolloutPlan, plan_rollout
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
ROUTER_KINDS = ("ConfigMap", "Deployment", "Service", "PodDisruptionBudget")
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
    serving_s = ctx.memory.serving.seconds(time.monotonic(), current, serving_seconds([pod for _, _, pod in replicas], now))
    sig = signals(history, ready_pods, spec.autoscaling.metric_window_seconds, startup_s, spec.slo.percentile / 100,
                  serving_s)
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


@dataclass
class Refusals:
    """Children the API server refused in this pass, by the condition that shows each, and the first such
    error (raised at the end of the pass so that the queue tries again with its backoff)."""

    service: str
    items: list[tuple[str, Refusal]] = field(default_factory=list)
    first_error: KubeError | None = None

    def refuse(self, kind: str, child: str, error: KubeError) -> None:
        """A write of ``child`` failed: note it if it is a refusal a person must see, else raise it."""
        refusal = child_errors.refusal_of(kind, child, error)
        if refusal is None:
            raise error
        self.items.append((_condition_of(refusal, self.service), refusal))
        self.first_error = self.first_error or error


@dataclass
class ServicePass:
    """One pass over one InferenceService: the object as cached, its parsed spec and what the pass found."""

    ctx: Context
    body: dict[str, Any]
    spec: InferenceServiceSpec | None = None
    shape: ShapeStep = field(default_factory=ShapeStep)
    refusals: Refusals = field(init=False)

    def __post_init__(self) -> None:
        self.refusals = Refusals(self.name)

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.body["metadata"]["namespace"])

    @property
    def owner(self) -> dict[str, Any]:
        return {"apiVersion": API_VERSION, "kind": "InferenceService", "metadata": self.body["metadata"]}

    @property
    def old_status(self) -> dict[str, Any]:
        return self.body.get("status") or {}

    @property
    def valid_spec(self) -> InferenceServiceSpec:
        assert self.spec is not None, "accept_spec ran first"
        return self.spec


@dataclass(frozen=True)
class Replicas:
    """The service's replicas as observed, and how many it should run."""

    slices: tuple[dict[str, Any], ...]                                 # the Slices it owns
    indexed: tuple[tuple[int, dict[str, Any], dict[str, Any] | None], ...]  # (index, Slice, its leader pod)
    serving_pods: tuple[dict[str, Any], ...]                           # the leader pods
    history: ReadingHistory | None                                     # the router's readings
    count: int                                                         # replicas to run
    autoscaling: dict[str, Any] | None                                 # status.autoscaling
    limited: cond.Desired | None                                       # the ScalingLimited condition
    drain: DrainPlan

    @property
    def draining(self) -> set[str]:
        return {d["name"] for d in self.drain.draining}


def reconcile_inference_service(ctx: Context, namespace: str, name: str, *, policy: OperatorPolicy = DENY_HOST_PATHS,
                                keys: ReplicaKeys = DEFAULT_KEYS,
                                operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE,
                                router_image: str = DEFAULT_IMAGE) -> float | None:
    """One level-based pass. Returns seconds until the next pass is needed, or None.

    ``policy``: what a cluster administrator allows (host paths); ``keys``: the replica-key ledger;
    ``operator_namespace``: where the operator's pods run (the replicas' NetworkPolicy lets them in);
    ``router_image``: the image of the router Deployment (the operator's --router-image)."""
    p = start_pass(ctx, namespace, name)                  # the service from the cache; None once it is deleted
    if p is None or not accept_spec(p, policy):           # parse and check the spec (and the model's shape)
        return None
    if not model_claims_exist(p):                         # a model source's PVC is missing: wait for it
        return None
    replicas = observe_replicas(p)                        # Slices, leader pods, the count to run, the drains
    wiring = Wiring(replica_key(p, keys, replicas), operator_namespace, router_image)  # the router-to-replica key
    children = desired_children(p.owner, p.valid_spec, endpoints_config(list(replicas.serving_pods),
                                                                        replicas.draining), wiring, replicas.count)
    live = apply_router_children(p, children)             # router ConfigMap, Deployment, Services, PDB, NetworkPolicy
    plan, slices = apply_slices(p, replicas, children)    # create or update the Slices the rollout allows
    delete_surplus_slices(p, replicas, plan, slices)      # Slices beyond the count, once drained
    status = write_service_status(p, replicas, children, slices, live)  # status, conditions and their Events
    export_service_metrics(p, replicas, status)           # the per-service gauges
    return next_pass(p, replicas)                         # raise the first refusal, or when to look again


def start_pass(ctx: Context, namespace: str, name: str) -> ServicePass | None:
    cached = ctx.cache.get("InferenceService", namespace, name)
    if cached is None or cached["metadata"].get("deletionTimestamp"):
        return None  # children go with their owner (ownerReferences)
    return ServicePass(ctx, {**cached, "apiVersion": API_VERSION, "kind": "InferenceService"})


def accept_spec(p: ServicePass, policy: OperatorPolicy) -> bool:
    """Parse and check the spec; with a model split over ranks, read the model's shape first. A bad spec writes
    Ready=False naming the field and raises InvalidSpec; while the shape is being read, False (the reading
    pod's progress brings the service back)."""
    try:
        p.spec = _parse_spec(p.body)
        problems = check_inference_service(p.spec, policy)
        if not problems and needs_model_shape(p.spec):
            p.shape = model_shape_step(p.ctx, p.owner, p.spec, p.old_status)
            problems = [p.shape.problem] if p.shape.problem else check_inference_service(p.spec, policy, p.shape.shape)
        if problems:
            raise InvalidSpec(problems[0])
    except InvalidSpec as e:
        status = invalid_status(p.owner, e.problem, p.old_status)
        if p.shape.status is not None:
            status["modelShape"] = p.shape.status
        write_status(p.ctx, p.body, status)
        if e.problem.reason == "ReadingModel":
            return False
        raise
    return True


def model_claims_exist(p: ServicePass) -> bool:
    """Whether every PersistentVolumeClaim a model source names exists; if one does not, Ready=False says so
    (its creation is a watch event that brings the service back)."""
    for field_name, source in model_sources(p.valid_spec):
        claim = source.pvc.claim_name if source.pvc is not None else None
        if claim is not None and p.ctx.cache.get("PersistentVolumeClaim", p.namespace, claim) is None:
            problem = Problem("ModelSourceNotFound", f"{field_name}.pvc.claimName",
                              f"PersistentVolumeClaim {claim} does not exist in {p.namespace}; create it")
            write_status(p.ctx, p.body, invalid_status(p.owner, problem, p.old_status))
            log.info("InferenceService %s/%s waits for %s", p.namespace, p.name, problem)
            return False
    return True


def index_replicas(service: str, slices: list[dict[str, Any]], serving_pods: list[dict[str, Any]]
                   ) -> list[tuple[int, dict[str, Any], dict[str, Any] | None]]:
    """(replica index, Slice, its leader pod or None) for every Slice named as a replica of ``service``."""
    pods_by_name = {pod["metadata"]["name"]: pod for pod in serving_pods}
    return [(i, s, pods_by_name.get(_leader_pod_name(s["metadata"]["name"]))) for s in slices
            if (i := slice_index(service, s["metadata"]["name"])) is not None]


def observe_replicas(p: ServicePass) -> Replicas:
    """The Slices and leader pods from the cache, the replica count (spec.replicas or the autoscaler's), and
    the drain of every replica beyond it (an Event when one starts)."""
    ctx, spec, uid = p.ctx, p.valid_spec, p.body["metadata"]["uid"]
    history = ctx.collector.router_history(p.namespace, p.name)
    slices = [s for s in ctx.cache.by_label("Slice", p.namespace, SERVICE_LABEL, p.name) if _owned_by(s, uid)]
    serving_pods = _serving_pods(ctx, p.namespace, p.name)
    indexed = index_replicas(p.name, slices, serving_pods)
    startup_s = replica_startup_seconds([(s, pod) for _, s, pod in indexed])
    count, autoscaling, limited = _scale(ctx, p.body, spec, ready_serving_pods(ctx.cache, p.namespace, p.name),
                                         history, startup_s, indexed)
    victims = {s["metadata"]["name"]: _leader_pod_name(s["metadata"]["name"]) for i, s, _ in indexed if i >= count}
    drain = plan_drain(victims, p.old_status.get("draining") or [],
                       history.latest.reading if history and history.latest else None, dt.datetime.now(dt.UTC),
                       spec.autoscaling.drain_timeout_seconds)
    for slice_name in drain.started:
        ctx.event(p.body, "Normal", "DrainStarted", f"replica {slice_name} gets no new requests; it is removed once "
                  f"its open requests finished (at most {spec.autoscaling.drain_timeout_seconds} s)")
    return Replicas(tuple(slices), tuple(indexed), tuple(serving_pods), history, count, autoscaling, limited, drain)


def replica_key(p: ServicePass, keys: ReplicaKeys, replicas: Replicas) -> str:
    """The identity of the service's replica key, its Secret made if missing; while the Secret cannot be made,
    the identity the pods were built with (they stay as they are)."""
    router = p.ctx.cache.get("Deployment", p.namespace, router_name(p.name))
    built_with = [c for c in (router, *replicas.slices) if c is not None]
    try:
        return keys.ensure(p.ctx, p.body, built_with)
    except KubeError as e:
        p.refusals.refuse("Secret", replica_key_secret_name(p.name), e)
        return known_key_id(built_with)


def apply_router_children(p: ServicePass, children: Children) -> dict[str, dict[str, Any]]:
    """Apply the children besides the Slices where they differ from the cache; the live object of each kind."""
    live: dict[str, dict[str, Any]] = {}
    for manifest in children.others:
        kind, child = manifest["kind"], manifest["metadata"]["name"]
        current = p.ctx.cache.get(kind, p.namespace, child)
        if needs_apply(manifest, current):
            try:
                current = p.ctx.apply(manifest)
            except KubeError as e:
                p.refusals.refuse(kind, child, e)
                current = p.ctx.cache.get(kind, p.namespace, child)
            else:
                metrics.CHILDREN_APPLIED.labels(kind=kind).inc()
        if current is not None:
            live[kind] = current
    router_pods = child_errors.router_pods_refusal(live.get("Deployment"))
    if router_pods is not None:
        p.refusals.items.append(("RouterReady", router_pods))
    return live


def rollout_plan(service: str, spec: InferenceServiceSpec, replicas: int, revision: str,
                 slices: tuple[dict[str, Any], ...]) -> RolloutPlan:
    """Which replicas to apply at the current revision and which Slices to delete (``builders/rollout.py``)."""
    observed = [ObservedSlice(s["metadata"]["name"], (s["metadata"].get("labels") or {}).get(REVISION_LABEL),
                              slice_state(s).ready) for s in slices]
    return plan_rollout(service, replicas, revision, observed, spec.rollout.max_unavailable)


def apply_slices(p: ServicePass, replicas: Replicas, children: Children
                 ) -> tuple[RolloutPlan, dict[str, dict[str, Any]]]:
    """Apply the Slices the rollout plan allows where they differ; one Event names the replicas made."""
    plan = rollout_plan(p.name, p.valid_spec, replicas.count, children.revision, replicas.slices)
    states = {s["metadata"]["name"]: s for s in replicas.slices}
    created: list[tuple[int, str]] = []
    for index in plan.apply:
        manifest = children.slices[index]
        slice_name = manifest["metadata"]["name"]
        if not needs_apply(manifest, states.get(slice_name)):
            continue
        is_new = slice_name not in states
        try:
            states[slice_name] = p.ctx.apply(manifest)
        except KubeError as e:
            p.refusals.refuse("Slice", slice_name, e)
            continue
        metrics.CHILDREN_APPLIED.labels(kind="Slice").inc()
        if is_new:
            created.append((index, slice_name))
    if created:       # one Event per pass, however many replicas it made
        p.ctx.event(p.body, "Normal", "SliceCreated", "created " + ", ".join(
            f"Slice {slice_name} for replica {index}" for index, slice_name in created))
    return plan, states


def delete_surplus_slices(p: ServicePass, replicas: Replicas, plan: RolloutPlan,
                          states: dict[str, dict[str, Any]]) -> None:
    """Delete the Slices the plan drops, except those still draining (``autoscale/drain.py``)."""
    draining = replicas.draining
    for slice_name in plan.delete:
        if slice_name in draining:
            continue
        if p.ctx.delete(API_VERSION, "Slice", p.namespace, slice_name):
            why = "drained" if slice_name in replicas.drain.delete else "not a replica of this service"
            p.ctx.event(p.body, "Normal", "SliceDeleted",
                        f"deleted Slice {slice_name} ({why}; {replicas.count} replicas)")
        states.pop(slice_name, None)


def write_service_status(p: ServicePass, replicas: Replicas, children: Children,
                         states: dict[str, dict[str, Any]], live: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The status from what the pass saw (``inference_service_status.py``), the refusals' conditions on top;
    written if it changed, with a Warning Event for each new refusal."""
    spec, old_status = p.valid_spec, p.old_status
    status = compute_status(
        p.owner, spec, children.revision, [slice_state(s) for s in states.values()],
        deployment_ready_replicas(live.get("Deployment")), old_status=old_status,
        scaling=Scaling(replicas.count, replicas.autoscaling, replicas.limited, replicas.drain.draining),
        measured=_measure(p.ctx, spec, len(states), replicas.history, old_status),
        adapter_reports=_adapter_reports(p.ctx, spec, p.namespace, p.name),
    )
    if p.shape.status is not None:
        status["modelShape"] = p.shape.status
    status = child_errors.with_refusals(status, old_status.get("conditions"), p.refusals.items)
    write_status(p.ctx, p.body, status)
    for refusal in child_errors.news(old_status.get("conditions"), p.refusals.items, status["conditions"]):
        p.ctx.event(p.body, "Warning", refusal.reason, refusal.message)
    return status


def export_service_metrics(p: ServicePass, replicas: Replicas, status: dict[str, Any]) -> None:
    spec, labels = p.valid_spec, {"namespace": p.namespace, "service": p.name}
    metrics.SERVICE_READY_REPLICAS.labels(**labels).set(status["readyReplicas"])
    metrics.SERVICE_REPLICAS.labels(**labels).set(replicas.count)
    metrics.SERVICE_ACCELERATORS.labels(**labels).set(status["replicas"] * accelerators_per_replica(spec))
    metrics.SERVICE_SLO_OBJECTIVE.labels(**labels).set(spec.slo.percentile / 100)
    metrics.SERVICE_COST.labels(**labels).set(status["cost"]["dollarsPerHour"])
    if "costPerMillionTokens" in status["cost"]:
        metrics.SERVICE_COST_PER_MTOK.labels(**labels).set(status["cost"]["costPerMillionTokens"])


def next_pass(p: ServicePass, replicas: Replicas) -> float | None:
    """Raise the first refused write (shown in the status; the queue retries with its backoff); otherwise look
    again in AUTOSCALE_SECONDS while the autoscaler is on or a replica drains, else only on the next event."""
    if p.refusals.first_error is not None:
        raise p.refusals.first_error
    if p.valid_spec.max_replicas is not None or replicas.draining:
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
