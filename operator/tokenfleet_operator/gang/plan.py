"""One pass of the gang scheduler, as a pure function.

``plan_pass`` takes a snapshot of the cluster (Nodes, all Pods, the Slices the
operator serves, SliceQueues) and the time, and says what to do:

- ``binds``: Slices placed whole, with the node of every member pod;
- ``rollbacks``: Slices found partially bound (a bind that failed half-way, or
  an operator that died mid-bind): all their live members are deleted;
- ``evictions``: whole gangs to evict for a higher-priority Slice;
- ``waiting``: why every other pending Slice waits, with numbers;
- per-queue counts for SliceQueue status and the metrics.

The shell (``gang_scheduler.py``) lists the objects, calls this, and carries
the plan out through the Binding API. Every pass is computed from a fresh
snapshot, so the plan never depends on what an earlier pass believed.

A Slice is gang-scheduled when its accelerator is not ``cpu``. Its members are
created unbound with ``schedulerName: tokenfleet`` by the Slice controller; a
Slice is *pending* here once every member of its current attempt exists and
none is bound.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pydantic import ValidationError

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.api.slice import SliceSpec
from tokenfleet_operator.api.slice_queue import DEFAULT_QUEUE
from tokenfleet_operator.gang.placement import Placement, SliceRequest, place
from tokenfleet_operator.gang.slice_state import slice_revision
from tokenfleet_operator.gang.snapshot import (
    QueueConfig,
    Timeline,
    admission_timeline,
    bound_pod,
    default_queue,
    holds_capacity,
    member_accelerators,
    node_from_object,
    per_spec,
    queue_from_object,
    slice_key,
    slice_request,
    timestamp,
    to_rfc3339,
)
from tokenfleet_operator.naming import ATTEMPT_LABEL, MEMBER_LABEL, REVISION_LABEL, SLICE_LABEL
from tokenfleet_operator.policy import ANY_HOST_PATH
from tokenfleet_operator.validation import check_slice

SCHEDULER_NAME = "tokenfleet"

# Slice states as the scheduler sees them.
PENDING = "Pending"          # every member exists, none bound: ready to place
RUNNING = "Running"          # its members hold capacity
PARTIAL = "Partial"          # some live members bound, some not: roll back
SETTLING = "Settling"        # members missing, terminating or finished: the Slice controller acts first
NOT_GANG = "NotGang"         # cpu Slices, invalid, Failed or Succeeded Slices, pods of another scheduler


@dataclass(frozen=True)
class PodRef:
    name: str
    uid: str


@dataclass(frozen=True)
class Bind:
    slice_key: str
    namespace: str
    name: str
    members: tuple[tuple[PodRef, str], ...]  # (pod, node) for member 0, 1, ...
    domain_label: str | None
    domain: str | None
    queue: str
    queued_at: float

    @property
    def message(self) -> str:
        where = f" in {self.domain_label} {self.domain}" if self.domain else ""
        return f"placed {len(self.members)} member{'s' if len(self.members) != 1 else ''}{where}: " + ", ".join(
            f"{pod.name}→{node}" for pod, node in self.members)


@dataclass(frozen=True)
class Rollback:
    slice_key: str
    namespace: str
    name: str
    pods: tuple[PodRef, ...]
    reason: str


@dataclass(frozen=True)
class Eviction:
    victim: str
    namespace: str
    name: str
    pods: tuple[PodRef, ...]
    preemptor: str


@dataclass(frozen=True)
class Waiting:
    """Why a pending Slice is not placed in this pass."""

    slice_key: str
    code: str
    message: str
    queue: str
    requeues: int = 0
    requeue_at: str | None = None


@dataclass
class PassPlan:
    binds: list[Bind] = field(default_factory=list)
    rollbacks: list[Rollback] = field(default_factory=list)
    evictions: list[Eviction] = field(default_factory=list)
    waiting: dict[str, Waiting] = field(default_factory=dict)
    states: dict[str, str] = field(default_factory=dict)
    queue_status: dict[str, dict[str, Any]] = field(default_factory=dict)  # SliceQueue name -> status
    pending_by_queue: dict[str, int] = field(default_factory=dict)
    oldest_wait_by_queue: dict[str, float] = field(default_factory=dict)   # seconds the longest-waiting Slice waited
    admission_timeouts: dict[str, float] = field(default_factory=dict)     # queues that have one


@dataclass
class _Gang:
    obj: dict[str, Any]
    spec: SliceSpec | None
    pods: list[dict[str, Any]]
    state: str = NOT_GANG


def _validated(obj: dict[str, Any]) -> SliceSpec | None:
    try:
        return SliceSpec.model_validate(obj.get("spec") or {})
    except ValidationError:
        return None


def _member(pod: dict[str, Any]) -> int | None:
    value = (pod["metadata"].get("labels") or {}).get(MEMBER_LABEL, "")
    return int(value) if value.isdigit() else None


def classify(obj: dict[str, Any], spec: SliceSpec | None, pods: list[dict[str, Any]]) -> str:
    """The state of one Slice, from its own member pods."""
    # Whether a host path is allowed is the Slice controller's business (such a Slice has no pods to place).
    if spec is None or spec.accelerator.type == "cpu" or per_spec(obj, "blocked", lambda: bool(check_slice(spec, ANY_HOST_PATH))):
        return NOT_GANG
    if obj["metadata"].get("deletionTimestamp") or (obj.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
        return NOT_GANG if not any(holds_capacity(p) for p in pods) else RUNNING
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
    if any((p.get("spec") or {}).get("schedulerName") != SCHEDULER_NAME for p in live):
        return RUNNING if any(holds_capacity(p) for p in pods) else NOT_GANG
    bound = [p for p in live if p["spec"].get("nodeName")]
    if bound and len(bound) < len(live):
        return PARTIAL
    if any(holds_capacity(p) for p in pods):
        return RUNNING
    if len(live) != len(pods):
        return SETTLING  # something is terminating or finished
    status = obj.get("status") or {}
    revision = per_spec(obj, "revision", lambda: slice_revision(spec))
    attempt = int(status.get("restarts", 0)) if status.get("revision") == revision else 0
    members = sorted(m for m in (_member(p) for p in live) if m is not None)
    current = all((p["metadata"].get("labels") or {}).get(REVISION_LABEL) == revision
                  and (p["metadata"].get("labels") or {}).get(ATTEMPT_LABEL) == str(attempt) for p in live)
    if members == list(range(spec.hosts)) and len(live) == spec.hosts and current:
        return PENDING
    return SETTLING


def queued_at(obj: dict[str, Any], pods: list[dict[str, Any]]) -> float:
    """When the current attempt started waiting: status.admission.queuedAt while it
    waits, else the oldest member pod (the pods are made when the wait starts)."""
    adm = (obj.get("status") or {}).get("admission") or {}
    if adm.get("queuedAt") and not adm.get("admittedAt"):
        t = timestamp(adm["queuedAt"])
        if t is not None:
            return t
    times = [t for t in (timestamp(p["metadata"].get("creationTimestamp")) for p in pods) if t is not None]
    if times:
        return min(times)
    return timestamp(obj["metadata"].get("creationTimestamp")) or 0.0


def _members_of(obj: dict[str, Any], pods_by_slice: dict[tuple[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    meta = obj["metadata"]
    return [p for p in pods_by_slice.get((meta["namespace"], meta["name"]), [])
            if any(r.get("uid") == meta.get("uid") for r in p["metadata"].get("ownerReferences") or [])]


def _refs(pods: list[dict[str, Any]]) -> tuple[PodRef, ...]:
    return tuple(PodRef(p["metadata"]["name"], p["metadata"]["uid"]) for p in sorted(pods, key=lambda p: p["metadata"]["name"]))


def plan_pass(nodes: list[dict[str, Any]], pods: list[dict[str, Any]], slices: list[dict[str, Any]],
              queues: list[dict[str, Any]], now: float) -> PassPlan:
    plan = PassPlan()
    pods_by_slice: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in pods:
        label = (p["metadata"].get("labels") or {}).get(SLICE_LABEL)
        if label:
            pods_by_slice.setdefault((p["metadata"]["namespace"], label), []).append(p)

    gangs: dict[str, _Gang] = {}
    for obj in sorted(slices, key=slice_key):
        spec = per_spec(obj, "spec", partial(_validated, obj))
        members = _members_of(obj, pods_by_slice)
        gang = _Gang(obj, spec, members, classify(obj, spec, members))
        gangs[slice_key(obj)] = gang
        plan.states[slice_key(obj)] = gang.state

    queue_objects = {q["metadata"]["name"]: q for q in queues}
    configs: dict[str, QueueConfig] = {}
    broken_queues: dict[str, str] = {}
    for q in queues:
        try:
            configs[q["metadata"]["name"]] = queue_from_object(q)
        except ValueError as e:
            broken_queues[q["metadata"]["name"]] = str(e)
    if DEFAULT_QUEUE not in configs and DEFAULT_QUEUE not in broken_queues:
        resources = {g.spec.accelerator.resource_name for g in gangs.values() if g.spec is not None}
        configs[DEFAULT_QUEUE] = default_queue(resources)

    gang_of_pod: dict[str, str] = {}
    running: list[SliceRequest] = []
    pending: list[SliceRequest] = []
    queued: dict[str, float] = {}
    timelines: dict[str, Timeline] = {}
    for key, gang in gangs.items():
        meta = gang.obj["metadata"]
        if gang.state == PARTIAL:
            live = [p for p in gang.pods if not p["metadata"].get("deletionTimestamp")]
            bound = sum(1 for p in live if p["spec"].get("nodeName"))
            plan.rollbacks.append(Rollback(
                key, meta["namespace"], meta["name"], _refs(live),
                f"{bound} of {len(live)} members were bound, the rest not; "
                f"deleting all {len(live)} so the gang is placed again as a whole"))
            continue
        if gang.state == RUNNING and gang.spec is not None and gang.spec.accelerator.type != "cpu":
            try:
                running.append(slice_request(gang.obj, gang.spec, timestamp(meta.get("creationTimestamp")) or 0.0))
            except ValueError:
                continue
            for p in gang.pods:
                gang_of_pod[p["metadata"]["uid"]] = key
            continue
        if gang.state != PENDING:
            continue
        assert gang.spec is not None
        queue_name = gang.spec.queue
        if queue_name in broken_queues:
            plan.waiting[key] = Waiting(key, "QueueInvalid", broken_queues[queue_name], queue_name)
            continue
        config = configs.get(queue_name)
        since = queued_at(gang.obj, gang.pods)
        queued[key] = since
        timeline = admission_timeline(since, now, config.admission_timeout, config.requeue_base, config.requeue_cap) \
            if config else Timeline(0, since)
        timelines[key] = timeline
        if timeline.held_until is not None:
            plan.waiting[key] = Waiting(
                key, "RequeueBackoff",
                f"waited {config.admission_timeout:g}s for admission without a placement ({timeline.requeues} "  # type: ignore[union-attr]
                f"timeout{'s' if timeline.requeues != 1 else ''} so far); held back until {to_rfc3339(timeline.held_until)}, "
                f"then it queues again at the back of priority {gang.spec.priority}",
                queue_name, timeline.requeues, to_rfc3339(timeline.held_until))
            continue
        try:
            pending.append(slice_request(gang.obj, gang.spec, timeline.queued_since))
        except ValueError as e:
            plan.waiting[key] = Waiting(key, "InvalidSpec", str(e), queue_name)

    node_values = [node_from_object(n) for n in sorted(nodes, key=lambda n: n["metadata"]["name"])]
    node_names = {n.name for n in node_values}
    bound_pods = [bound_pod(p, gang_of_pod.get(p["metadata"]["uid"])) for p in pods
                  if holds_capacity(p) and p["spec"]["nodeName"] in node_names]
    result = place(node_values, bound_pods, pending, [c.queue for c in configs.values()], running)

    for decision in result.decisions:
        gang = gangs[decision.slice_key]
        meta = gang.obj["metadata"]
        assert gang.spec is not None
        if isinstance(decision, Placement):
            by_member = {_member(p): p for p in gang.pods}
            placed = tuple((PodRef(by_member[i]["metadata"]["name"], by_member[i]["metadata"]["uid"]), node)
                           for i, node in decision.members)
            plan.binds.append(Bind(decision.slice_key, meta["namespace"], meta["name"], placed,
                                   decision.domain_label, decision.domain, gang.spec.queue, queued[decision.slice_key]))
        else:
            timeline = timelines[decision.slice_key]
            plan.waiting[decision.slice_key] = Waiting(decision.slice_key, decision.code, decision.reason,
                                                       gang.spec.queue, timeline.requeues)

    for preemption in result.preemptions:
        for victim in preemption.victims:
            gang = gangs[victim]
            live = [p for p in gang.pods if not p["metadata"].get("deletionTimestamp")]
            plan.evictions.append(Eviction(victim, gang.obj["metadata"]["namespace"], gang.obj["metadata"]["name"],
                                           _refs(live), preemption.preemptor))

    # Queue bookkeeping: counts for SliceQueue status and the pending gauge.
    for wait in plan.waiting.values():
        plan.pending_by_queue[wait.queue] = plan.pending_by_queue.get(wait.queue, 0) + 1
        first_queued = queued.get(wait.slice_key)     # this attempt's first queueing: requeues do not reset it
        if first_queued is not None:
            plan.oldest_wait_by_queue[wait.queue] = max(plan.oldest_wait_by_queue.get(wait.queue, 0.0), now - first_queued)
    plan.admission_timeouts = {name: c.admission_timeout for name, c in configs.items() if c.admission_timeout is not None}
    for name, config in configs.items():
        if not config.exists:
            continue
        usage: dict[str, int] = {}
        admitted = 0
        evicted = {e.victim for e in plan.evictions}
        for req in running:
            if req.queue == name and req.key not in evicted:
                admitted += 1
                usage[req.resource] = usage.get(req.resource, 0) + req.accelerators
        for b in plan.binds:
            if b.queue == name:
                admitted += 1
                spec = gangs[b.slice_key].spec
                assert spec is not None
                resource = spec.accelerator.resource_name
                usage[resource] = usage.get(resource, 0) + spec.hosts * member_accelerators(spec)
        plan.queue_status[name] = queue_status(queue_objects[name], plan.pending_by_queue.get(name, 0), admitted,
                                               dict(sorted(usage.items())), None, now)
    for name, problem in broken_queues.items():
        plan.queue_status[name] = queue_status(queue_objects[name], plan.pending_by_queue.get(name, 0), 0, {}, problem, now)
    return plan


def queue_status(obj: dict[str, Any], pending: int, admitted: int, usage: dict[str, int], problem: str | None,
                 now: float) -> dict[str, Any]:
    """A SliceQueue's status: counts, and the kstatus conditions Ready and Stalled (a queue whose spec cannot be
    used holds its Slices with QueueInvalid until the spec is fixed). Conditions keep their transition times."""
    generation = obj["metadata"].get("generation")
    if problem is None:
        desired = [cond.Desired("Ready", "True", "QueueActive", f"{pending} Slices waiting, {admitted} admitted"),
                   cond.Desired("Stalled", "False", "QueueActive", "the spec is in force")]
    else:
        desired = [cond.Desired("Ready", "False", "QueueInvalid", problem),
                   cond.Desired("Stalled", "True", "QueueInvalid", f"{problem}; its Slices wait until the spec is fixed")]
    old = (obj.get("status") or {}).get("conditions")
    status: dict[str, Any] = {"pendingSlices": pending, "admittedSlices": admitted}
    if usage:      # no usage: left out (server-side apply turns an empty map into null, which the schema rejects)
        status["usage"] = usage
    return status | {"observedGeneration": generation,
                     "conditions": cond.merge(old, desired, now=to_rfc3339(now), generation=generation)}
