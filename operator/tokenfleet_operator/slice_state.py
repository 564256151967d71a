"""The Slice state machine as a pure function.

``plan_slice`` takes a Slice, the member pods that exist and the time, and
returns what to do: pods to create, pods to delete, the new status, Events,
and when to look again. The Kopf handler only gathers the inputs and carries
out the plan, so every transition is unit-tested here.

Gang semantics: all members or none. When a member of the current attempt
fails (pod Failed, a container restarted, or the pod vanished from a Ready
gang), the whole gang is torn down and, after an exponential backoff, made
again as the next attempt, until restartPolicy.maxRestarts is spent and the
Slice is Failed. New pods are created only once the previous attempt's pods
are gone (BlockingRecreate), so accelerators are never double-booked.

A batch Slice (role: batch) ends: once every member of an attempt has exited
successfully it is Succeeded (condition Complete=True) and stays so until its
spec changes. A restarted batch gang is told to resume from its checkpoint
store (TOKENFLEET_RESTORE_FROM); the checkpoint its leader reports is kept in
status.checkpoint.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.api.slice import SliceSpec
from tokenfleet_operator.builders.slice_pods import member_pod
from tokenfleet_operator.naming import ATTEMPT_LABEL, MEMBER_LABEL, REVISION_LABEL, revision_of
from tokenfleet_operator.validation import check_slice


@dataclass(frozen=True)
class PodView:
    """What the planner needs to know about one member pod."""

    name: str
    member: int | None
    attempt: int | None
    revision: str | None
    phase: str = "Pending"
    ready: bool = False
    node: str | None = None
    deleting: bool = False
    restarts: int = 0
    unschedulable: str | None = None  # the scheduler's message, if it could not place the pod
    failure: str = ""  # why the pod failed, for messages


def _int_label(labels: dict[str, str], key: str) -> int | None:
    value = labels.get(key, "")
    return int(value) if value.isdigit() else None


def pod_view(pod: dict[str, Any]) -> PodView:
    """Summarise a Pod object (as returned by the API server)."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status") or {}
    labels = meta.get("labels") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    unschedulable = None
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            unschedulable = c.get("message") or "unschedulable"
    restarts = sum(int(cs.get("restartCount", 0)) for cs in status.get("containerStatuses") or [])
    failure = status.get("reason") or status.get("message") or ""
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            failure = failure or f"container {cs.get('name')} exited with code {term.get('exitCode')} ({term.get('reason', '')})"
    return PodView(
        name=meta.get("name", ""),
        member=_int_label(labels, MEMBER_LABEL),
        attempt=_int_label(labels, ATTEMPT_LABEL),
        revision=labels.get(REVISION_LABEL),
        phase=status.get("phase", "Pending"),
        ready=ready,
        node=spec.get("nodeName"),
        deleting=bool(meta.get("deletionTimestamp")),
        restarts=restarts,
        unschedulable=unschedulable,
        failure=failure,
    )


@dataclass(frozen=True)
class Admission:
    """The placement decision for this Slice: admitted (with optional node per
    member) or not, with a reason. The default lets the scheduler place pods.

    With ``scheduler_name`` set the Slice is gang-scheduled: its member pods are
    created at once, unbound, for that scheduler, which binds all of them or
    none. The Slice is admitted exactly when every member is bound; until then
    ``reason``/``message`` say why it waits (the placer's reason, with numbers).
    ``preempted_by`` names the Slice this one is being evicted for: losing
    members to a preemption is not a failure and costs no restart.
    """

    admitted: bool = True
    nodes: dict[int, str] | None = None
    reason: str = "DefaultScheduler"
    message: str = "members are placed by the default scheduler, preferring one topology domain"
    scheduler_name: str | None = None
    preempted_by: str | None = None
    requeues: int = 0
    requeue_at: str | None = None


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class SlicePlan:
    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    # True when status.restarts grows: the status must be written (with a
    # resourceVersion precondition) before any pod is deleted, so a crash in
    # between never counts one failure twice.
    counts_restart: bool = False


# How often a running batch Slice with checkpoints is reconciled to read its leader's latest checkpoint.
CHECKPOINT_READ_SECONDS = 5.0


def backoff_seconds(spec: SliceSpec, restart_number: int) -> int:
    """Delay before restart number n (1-based): base * 2^(n-1), capped."""
    policy = spec.restart_policy
    if restart_number < 1 or policy.backoff_seconds == 0:
        return 0
    return min(policy.max_backoff_seconds, policy.backoff_seconds * 2 ** min(restart_number - 1, 30))


def slice_revision(spec: SliceSpec) -> str:
    return revision_of(spec.to_wire())


def _failure(current: list[PodView], hosts: int, was_running: bool, batch: bool) -> tuple[str, int, str] | None:
    """(reason, member, message) of the first member failure of the current attempt, if any. A batch
    member that exits successfully has done its part; a serving member must not exit."""
    for pod in sorted(current, key=lambda p: p.member or 0):
        if pod.phase == "Failed":
            return "MemberFailed", pod.member or 0, f"pod {pod.name} failed: {pod.failure or 'no reason given'}"
        if pod.phase == "Succeeded" and not batch:
            return "MemberExited", pod.member or 0, f"pod {pod.name} exited; a serving member must keep running"
        if pod.restarts > 0:
            return "ContainerRestarted", pod.member or 0, f"a container of pod {pod.name} restarted"
    if was_running:
        present = {p.member for p in current}
        for member in range(hosts):
            if member not in present:
                return "MemberLost", member, f"member {member} disappeared (pod deleted, evicted or its node lost)"
    return None


def _was_fully_bound(pods: list[PodView], hosts: int) -> bool:
    """Every member of the attempt exists and is bound to a node."""
    return len({p.member for p in pods if p.node}) >= hosts


def _admission_status(old: dict[str, Any] | None, phase: str, members: dict[str, int], hosts: int,
                      admission: Admission, now: dt.datetime) -> dict[str, Any] | None:
    """status.admission of a gang-scheduled Slice.

    queuedAt is set when an attempt starts waiting (and again when an admitted
    gang waits again: a restart or a preemption); admittedAt and waitSeconds
    once every member is bound. Nothing changes between those points, so a
    waiting Slice's status does not churn."""
    adm = dict(old or {})
    if phase in ("Restarting", "Failed"):
        return None
    if not adm.get("queuedAt") or (adm.get("admittedAt") and phase == "Pending"):
        adm = {"queuedAt": cond.now_rfc3339(now)}
    if members["scheduled"] >= hosts and not adm.get("admittedAt"):
        adm["admittedAt"] = cond.now_rfc3339(now)
        adm["waitSeconds"] = max(0, int((now - cond.parse_rfc3339(adm["queuedAt"])).total_seconds()))
    if phase == "Pending" and admission.requeues:
        adm["requeues"] = admission.requeues
        if admission.requeue_at:
            adm["requeueAt"] = admission.requeue_at
        else:
            adm.pop("requeueAt", None)
    elif phase != "Pending":
        adm.pop("requeueAt", None)
    return adm


def plan_slice(
    obj: dict[str, Any],
    spec: SliceSpec,
    pods: list[PodView],
    *,
    now: dt.datetime,
    admission: Admission | None = None,
    node_domains: dict[str, str] | None = None,
    reported_checkpoint: dict[str, str] | None = None,
) -> SlicePlan:
    """``reported_checkpoint``: {latest, savedAt} as the leader member reports it, if it was read."""
    admission = admission or Admission()
    batch = spec.role == "batch"

    def counts_ready(p: PodView) -> bool:
        return p.ready or (batch and p.phase == "Succeeded")     # a finished batch member has done its part
    gang = admission.scheduler_name is not None
    node_domains = node_domains or {}
    meta = obj["metadata"]
    generation = meta.get("generation")
    old = dict(obj.get("status") or {})
    old_conditions = old.get("conditions") or []
    now_s = cond.now_rfc3339(now)
    revision = slice_revision(spec)
    plan = SlicePlan()

    restarts = int(old.get("restarts", 0))
    last_restart = old.get("lastRestart")
    not_before = old.get("restartNotBefore")
    phase = old.get("phase", "Pending")
    checkpoint = old.get("checkpoint")
    if reported_checkpoint and spec.checkpoint is not None:
        checkpoint = dict(checkpoint or {}) | reported_checkpoint
    if old.get("revision") not in (None, revision):
        # A new spec is a new gang: fresh restart budget.
        restarts, last_restart, not_before = 0, None, None
        plan.events.append(Event("Normal", "SpecChanged", f"spec changed (revision {revision}); recreating all {spec.hosts} members"))
        phase = "Placing"
    attempt = restarts

    live = [p for p in pods if not p.deleting]
    terminating = [p for p in pods if p.deleting]
    stale = [
        p for p in live
        if p.revision != revision or p.attempt != attempt or p.member is None or p.member >= spec.hosts
    ]
    current = [p for p in live if p not in stale]
    plan.delete.extend(p.name for p in stale)

    def finish(new_phase: str, desired: list[cond.Desired]) -> SlicePlan:
        members = {
            "desired": spec.hosts,
            "scheduled": sum(1 for p in current if p.node),
            "ready": sum(1 for p in current if counts_ready(p)),
        }
        if batch:
            members["succeeded"] = sum(1 for p in current if p.phase == "Succeeded")
            if new_phase == "Succeeded":
                desired = [*desired, cond.Desired("Complete", "True", "AllMembersSucceeded",
                                                  f"all {spec.hosts} members exited successfully")]
            else:
                desired = [*desired, cond.Desired("Complete", "False", "Running" if new_phase != "Failed" else "Failed",
                                                  f"{members['succeeded']}/{spec.hosts} members finished")]
        placement = [
            {k: v for k, v in {
                "member": p.member, "pod": p.name, "node": p.node,
                "domain": node_domains.get(p.node) if p.node else None,
            }.items() if v is not None}
            for p in sorted(current, key=lambda p: p.member or 0)
        ]
        status: dict[str, Any] = {
            "phase": new_phase,
            "members": members,
            "restarts": restarts,
            "revision": revision,
            "observedGeneration": generation,
            "conditions": cond.merge(old_conditions, desired, now=now_s, generation=generation),
        }
        if placement:
            status["placement"] = placement
        if gang:
            status["admission"] = _admission_status(old.get("admission"), new_phase, members, spec.hosts, admission, now)
        if last_restart:
            status["lastRestart"] = last_restart
        if not_before:
            status["restartNotBefore"] = not_before
        if checkpoint:
            status["checkpoint"] = checkpoint
        plan.status = {k: v for k, v in status.items() if v is not None}
        for t in cond.transitions(old_conditions, plan.status["conditions"]):
            if t.type == "Ready" and t.new_status == "True":
                plan.events.append(Event("Normal", "SliceReady", f"all {spec.hosts} members are ready"))
        return plan

    # 1. Specs the schema cannot reject.
    problems = check_slice(spec)
    if problems:
        p = problems[0]
        plan.delete.extend(x.name for x in current)
        current = []
        if cond.find(old_conditions, "Ready") is None or cond.find(old_conditions, "Ready").get("reason") != p.reason:
            plan.events.append(Event("Warning", p.reason, str(p)))
        return finish("Failed", [
            cond.Desired("Admitted", "False", p.reason, str(p)),
            cond.Desired("Placed", "False", p.reason, str(p)),
            cond.Desired("Ready", "False", p.reason, str(p)),
            cond.Desired("Failed", "True", p.reason, str(p)),
        ])

    # 2. Budget spent: stay Failed (with no pods) until the spec changes.
    if phase == "Failed":
        plan.delete.extend(x.name for x in current)
        current = []
        reason = (cond.find(old_conditions, "Failed") or {}).get("reason", "RestartBudgetExhausted")
        message = (cond.find(old_conditions, "Failed") or {}).get("message", "restart budget exhausted")
        return finish("Failed", [
            cond.Desired("Admitted", "False", reason, message),
            cond.Desired("Placed", "False", reason, message),
            cond.Desired("Ready", "False", reason, message),
            cond.Desired("Failed", "True", reason, message),
        ])

    # 2b. A batch job that has finished stays finished (its pods stay, for their logs).
    done = [p for p in current if p.phase == "Succeeded"]
    if batch and (phase == "Succeeded" or (len({p.member for p in done}) >= spec.hosts and len(current) == len(done))):
        text = f"all {spec.hosts} members exited successfully"
        if phase != "Succeeded":
            plan.events.append(Event("Normal", "Completed", text + (f" after {restarts} gang restarts" if restarts else "")))
        return finish("Succeeded", [
            cond.Desired("Admitted", "True", "Completed", text),
            cond.Desired("Placed", "False", "Completed", text),
            cond.Desired("Ready", "False", "Completed", text),
            cond.Desired("Failed", "False", "Completed", text),
        ])

    # 3a. Preempted (gang scheduler): give the capacity back, wait, and queue again.
    # No restart is counted: the gang did nothing wrong.
    if gang and admission.preempted_by and (any(p.node for p in current) or terminating):
        plan.delete.extend(x.name for x in current)
        current = []
        plan.requeue_after = 2.0
        text = f"evicted as a whole gang for higher-priority Slice {admission.preempted_by}; it queues again once its members are gone"
        return finish("Pending", [
            cond.Desired("Admitted", "False", "Preempted", text),
            cond.Desired("Placed", "False", "Preempted", text),
            cond.Desired("Ready", "False", "Preempted", text),
            cond.Desired("Failed", "False", "WithinRestartBudget", f"restart {restarts}/{spec.restart_policy.max_restarts}" if restarts else "no restarts"),
        ])

    # 3. A member of the current attempt failed: restart the whole gang, or give up.
    # Members missing from a running gang are lost, unless they are being replaced.
    failure = _failure(current, spec.hosts, was_running=phase in ("Ready", "Degraded") and not stale and not terminating
                       and not (gang and admission.preempted_by), batch=batch)
    # A pod of the current attempt that is being deleted was not deleted by us
    # (we only delete older attempts): an eviction, a drain or a person.
    deleted = [p for p in terminating if p.revision == revision and p.attempt == attempt and p.member is not None]
    if gang and not _was_fully_bound(current + deleted, spec.hosts):
        # A gang that was never bound completely has not started: losing a member
        # of it (the gang scheduler's rollback, or a person) is no failure. The
        # remaining members are recreated once the deleted ones are gone.
        deleted = []
    if deleted and not failure:
        failure = ("MemberDeleted", deleted[0].member, f"pod {deleted[0].name} is being deleted")
    if failure:
        reason, member, message = failure
        plan.delete.extend(x.name for x in current)
        current = []
        if restarts >= spec.restart_policy.max_restarts:
            text = f"{message}; restart budget of {spec.restart_policy.max_restarts} spent, the slice stays down until its spec changes"
            plan.events.append(Event("Warning", "RestartBudgetExhausted", text))
            return finish("Failed", [
                cond.Desired("Admitted", "False", "RestartBudgetExhausted", text),
                cond.Desired("Placed", "False", "RestartBudgetExhausted", text),
                cond.Desired("Ready", "False", "RestartBudgetExhausted", text),
                cond.Desired("Failed", "True", "RestartBudgetExhausted", text),
            ])
        restarts += 1
        delay = backoff_seconds(spec, restarts)
        last_restart = {"time": now_s, "reason": reason, "member": member, "message": message}
        not_before = cond.now_rfc3339(now + dt.timedelta(seconds=delay))
        if spec.checkpoint is not None and spec.checkpoint.restore_on_restart:
            checkpoint = dict(checkpoint or {})
        plan.counts_restart = True
        plan.requeue_after = float(delay) if delay else 1.0
        plan.events.append(Event(
            "Warning", "GangRestart",
            f"{message}; restarting all {spec.hosts} members (restart {restarts} of {spec.restart_policy.max_restarts}) in {delay}s",
        ))
        text = f"restart {restarts}/{spec.restart_policy.max_restarts} after {reason}: {message}"
        return finish("Restarting", [
            cond.Desired("Admitted", "True", admission.reason, admission.message),
            cond.Desired("Placed", "False", "Restarting", text),
            cond.Desired("Ready", "False", "Restarting", text),
            cond.Desired("Failed", "False", "WithinRestartBudget", text),
        ])

    restart_text = f"restart {restarts}/{spec.restart_policy.max_restarts}" if restarts else ""
    # 4. Backoff after a restart, and old pods still terminating: wait.
    if not_before and now < cond.parse_rfc3339(not_before) and not current:
        wait = (cond.parse_rfc3339(not_before) - now).total_seconds()
        plan.requeue_after = max(1.0, wait)
        text = f"{restart_text}: backing off until {not_before}"
        return finish("Restarting", [
            cond.Desired("Admitted", "True", admission.reason, admission.message),
            cond.Desired("Placed", "False", "BackingOff", text),
            cond.Desired("Ready", "False", "Restarting", text),
            cond.Desired("Failed", "False", "WithinRestartBudget", text),
        ])
    if (terminating or stale) and not current:
        plan.requeue_after = 2.0
        text = f"waiting for {len(terminating) + len(stale)} pods of the previous attempt to terminate"
        return finish("Restarting" if restarts else "Placing", [
            cond.Desired("Admitted", "True", admission.reason, admission.message),
            cond.Desired("Placed", "False", "WaitingForOldMembers", text),
            cond.Desired("Ready", "False", "WaitingForOldMembers", text),
            cond.Desired("Failed", "False", "WithinRestartBudget", restart_text or "no restarts"),
        ])

    # 5. Admission: without it, nothing is created (gang-scheduled Slices create
    # their members unbound and wait for the gang scheduler to bind them all).
    if not gang and not admission.admitted and not current:
        return finish("Pending", [
            cond.Desired("Admitted", "False", admission.reason, admission.message),
            cond.Desired("Placed", "False", "NotAdmitted", "waiting for admission"),
            cond.Desired("Ready", "False", "NotAdmitted", admission.message),
            cond.Desired("Failed", "False", "WithinRestartBudget", restart_text or "no restarts"),
        ])

    # 6. Create the missing members of this attempt.
    present = {p.member for p in current}
    restore_from = None
    if restarts and spec.checkpoint is not None and spec.checkpoint.restore_on_restart:
        # The store, not status.checkpoint.latest: a commit made after the operator last read the
        # leader's report is newer than that, and the workload finds the newest commit itself.
        restore_from = spec.checkpoint.store
    for member in range(spec.hosts):
        if member in present:
            continue
        node = (admission.nodes or {}).get(member)
        plan.create.append(member_pod(obj, spec, member, attempt=attempt, revision=revision, node=node,
                                      restore_from=restore_from, scheduler_name=admission.scheduler_name))
    if plan.create and restarts and restore_from:
        checkpoint = dict(checkpoint or {}) | {"restoredAt": now_s}

    ready = sum(1 for p in current if counts_ready(p))
    scheduled = sum(1 for p in current if p.node)
    unschedulable = [p for p in current if p.unschedulable]
    failed_cond = cond.Desired("Failed", "False", "WithinRestartBudget", restart_text or "no restarts")
    if gang and scheduled == 0:
        return finish("Pending", [
            cond.Desired("Admitted", "False", admission.reason, admission.message),
            cond.Desired("Placed", "False", "NotAdmitted", f"0/{spec.hosts} members bound; waiting for the gang scheduler"),
            cond.Desired("Ready", "False", admission.reason, admission.message),
            failed_cond,
        ])
    if gang and scheduled < spec.hosts:
        text = f"{scheduled}/{spec.hosts} members bound; the gang scheduler binds all members or rolls them back"
        return finish("Admitted", [
            cond.Desired("Admitted", "True", "Binding", text),
            cond.Desired("Placed", "False", "Binding", text),
            cond.Desired("Ready", "False", "Binding", text),
            failed_cond,
        ])
    if gang:
        domains = sorted({node_domains[p.node] for p in current if p.node in node_domains})
        where = f" in {spec.topology_key} {', '.join(domains)}" if domains else ""
        admission = Admission(
            admitted=True, reason="Placed",
            message=admission.message if admission.admitted else f"all {spec.hosts} members bound by the gang scheduler{where}",
            scheduler_name=admission.scheduler_name,
        )
    if scheduled == spec.hosts:
        placed = cond.Desired("Placed", "True", "AllMembersScheduled", f"all {spec.hosts} members are bound to nodes")
    elif unschedulable:
        placed = cond.Desired("Placed", "False", "Unschedulable", f"pod {unschedulable[0].name}: {unschedulable[0].unschedulable}")
    else:
        placed = cond.Desired("Placed", "False", "MembersPending", f"{scheduled}/{spec.hosts} members scheduled")
    admitted = cond.Desired("Admitted", "True", admission.reason, admission.message)
    if batch and spec.checkpoint is not None:
        plan.requeue_after = CHECKPOINT_READ_SECONDS     # read the leader's checkpoint again soon
    if ready == spec.hosts:
        return finish("Ready", [admitted, placed, cond.Desired("Ready", "True", "AllMembersReady", f"{ready}/{spec.hosts} members ready"), failed_cond])
    if phase in ("Ready", "Degraded") and not plan.create:
        not_ready = ", ".join(p.name for p in current if not counts_ready(p))
        return finish("Degraded", [
            admitted, placed,
            cond.Desired("Ready", "False", "MembersNotReady", f"{ready}/{spec.hosts} members ready; not ready: {not_ready}"),
            failed_cond,
        ])
    if not (batch and spec.checkpoint is not None):
        plan.requeue_after = None
    return finish("Placing", [
        admitted, placed,
        cond.Desired("Ready", "False", "MembersNotReady" if not unschedulable else "Unschedulable",
                     f"{ready}/{spec.hosts} members ready" + (f"; {placed.message}" if unschedulable else "")),
        failed_cond,
    ])
