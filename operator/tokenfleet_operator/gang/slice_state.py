"""The Slice state machine as a pure function.

``plan_slice`` takes a Slice, the member pods that exist and the time, and returns what to do: pods to
create, pods to delete, the new status, Events, and when to look again. The reconcile only gathers the inputs
and carries out the plan, so every transition is unit-tested here.

How it is built:

1. ``observe`` digests the inputs once (``Observation``): the spec's revision, the attempt, which pods are
   current, stale or terminating, the restart bookkeeping carried in the old status.
2. The decision functions in ``RULES`` are asked in order; the first that applies returns a ``Decision``:
   the phase it leads to, the reason and message of each condition, and what to do (tear the attempt
   down, create the missing members, count a restart, look again later, Events).
3. ``CONDITIONS`` maps the phase to the status of each condition (Admitted, Placed, Ready, Failed), so one
   table says, for example, that only Ready has Ready=True and only Failed has Failed=True.
4. ``_status`` builds the new status through the API's ``SliceStatus`` model.

Gang semantics: all members or none. When a member of the current attempt fails (pod Failed, a container
restarted, or the pod vanished from a Ready gang), the whole gang is torn down and, after an exponential
backoff, made again as the next attempt, until restartPolicy.maxRestarts is spent and the Slice is Failed.
New pods are created only once the previous attempt's pods are gone (BlockingRecreate), so accelerators are
never double-booked.

A batch Slice (role: batch) ends: once every member of an attempt has exited successfully it is Succeeded
(condition Complete=True) and stays so until its spec changes. A restarted batch gang is told to resume from
its checkpoint store (TOKENFLEET_RESTORE_FROM); the checkpoint its leader reports is kept in
status.checkpoint.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.api.slice import SliceSpec, SliceStatus
from tokenfleet_operator.builders.slice_pods import member_pod
from tokenfleet_operator.naming import ATTEMPT_LABEL, MEMBER_LABEL, REVISION_LABEL, revision_of
from tokenfleet_operator.pod_failure import container_failure, exit_code
from tokenfleet_operator.policy import DENY_HOST_PATHS, OperatorPolicy
from tokenfleet_operator.validation import check_slice


class Phase(StrEnum):
    PENDING = "Pending"          # waiting for admission (gang: members exist, none bound)
    ADMITTED = "Admitted"        # gang: being bound
    PLACING = "Placing"          # members exist, not all placed or ready
    READY = "Ready"
    DEGRADED = "Degraded"        # was Ready, a member is not ready
    RESTARTING = "Restarting"    # torn down after a failure; backoff, or old pods still terminating
    FAILED = "Failed"            # restart budget spent, or a spec only a person can fix
    SUCCEEDED = "Succeeded"      # batch: every member exited successfully


class Reason(StrEnum):
    # conditions
    RESTART_BUDGET_EXHAUSTED = "RestartBudgetExhausted"
    CONFIGURATION_ERROR = "ConfigurationError"      # a member exited with one of restartPolicy.failOnExitCodes
    WITHIN_RESTART_BUDGET = "WithinRestartBudget"
    COMPLETED = "Completed"
    PREEMPTED = "Preempted"
    RESTARTING = "Restarting"
    BACKING_OFF = "BackingOff"
    WAITING_FOR_OLD_MEMBERS = "WaitingForOldMembers"
    NOT_ADMITTED = "NotAdmitted"
    BINDING = "Binding"
    PLACED = "Placed"
    ALL_MEMBERS_SCHEDULED = "AllMembersScheduled"
    UNSCHEDULABLE = "Unschedulable"
    MEMBERS_PENDING = "MembersPending"
    ALL_MEMBERS_READY = "AllMembersReady"
    MEMBERS_NOT_READY = "MembersNotReady"
    ALL_MEMBERS_SUCCEEDED = "AllMembersSucceeded"
    RUNNING = "Running"
    FAILED = "Failed"
    DEFAULT_SCHEDULER = "DefaultScheduler"
    # what failed (status.lastRestart.reason)
    MEMBER_FAILED = "MemberFailed"
    MEMBER_EXITED = "MemberExited"
    CONTAINER_RESTARTED = "ContainerRestarted"
    MEMBER_LOST = "MemberLost"
    MEMBER_DELETED = "MemberDeleted"
    # Events only
    SPEC_CHANGED = "SpecChanged"
    GANG_RESTART = "GangRestart"
    SLICE_READY = "SliceReady"


# phase -> status of (Admitted, Placed, Ready, Failed, Reconciling, Stalled); Placed None: True once every member
# is bound. Reconciling and Stalled are kstatus' (Flux, kpt): Reconciling while the operator works toward the spec
# (a finished batch Slice and a Ready one are done), Stalled when only a new spec helps (Stalled mirrors Failed).
# A finished batch Slice is Ready (reason Completed): for a GitOps tool it is where its spec wants it.
CONDITIONS: dict[Phase, tuple[bool, bool | None, bool, bool, bool, bool]] = {
    Phase.PENDING: (False, False, False, False, True, False),
    Phase.ADMITTED: (True, False, False, False, True, False),
    Phase.PLACING: (True, None, False, False, True, False),
    Phase.READY: (True, True, True, False, False, False),
    Phase.DEGRADED: (True, None, False, False, True, False),
    Phase.RESTARTING: (True, False, False, False, True, False),
    Phase.FAILED: (False, False, False, True, False, True),
    Phase.SUCCEEDED: (True, False, True, False, False, False),
}
CONDITION_TYPES = ("Admitted", "Placed", "Ready", "Failed", "Reconciling", "Stalled")


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
    exit_code: int | None = None  # of the container that failed (or exited), when one has


def _int_label(labels: dict[str, str], key: str) -> int | None:
    value = labels.get(key, "")
    return int(value) if value.isdigit() else None


def pod_view(pod: dict[str, Any]) -> PodView:
    """Summarise a Pod object (as returned by the API server)."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status") or {}
    labels = meta.get("labels") or {}
    ready = cond.is_ready(pod)
    unschedulable = None
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            unschedulable = c.get("message") or "unschedulable"
    restarts = sum(int(cs.get("restartCount", 0)) for cs in status.get("containerStatuses") or [])
    failure = status.get("reason") or status.get("message") or container_failure(status)
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
        exit_code=exit_code(status),
    )


@dataclass(frozen=True)
class Admission:
    """The placement decision for this Slice: admitted (with optional node per member) or not, with a reason.
    The default lets the scheduler place pods.

    With ``scheduler_name`` set the Slice is gang-scheduled: its member pods are created at once, unbound, for
    that scheduler, which binds all of them or none. The Slice is admitted exactly when every member is
    bound; until then ``reason``/``message`` say why it waits (the placer's reason, with numbers).
    ``preempted_by`` names the Slice this one is being evicted for: losing members to a preemption is not a
    failure and costs no restart.
    """

    admitted: bool = True
    nodes: dict[int, str] | None = None
    reason: str = Reason.DEFAULT_SCHEDULER
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
    # True when status.restarts grows: the status must be written (with a resourceVersion precondition)
    # before any pod is deleted, so a crash in between never counts one failure twice.
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


# ---- 1. observe ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Observation:
    obj: dict[str, Any]
    spec: SliceSpec
    admission: Admission
    now: dt.datetime
    node_domains: dict[str, str]
    revision: str
    old: dict[str, Any]                      # the status as it was
    phase: Phase                             # the phase as it was (Placing after a spec change)
    restarts: int
    last_restart: dict[str, Any] | None
    not_before: str | None
    checkpoint: dict[str, Any] | None
    spec_changed: bool
    current: tuple[PodView, ...]             # live pods of this revision and attempt
    stale: tuple[PodView, ...]               # live pods of another revision or attempt, or no member index
    terminating: tuple[PodView, ...]
    policy: OperatorPolicy = DENY_HOST_PATHS

    @property
    def batch(self) -> bool:
        return self.spec.role == "batch"

    @property
    def gang(self) -> bool:
        return self.admission.scheduler_name is not None

    @property
    def hosts(self) -> int:
        return self.spec.hosts

    @property
    def max_restarts(self) -> int:
        return self.spec.restart_policy.max_restarts

    def counts_ready(self, p: PodView) -> bool:
        return p.ready or (self.batch and p.phase == "Succeeded")    # a finished batch member has done its part

    @property
    def restart_text(self) -> str:
        return f"restart {self.restarts}/{self.max_restarts}" if self.restarts else ""


def observe(obj: dict[str, Any], spec: SliceSpec, pods: list[PodView], admission: Admission, now: dt.datetime,
            node_domains: dict[str, str], reported_checkpoint: dict[str, str] | None,
            policy: OperatorPolicy = DENY_HOST_PATHS) -> Observation:
    old = dict(obj.get("status") or {})
    revision = slice_revision(spec)
    restarts = int(old.get("restarts", 0))
    last_restart, not_before = old.get("lastRestart"), old.get("restartNotBefore")
    phase = Phase(old.get("phase", Phase.PENDING))
    checkpoint = old.get("checkpoint")
    if reported_checkpoint and spec.checkpoint is not None:
        checkpoint = dict(checkpoint or {}) | reported_checkpoint
    spec_changed = old.get("revision") not in (None, revision)
    if spec_changed:                         # a new spec is a new gang: fresh restart budget
        restarts, last_restart, not_before, phase = 0, None, None, Phase.PLACING
    live = [p for p in pods if not p.deleting]
    stale = [p for p in live
             if p.revision != revision or p.attempt != restarts or p.member is None or p.member >= spec.hosts]
    return Observation(
        obj=obj, spec=spec, admission=admission, now=now, node_domains=node_domains, revision=revision, old=old,
        phase=phase, restarts=restarts, last_restart=last_restart, not_before=not_before, checkpoint=checkpoint,
        spec_changed=spec_changed, current=tuple(p for p in live if p not in stale), stale=tuple(stale),
        terminating=tuple(p for p in pods if p.deleting), policy=policy,
    )


# ---- 2. decide ------------------------------------------------------------------------------------
ReasonText = tuple[str, str]


@dataclass(frozen=True)
class Restart:
    """A gang restart to count: what failed, and when the next attempt may start."""

    reason: str
    member: int | None
    message: str
    delay: int


@dataclass(frozen=True)
class Decision:
    phase: Phase
    admitted: ReasonText
    placed: ReasonText
    ready: ReasonText
    failed: ReasonText
    teardown: bool = False                   # delete every member of the current attempt
    create: bool = False                     # create the members of this attempt that are missing
    restart: Restart | None = None
    requeue_after: float | None = None
    events: tuple[Event, ...] = ()


def _all(phase: Phase, reason: str, message: str, **kw: Any) -> Decision:
    """A decision whose four conditions share one reason and message."""
    return Decision(phase, (reason, message), (reason, message), (reason, message), (reason, message), **kw)


def _within_budget(o: Observation, text: str = "") -> ReasonText:
    return Reason.WITHIN_RESTART_BUDGET, text or o.restart_text or "no restarts"


def _admission(o: Observation) -> ReasonText:
    return o.admission.reason, o.admission.message


def failed_invalid_spec(o: Observation) -> Decision | None:
    """A spec the schema cannot reject: Failed, no pods."""
    problems = check_slice(o.spec, o.policy)
    if not problems:
        return None
    p = problems[0]
    old_ready = cond.find(o.old.get("conditions"), "Ready")
    first = old_ready is None or old_ready.get("reason") != p.reason
    return _all(Phase.FAILED, p.reason, str(p), teardown=True,
                events=(Event("Warning", p.reason, str(p)),) if first else ())


# Failed reasons that hold until the spec changes (a reason failed_invalid_spec gives is looked at afresh each time).
STAY_FAILED = (Reason.RESTART_BUDGET_EXHAUSTED, Reason.CONFIGURATION_ERROR)


def failed_until_spec_changes(o: Observation) -> Decision | None:
    """The budget is spent, or a member said its configuration is wrong: stay Failed, with no pods, until the
    spec changes. (A Slice that failed a check
    ``failed_invalid_spec`` no longer makes, e.g. a host path an administrator has allowed since, goes on.)"""
    failed = cond.find(o.old.get("conditions"), "Failed") or {}
    if o.phase != Phase.FAILED or failed.get("reason", Reason.RESTART_BUDGET_EXHAUSTED) not in STAY_FAILED:
        return None
    return _all(Phase.FAILED, failed.get("reason", Reason.RESTART_BUDGET_EXHAUSTED),
                failed.get("message", "restart budget exhausted"), teardown=True)


def succeeded(o: Observation) -> Decision | None:
    """A batch job whose members all exited successfully stays finished (its pods stay, for their logs)."""
    done = [p for p in o.current if p.phase == "Succeeded"]
    finished = len({p.member for p in done}) >= o.hosts and len(o.current) == len(done)
    if not o.batch or not (o.phase == Phase.SUCCEEDED or finished):
        return None
    text = f"all {o.hosts} members exited successfully"
    events = () if o.phase == Phase.SUCCEEDED else (
        Event("Normal", Reason.COMPLETED, text + (f" after {o.restarts} gang restarts" if o.restarts else "")),)
    return _all(Phase.SUCCEEDED, Reason.COMPLETED, text, events=events)


def pending_preempted(o: Observation) -> Decision | None:
    """Evicted by the gang scheduler for a higher-priority Slice: give the capacity back, wait, queue again.
    No restart is counted: the gang did nothing wrong."""
    if not (o.gang and o.admission.preempted_by and (any(p.node for p in o.current) or o.terminating)):
        return None
    text = (f"evicted as a whole gang for higher-priority Slice {o.admission.preempted_by}; "
            "it queues again once its members are gone")
    preempted = (Reason.PREEMPTED, text)
    return Decision(Phase.PENDING, preempted, preempted, preempted, _within_budget(o), teardown=True, requeue_after=2.0)


def _failure(o: Observation) -> tuple[str, int | None, str] | None:
    """(reason, member, message) of the first member failure of the current attempt, if any. A batch member
    that exits successfully has done its part; a serving member must not exit."""
    for pod in sorted(o.current, key=lambda p: p.member or 0):
        if pod.phase == "Failed":
            permanent = pod.exit_code in o.spec.restart_policy.permanent_exit_codes
            return (Reason.CONFIGURATION_ERROR if permanent else Reason.MEMBER_FAILED, pod.member or 0,
                    f"pod {pod.name} failed: {pod.failure or 'no reason given'}")
        if pod.phase == "Succeeded" and not o.batch:
            return Reason.MEMBER_EXITED, pod.member or 0, f"pod {pod.name} exited; a serving member must keep running"
        if pod.restarts > 0:
            return Reason.CONTAINER_RESTARTED, pod.member or 0, f"a container of pod {pod.name} restarted"
    # Members missing from a running gang are lost, unless they are being replaced.
    was_running = (o.phase in (Phase.READY, Phase.DEGRADED) and not o.stale and not o.terminating
                   and not (o.gang and o.admission.preempted_by))
    if was_running:
        present = {p.member for p in o.current}
        for member in range(o.hosts):
            if member not in present:
                return Reason.MEMBER_LOST, member, f"member {member} disappeared (pod deleted, evicted or its node lost)"
    # A pod of the current attempt that is being deleted was not deleted by us (we only delete older
    # attempts): an eviction, a drain or a person. A gang that was never bound completely has not started:
    # losing a member of it (the gang scheduler's rollback, or a person) is no failure.
    deleted = [p for p in o.terminating if p.revision == o.revision and p.attempt == o.restarts and p.member is not None]
    if deleted and (not o.gang or len({p.member for p in [*o.current, *deleted] if p.node}) >= o.hosts):
        return Reason.MEMBER_DELETED, deleted[0].member, f"pod {deleted[0].name} is being deleted"
    return None


def restarting_after_failure(o: Observation) -> Decision | None:
    """A member of the current attempt failed: restart the whole gang, or give up when the budget is spent."""
    failure = _failure(o)
    if failure is None:
        return None
    reason, member, message = failure
    if reason == Reason.CONFIGURATION_ERROR:
        text = f"{message}; a configuration error, so no restart: the slice stays down until its spec changes"
        return _all(Phase.FAILED, Reason.CONFIGURATION_ERROR, text, teardown=True,
                    events=(Event("Warning", Reason.CONFIGURATION_ERROR, text),))
    if o.restarts >= o.max_restarts:
        text = f"{message}; restart budget of {o.max_restarts} spent, the slice stays down until its spec changes"
        return _all(Phase.FAILED, Reason.RESTART_BUDGET_EXHAUSTED, text, teardown=True,
                    events=(Event("Warning", Reason.RESTART_BUDGET_EXHAUSTED, text),))
    number = o.restarts + 1
    delay = backoff_seconds(o.spec, number)
    text = f"restart {number}/{o.max_restarts} after {reason}: {message}"
    event = Event("Warning", Reason.GANG_RESTART,
                  f"{message}; restarting all {o.hosts} members (restart {number} of {o.max_restarts}) in {delay}s")
    return Decision(Phase.RESTARTING, _admission(o), (Reason.RESTARTING, text), (Reason.RESTARTING, text),
                    (Reason.WITHIN_RESTART_BUDGET, text), teardown=True,
                    restart=Restart(reason, member, message, delay), requeue_after=float(delay) if delay else 1.0,
                    events=(event,))


def restarting_backoff(o: Observation) -> Decision | None:
    """After a restart, nothing is made before restartNotBefore."""
    if not (o.not_before and o.now < cond.parse_rfc3339(o.not_before) and not o.current):
        return None
    wait = (cond.parse_rfc3339(o.not_before) - o.now).total_seconds()
    text = f"{o.restart_text}: backing off until {o.not_before}"
    return Decision(Phase.RESTARTING, _admission(o), (Reason.BACKING_OFF, text), (Reason.RESTARTING, text),
                    (Reason.WITHIN_RESTART_BUDGET, text), requeue_after=max(1.0, wait))


def waiting_for_old_members(o: Observation) -> Decision | None:
    """Pods of the previous attempt (or revision) still terminate: make nothing until they are gone."""
    if not ((o.terminating or o.stale) and not o.current):
        return None
    text = f"waiting for {len(o.terminating) + len(o.stale)} pods of the previous attempt to terminate"
    waiting = (Reason.WAITING_FOR_OLD_MEMBERS, text)
    return Decision(Phase.RESTARTING if o.restarts else Phase.PLACING, _admission(o), waiting, waiting,
                    _within_budget(o), requeue_after=2.0)


def pending_not_admitted(o: Observation) -> Decision | None:
    """Without admission nothing is created (gang-scheduled Slices instead create their members unbound and
    wait for the gang scheduler to bind them all)."""
    if o.gang or o.admission.admitted or o.current:
        return None
    return Decision(Phase.PENDING, _admission(o), (Reason.NOT_ADMITTED, "waiting for admission"),
                    (Reason.NOT_ADMITTED, o.admission.message), _within_budget(o))


def running(o: Observation) -> Decision:
    """Create the missing members of this attempt; the phase follows from how many are bound and ready."""
    ready = sum(1 for p in o.current if o.counts_ready(p))
    scheduled = sum(1 for p in o.current if p.node)
    missing = len({p.member for p in o.current}) < o.hosts
    keep_reading = o.batch and o.spec.checkpoint is not None
    requeue = CHECKPOINT_READ_SECONDS if keep_reading else None     # read the leader's checkpoint again soon
    if o.gang and scheduled == 0:
        return Decision(Phase.PENDING, _admission(o),
                        (Reason.NOT_ADMITTED, f"0/{o.hosts} members bound; waiting for the gang scheduler"),
                        _admission(o), _within_budget(o), create=True)
    if o.gang and scheduled < o.hosts:
        binding = (Reason.BINDING, f"{scheduled}/{o.hosts} members bound; the gang scheduler binds all members or rolls them back")
        return Decision(Phase.ADMITTED, binding, binding, binding, _within_budget(o), create=True)
    admitted = _admission(o)
    if o.gang:
        domains = sorted({o.node_domains[p.node] for p in o.current if p.node in o.node_domains})
        where = f" in {o.spec.topology_key} {', '.join(domains)}" if domains else ""
        admitted = (Reason.PLACED, o.admission.message if o.admission.admitted
                    else f"all {o.hosts} members bound by the gang scheduler{where}")
    unschedulable = [p for p in o.current if p.unschedulable]
    if scheduled == o.hosts:
        placed: ReasonText = (Reason.ALL_MEMBERS_SCHEDULED, f"all {o.hosts} members are bound to nodes")
    elif unschedulable:
        placed = (Reason.UNSCHEDULABLE, f"pod {unschedulable[0].name}: {unschedulable[0].unschedulable}")
    else:
        placed = (Reason.MEMBERS_PENDING, f"{scheduled}/{o.hosts} members scheduled")
    if ready == o.hosts:
        return Decision(Phase.READY, admitted, placed, (Reason.ALL_MEMBERS_READY, f"{ready}/{o.hosts} members ready"),
                        _within_budget(o), create=True, requeue_after=requeue)
    if o.phase in (Phase.READY, Phase.DEGRADED) and not missing:
        not_ready = ", ".join(p.name for p in o.current if not o.counts_ready(p))
        return Decision(Phase.DEGRADED, admitted, placed,
                        (Reason.MEMBERS_NOT_READY, f"{ready}/{o.hosts} members ready; not ready: {not_ready}"),
                        _within_budget(o), create=True, requeue_after=requeue)
    ready_text = f"{ready}/{o.hosts} members ready" + (f"; {placed[1]}" if unschedulable else "")
    return Decision(Phase.PLACING, admitted, placed,
                    (Reason.UNSCHEDULABLE if unschedulable else Reason.MEMBERS_NOT_READY, ready_text),
                    _within_budget(o), create=True, requeue_after=requeue)


RULES: tuple[Callable[[Observation], Decision | None], ...] = (
    failed_invalid_spec,
    failed_until_spec_changes,
    succeeded,
    pending_preempted,
    restarting_after_failure,
    restarting_backoff,
    waiting_for_old_members,
    pending_not_admitted,
)


def decide(o: Observation) -> Decision:
    for rule in RULES:
        decision = rule(o)
        if decision is not None:
            return decision
    return running(o)


# ---- 3. the plan and the status ---------------------------------------------------------------------
def _admission_status(old: dict[str, Any] | None, phase: Phase, scheduled: int, hosts: int,
                      admission: Admission, now: dt.datetime) -> dict[str, Any] | None:
    """status.admission of a gang-scheduled Slice.

    queuedAt is set when an attempt starts waiting (and again when an admitted gang waits again: a restart or
    a preemption); admittedAt and waitSeconds once every member is bound. Nothing changes between those
    points, so a waiting Slice's status does not churn."""
    adm = dict(old or {})
    if phase in (Phase.RESTARTING, Phase.FAILED):
        return None
    if not adm.get("queuedAt") or (adm.get("admittedAt") and phase == Phase.PENDING):
        adm = {"queuedAt": cond.now_rfc3339(now)}
    if scheduled >= hosts and not adm.get("admittedAt"):
        adm["admittedAt"] = cond.now_rfc3339(now)
        adm["waitSeconds"] = max(0, int((now - cond.parse_rfc3339(adm["queuedAt"])).total_seconds()))
    if phase == Phase.PENDING and admission.requeues:
        adm["requeues"] = admission.requeues
        if admission.requeue_at:
            adm["requeueAt"] = admission.requeue_at
        else:
            adm.pop("requeueAt", None)
    elif phase != Phase.PENDING:
        adm.pop("requeueAt", None)
    return adm


def _conditions(o: Observation, d: Decision, current: list[PodView]) -> list[cond.Desired]:
    statuses = CONDITIONS[d.phase]
    all_bound = len({p.member for p in current if p.node}) >= o.hosts
    texts = (d.admitted, d.placed, d.ready, d.failed, d.ready, d.failed)   # Reconciling says what Ready says
    desired = []
    for type_, status, (reason, message) in zip(CONDITION_TYPES, statuses, texts):
        holds = all_bound if status is None else status
        desired.append(cond.Desired(type_, "True" if holds else "False", reason, message))
    if o.batch:
        if d.phase == Phase.SUCCEEDED:
            desired.append(cond.Desired("Complete", "True", Reason.ALL_MEMBERS_SUCCEEDED,
                                        f"all {o.hosts} members exited successfully"))
        else:
            finished = sum(1 for p in current if p.phase == "Succeeded")
            desired.append(cond.Desired("Complete", "False", Reason.FAILED if d.phase == Phase.FAILED else Reason.RUNNING,
                                        f"{finished}/{o.hosts} members finished"))
    return desired


def _status(o: Observation, d: Decision, current: list[PodView], restarts: int, last_restart: dict[str, Any] | None,
            not_before: str | None, checkpoint: dict[str, Any] | None) -> dict[str, Any]:
    generation = o.obj["metadata"].get("generation")
    members: dict[str, Any] = {
        "desired": o.hosts,
        "scheduled": sum(1 for p in current if p.node),
        "ready": sum(1 for p in current if o.counts_ready(p)),
    }
    if o.batch:
        members["succeeded"] = sum(1 for p in current if p.phase == "Succeeded")
    placement = [
        {"member": p.member, "pod": p.name, "node": p.node,
         "domain": o.node_domains.get(p.node) if p.node else None}
        for p in sorted(current, key=lambda p: p.member or 0)
    ]
    conditions = cond.merge(o.old.get("conditions") or [], _conditions(o, d, current), now=cond.now_rfc3339(o.now),
                            generation=generation)
    status = SliceStatus.model_validate({
        "phase": d.phase.value,
        "members": members,
        "placement": placement or None,
        "admission": (_admission_status(o.old.get("admission"), d.phase, members["scheduled"], o.hosts, o.admission, o.now)
                      if o.gang else None),
        "restarts": restarts,
        "lastRestart": last_restart or None,
        "restartNotBefore": not_before or None,
        "revision": o.revision,
        "checkpoint": checkpoint or None,
        "observedGeneration": generation,
        "conditions": conditions,
    })
    return status.to_wire()


def plan_slice(
    obj: dict[str, Any],
    spec: SliceSpec,
    pods: list[PodView],
    *,
    now: dt.datetime,
    admission: Admission | None = None,
    node_domains: dict[str, str] | None = None,
    reported_checkpoint: dict[str, str] | None = None,
    policy: OperatorPolicy = DENY_HOST_PATHS,
) -> SlicePlan:
    """``reported_checkpoint``: {latest, savedAt} as the leader member reports it, if it was read; ``policy``:
    what a cluster administrator allows (host paths)."""
    o = observe(obj, spec, pods, admission or Admission(), now, node_domains or {}, reported_checkpoint, policy)
    d = decide(o)
    plan = SlicePlan(requeue_after=d.requeue_after)
    if o.spec_changed:
        plan.events.append(Event("Normal", Reason.SPEC_CHANGED,
                                 f"spec changed (revision {o.revision}); recreating all {o.hosts} members"))
    plan.events.extend(d.events)
    plan.delete.extend(p.name for p in o.stale)
    current = list(o.current)
    if d.teardown:
        plan.delete.extend(p.name for p in current)
        current = []
    restarts, last_restart, not_before, checkpoint = o.restarts, o.last_restart, o.not_before, o.checkpoint
    if d.restart is not None:
        restarts += 1
        now_s = cond.now_rfc3339(now)
        last_restart = {"time": now_s, "reason": d.restart.reason, "member": d.restart.member, "message": d.restart.message}
        not_before = cond.now_rfc3339(now + dt.timedelta(seconds=d.restart.delay))
        if spec.checkpoint is not None and spec.checkpoint.restore_on_restart:
            checkpoint = dict(checkpoint or {})
        plan.counts_restart = True
    if d.create:
        plan.create.extend(_missing_members(o))
        if plan.create and o.restarts and spec.checkpoint is not None and spec.checkpoint.restore_on_restart:
            checkpoint = dict(checkpoint or {}) | {"restoredAt": cond.now_rfc3339(now)}
    plan.status = _status(o, d, current, restarts, last_restart, not_before, checkpoint)
    for t in cond.transitions(o.old.get("conditions") or [], plan.status["conditions"]):
        if t.type == "Ready" and t.new_status == "True" and d.phase == Phase.READY:
            plan.events.append(Event("Normal", Reason.SLICE_READY, f"all {o.hosts} members are ready"))
    return plan


def _missing_members(o: Observation) -> list[dict[str, Any]]:
    present = {p.member for p in o.current}
    # A restarted gang resumes from the store, not status.checkpoint.latest: a commit made after the
    # operator last read the leader's report is newer than that, and the workload finds the newest itself.
    restore_from = (o.spec.checkpoint.store if o.restarts and o.spec.checkpoint is not None
                    and o.spec.checkpoint.restore_on_restart else None)
    return [member_pod(o.obj, o.spec, member, attempt=o.restarts, revision=o.revision,
                       node=(o.admission.nodes or {}).get(member), restore_from=restore_from,
                       scheduler_name=o.admission.scheduler_name)
            for member in range(o.hosts) if member not in present]
