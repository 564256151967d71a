"""The gang scheduler: one serialized placement pass at a time, cluster-wide.

Member pods of gang-scheduled Slices are created unbound with
``schedulerName: tokenfleet``, so the default scheduler leaves them alone. A
single thread runs passes, one after another; events (Slice and member-pod
changes) ask for a pass, and a burst of them is coalesced into one. Each pass

1. lists Nodes, all Pods, the Slices served and the SliceQueues (fresh,
   quorum reads: the binds of the previous pass are always visible, so no
   "assumed" state has to be kept between passes);
2. computes the plan with the pure ``gang_pass.plan_pass``;
3. rolls back partially bound Slices, evicts preemption victims, and binds
   each placed Slice member by member through the Binding API. If any bind
   fails, every member of that Slice is deleted in the same pass (they are
   made again, unbound, by the Slice controller) and it is retried in the
   next pass. So a Slice is never left partly bound past one pass, and since
   only this thread binds, two Slices never take the same capacity.

The outcome of each Slice (placed, or why it waits) is kept in memory and
read by the Slice controller through :meth:`GangScheduler.admission`, which
is the only writer of Slice status; the scheduler asks it to look again when
the outcome changes. An operator restart loses nothing that matters: the
next pass recomputes every outcome from the cluster.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from tokenfleet_operator import metrics
from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.api.slice import SliceSpec
from tokenfleet_operator.gang_pass import PENDING, SCHEDULER_NAME, Bind, PassPlan, PodRef, plan_pass
from tokenfleet_operator.kube import Kube, KubeError
from tokenfleet_operator.slice_state import Admission, PodView

log = logging.getLogger("tokenfleet.gang")


@dataclass(frozen=True)
class Outcome:
    """The scheduler's last word on one Slice."""

    placed: bool
    code: str
    message: str
    requeues: int = 0
    requeue_at: str | None = None


def _slice_ref(namespace: str, name: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "Slice", "metadata": {"namespace": namespace, "name": name}}


class GangScheduler:
    def __init__(self, kube: Kube, namespaces: list[str] | None, *,
                 on_change: Callable[[str, str], None] = lambda ns, name: None,
                 interval: float = 5.0, debounce: float = 0.05,
                 clock: Callable[[], float] = time.time,
                 before_bind: Callable[[Bind, PodRef, str], None] | None = None):
        self.kube = kube
        self.namespaces = namespaces
        self.on_change = on_change
        self.interval = interval
        self.debounce = debounce
        self.clock = clock
        self.before_bind = before_bind  # tests use it to make a bind fail between plan and bind
        self.outcomes: dict[str, Outcome] = {}
        self.preempted: dict[str, str] = {}  # victim key -> preemptor key, until the victim queues again
        self._queue_status: dict[str, dict[str, Any]] = {}
        self._pending_queues: set[str] = set()
        self._wake = threading.Condition()
        self._poked = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pass_lock = threading.Lock()

    # ------------------------------------------------------------ the hook
    def admission(self, obj: dict[str, Any], spec: SliceSpec, pods: list[PodView]) -> Admission:
        """The Slice controller's admission hook (handlers.slice.AdmitFn)."""
        if spec.accelerator.type == "cpu":
            return Admission()  # nothing to gang-schedule: the default scheduler places cpu members
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        preempted_by = self.preempted.get(key)
        outcome = self.outcomes.get(key)
        live = [p for p in pods if not p.deleting]
        if outcome and outcome.placed and len(live) == spec.hosts and all(p.node for p in live):
            return Admission(True, reason="Placed", message=outcome.message, scheduler_name=SCHEDULER_NAME)
        if outcome and not outcome.placed:
            return Admission(False, reason=outcome.code, message=outcome.message, scheduler_name=SCHEDULER_NAME,
                             preempted_by=preempted_by, requeues=outcome.requeues, requeue_at=outcome.requeue_at)
        return Admission(False, reason="Queued", message="waiting for the gang scheduler's next pass",
                         scheduler_name=SCHEDULER_NAME, preempted_by=preempted_by)

    # ------------------------------------------------------------ the loop
    def poke(self) -> None:
        """Ask for a pass soon (events call this; bursts are coalesced)."""
        with self._wake:
            self._poked = True
            self._wake.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tokenfleet-gang-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.poke()
        if self._thread:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                if not self._poked:
                    self._wake.wait(timeout=self.interval)
            if self._stop.is_set():
                return
            time.sleep(self.debounce)  # let a burst of events settle into one pass
            with self._wake:
                self._poked = False
            try:
                self.run_pass()
            except KubeError as e:
                log.warning("gang scheduler pass failed: %s", e)
                time.sleep(1.0)
            except Exception:
                log.exception("gang scheduler pass failed")
                time.sleep(1.0)

    # ------------------------------------------------------------ one pass
    def _snapshot(self) -> tuple[list, list, list, list]:
        nodes = self.kube.list_cluster("v1", "Node")
        pods = self.kube.list_cluster("v1", "Pod", field_selector="status.phase!=Succeeded,status.phase!=Failed")
        if self.namespaces:
            slices = [s for ns in self.namespaces for s in self.kube.list(API_VERSION, "Slice", ns)]
        else:
            slices = self.kube.list_cluster(API_VERSION, "Slice")
        try:
            queues = self.kube.list_cluster(API_VERSION, "SliceQueue")
        except KubeError as e:
            if e.status != 404:
                raise
            queues = []  # the SliceQueue CRD is not installed: only the implicit 'default' queue exists
        return nodes, pods, slices, queues

    def run_pass(self) -> PassPlan:
        with self._pass_lock:
            started = time.perf_counter()
            nodes, pods, slices, queues = self._snapshot()
            listed = time.perf_counter()
            plan = plan_pass(nodes, pods, slices, queues, now=self.clock())
            planned = time.perf_counter()
            changed: set[str] = set()
            for rollback in plan.rollbacks:
                self._delete_members(rollback.namespace, rollback.pods)
                metrics.GANG_ROLLBACKS.labels(cause="partial").inc()
                self._event(rollback.namespace, rollback.name, "Warning", "GangRolledBack", rollback.reason)
                changed.add(rollback.slice_key)
            for eviction in plan.evictions:
                if self.preempted.get(eviction.victim) != eviction.preemptor:
                    metrics.GANG_PREEMPTIONS.inc()
                    self._event(eviction.namespace, eviction.name, "Warning", "Preempted",
                                f"evicting all {len(eviction.pods)} members for higher-priority Slice {eviction.preemptor}")
                self.preempted[eviction.victim] = eviction.preemptor
                self._delete_members(eviction.namespace, eviction.pods)
                changed.add(eviction.victim)
            # The plan gives every Slice disjoint capacity, so Slices are bound in
            # parallel (each one member by member, rolled back on any failure).
            if len(plan.binds) == 1:
                self._bind(plan.binds[0], changed)
            elif plan.binds:
                with ThreadPoolExecutor(max_workers=min(8, len(plan.binds)), thread_name_prefix="tokenfleet-bind") as pool:
                    list(pool.map(lambda b: self._bind(b, changed), plan.binds))
            bound = time.perf_counter()
            for key, wait in plan.waiting.items():
                outcome = Outcome(False, wait.code, wait.message, wait.requeues, wait.requeue_at)
                if self.outcomes.get(key) != outcome:
                    if (self.outcomes.get(key) or Outcome(False, "", "")).code != wait.code:
                        ns, name = key.split("/", 1)
                        self._event(ns, name, "Normal", "Waiting", f"{wait.code}: {wait.message}")
                    self.outcomes[key] = outcome
                    changed.add(key)
            for key, state in plan.states.items():
                if state == PENDING and key in self.preempted and key not in {e.victim for e in plan.evictions}:
                    del self.preempted[key]  # the victim is queued again
                    changed.add(key)
            for key in list(self.outcomes):
                if key not in plan.states:
                    del self.outcomes[key]
            for key in list(self.preempted):
                if key not in plan.states:
                    del self.preempted[key]
            self._write_queue_status(plan)
            for queue in set(plan.pending_by_queue) | self._pending_queues:
                metrics.SLICES_PENDING.labels(queue=queue).set(plan.pending_by_queue.get(queue, 0))
            self._pending_queues = set(plan.pending_by_queue)
            for key in sorted(changed):
                ns, name = key.split("/", 1)
                self.on_change(ns, name)
            done = time.perf_counter()
            metrics.PLACEMENT_SECONDS.labels(stage="snapshot").observe(listed - started)
            metrics.PLACEMENT_SECONDS.labels(stage="plan").observe(planned - listed)
            metrics.PLACEMENT_SECONDS.labels(stage="bind").observe(bound - planned)
            metrics.PLACEMENT_SECONDS.labels(stage="total").observe(done - started)
            if plan.binds or plan.rollbacks or plan.evictions:
                log.info("gang pass: %d bound, %d waiting, %d rolled back, %d evicted in %.3fs",
                         len(plan.binds), len(plan.waiting), len(plan.rollbacks), len(plan.evictions), done - started)
            return plan

    def _bind(self, bind: Bind, changed: set[str]) -> bool:
        """Bind every member, or none: on the first failure delete them all."""
        done: list[PodRef] = []
        for pod, node in bind.members:
            try:
                if self.before_bind:
                    self.before_bind(bind, pod, node)
                self.kube.bind(bind.namespace, pod.name, node, uid=pod.uid)
                done.append(pod)
            except KubeError as e:
                self._delete_members(bind.namespace, tuple(p for p, _ in bind.members))
                metrics.GANG_BINDS.labels(result="rolled_back").inc()
                metrics.GANG_ROLLBACKS.labels(cause="bind_failed").inc()
                message = (f"binding {pod.name} to {node} failed ({e.status or 'no response'}: {str(e)[-200:]}); "
                           f"deleted all {len(bind.members)} members ({len(done)} already bound) so none holds capacity; "
                           f"the gang is placed again once they are recreated")
                self.outcomes[bind.slice_key] = Outcome(False, "BindFailed", message)
                self._event(bind.namespace, bind.name, "Warning", "BindFailed", message)
                changed.add(bind.slice_key)
                self.poke()
                return False
        metrics.GANG_BINDS.labels(result="bound").inc()
        metrics.ADMISSION_WAIT.labels(queue=bind.queue).observe(max(0.0, self.clock() - bind.queued_at))
        self.outcomes[bind.slice_key] = Outcome(True, "Placed", bind.message)
        self._event(bind.namespace, bind.name, "Normal", "Placed", bind.message)
        changed.add(bind.slice_key)
        return True

    def _delete_members(self, namespace: str, pods: tuple[PodRef, ...]) -> None:
        for pod in pods:
            try:
                self.kube.delete("v1", "Pod", namespace, pod.name, uid=pod.uid)
            except KubeError as e:
                log.warning("could not delete %s/%s: %s", namespace, pod.name, e)

    def _event(self, namespace: str, name: str, type_: str, reason: str, message: str) -> None:
        obj = _slice_ref(namespace, name)
        self.kube.event(obj, type_, reason, message)

    def _write_queue_status(self, plan: PassPlan) -> None:
        for name, status in plan.queue_status.items():
            if self._queue_status.get(name) == status:
                continue
            body = {"apiVersion": API_VERSION, "kind": "SliceQueue", "metadata": {"name": name}, "status": status}
            try:
                self.kube.apply(body, subresource="status")
                self._queue_status[name] = status
            except KubeError as e:
                log.warning("could not write status of SliceQueue %s: %s", name, e)
