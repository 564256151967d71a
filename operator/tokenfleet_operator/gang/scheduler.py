"""The gang scheduler's shell: one serialized placement pass, cluster-wide.

Member pods of gang-scheduled Slices are created unbound with ``schedulerName: tokenfleet``, so the default
scheduler leaves them alone. The operator's work queue runs a pass (``run_pass``) whenever a Slice, a member
pod, a Node or a SliceQueue changes, coalescing bursts, and at least every ``interval`` seconds. The queue
runs one pass at a time, and only the leader replica works the queue, so only one pass ever binds. Each pass

1. reads Nodes, Pods, Slices and SliceQueues from its ``ClusterView`` (``cluster_view.py``: in the operator,
   the watch cache with the pass's own binds and deletions laid over it until the watch shows them);
2. computes the plan with the pure ``plan.plan_pass``;
3. rolls back partially bound Slices, evicts preemption victims, and binds each placed Slice member by
   member through the Binding API (different Slices in parallel, ``write_concurrency`` at once; the pass waits
   for every one). If any bind fails, every member of that Slice is deleted in the same pass
   (they are made again, unbound, by the Slice controller) and it is retried in the next pass. So a Slice is
   never left partly bound past one pass, and two Slices never take the same capacity;
4. writes each Slice's decision (placed, or why it waits) to the Slice as an annotation
   (``decision.GangDecision``), only where it changed: that change is what makes the Slice controller act.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tokenfleet_operator import metrics
from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.gang.cluster_view import ClusterView, ListedCluster
from tokenfleet_operator.gang.decision import ANNOTATION, GangDecision
from tokenfleet_operator.gang.plan import Bind, PassPlan, PodRef, plan_pass
from tokenfleet_operator.kube import Kube, KubeError

log = logging.getLogger("tokenfleet.gang")

DECISION_MANAGER = "tokenfleet-gang-scheduler"
# The pass's writes (each Slice's binds, then each changed decision) go out this many at once by default. Each
# write waits on the API server, not on this process, so a pass that places hundreds of Slices is bound by
# the round trip of one request unless several are in flight. A Slice's own members are bound one after
# another, so its all-or-nothing rollback holds.
WRITE_CONCURRENCY = 8


def _slice_ref(namespace: str, name: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "Slice", "metadata": {"namespace": namespace, "name": name}}


class GangScheduler:
    def __init__(self, kube: Kube, namespaces: list[str] | None, *, interval: float = 5.0,
                 clock: Callable[[], float] = time.time,
                 before_bind: Callable[[Bind, PodRef, str], None] | None = None, view: ClusterView | None = None,
                 write_concurrency: int = WRITE_CONCURRENCY):
        self.kube = kube
        self.namespaces = namespaces
        self.view: ClusterView = view or ListedCluster(kube, namespaces)
        self.interval = interval
        self.clock = clock
        self.before_bind = before_bind  # tests use it to make a bind fail between plan and bind
        self._waiting_keys: set[tuple[str, str]] = set()   # (queue, reason) pairs exported so far
        self._queues_seen: set[str] = set()
        self._timeout_queues: set[str] = set()
        self._writers = ThreadPoolExecutor(max(1, write_concurrency), thread_name_prefix="tokenfleet-gang-write")

    def run_pass(self) -> PassPlan:
        started = time.perf_counter()
        snap = self.view.snapshot()
        nodes, pods, slices, queues = snap.nodes, snap.pods, snap.slices, snap.queues
        listed = time.perf_counter()
        plan = plan_pass(nodes, pods, slices, queues, now=self.clock())
        planned = time.perf_counter()
        by_key = {f"{s['metadata']['namespace']}/{s['metadata']['name']}": s for s in slices}
        old = {key: GangDecision.from_object(obj) for key, obj in by_key.items()}
        new: dict[str, GangDecision] = {}

        for rollback in plan.rollbacks:
            self._delete_members(rollback.namespace, rollback.pods)
            metrics.GANG_ROLLBACKS.labels(cause="partial").inc()
            self._event(rollback.namespace, rollback.name, "Warning", "GangRolledBack", rollback.reason)
        for eviction in plan.evictions:
            previous = old.get(eviction.victim)
            if previous is None or previous.preempted_by != eviction.preemptor:
                metrics.GANG_PREEMPTIONS.inc()
                self._event(eviction.namespace, eviction.name, "Warning", "Preempted",
                            f"evicting all {len(eviction.pods)} members for higher-priority Slice {eviction.preemptor}")
            self._delete_members(eviction.namespace, eviction.pods)
            new[eviction.victim] = GangDecision(False, "Preempted", f"evicted for higher-priority Slice {eviction.preemptor}",
                                                preempted_by=eviction.preemptor)
        for bind, decision in zip(plan.binds, self._writers.map(self._bind, plan.binds)):
            new[bind.slice_key] = decision
        bound = time.perf_counter()
        for key, wait in plan.waiting.items():
            decision = GangDecision(False, wait.code, wait.message, wait.requeues, wait.requeue_at)
            previous = old.get(key)
            if previous is None or previous.reason != wait.code:
                ns, name = key.split("/", 1)
                self._event(ns, name, "Normal", "Waiting", f"{wait.code}: {wait.message}")
            new.setdefault(key, decision)
        # A victim keeps its eviction decision (and its preemptor) until it queues again: then it is
        # pending, and the pass's waiting or bind decision replaces it.
        changed = [(by_key[key], decision) for key, decision in new.items() if key in by_key and decision != old.get(key)]
        list(self._writers.map(lambda change: self._write_decision(*change), changed))
        self._write_queue_status(plan, queues)
        for queue, count in plan.pending_by_queue.items():
            metrics.SLICES_PENDING.labels(queue=queue).set(count)
        for queue in {q["metadata"]["name"] for q in queues} - set(plan.pending_by_queue):
            metrics.SLICES_PENDING.labels(queue=queue).set(0)
        self._export_waiting(plan, queues)
        done = time.perf_counter()
        metrics.PLACEMENT_SECONDS.labels(stage="snapshot").observe(listed - started)
        metrics.PLACEMENT_SECONDS.labels(stage="plan").observe(planned - listed)
        metrics.PLACEMENT_SECONDS.labels(stage="bind").observe(bound - planned)
        metrics.PLACEMENT_SECONDS.labels(stage="total").observe(done - started)
        if plan.binds or plan.rollbacks or plan.evictions:
            log.info("gang pass: %d bound, %d waiting, %d rolled back, %d evicted in %.3fs",
                     len(plan.binds), len(plan.waiting), len(plan.rollbacks), len(plan.evictions), done - started)
        return plan

    def _export_waiting(self, plan: PassPlan, queues: list[dict[str, Any]]) -> None:
        """Why Slices wait, per queue and reason, and how long the longest has waited. A queue or reason
        that had waiting Slices before and has none now reads 0, not a stale count."""
        waiting: dict[tuple[str, str], int] = {}
        for wait in plan.waiting.values():
            waiting[(wait.queue, wait.code)] = waiting.get((wait.queue, wait.code), 0) + 1
        for key in self._waiting_keys - set(waiting):
            metrics.SLICES_WAITING.labels(queue=key[0], reason=key[1]).set(0)
        for (queue, reason), count in waiting.items():
            metrics.SLICES_WAITING.labels(queue=queue, reason=reason).set(count)
        self._waiting_keys |= set(waiting)
        names = {q["metadata"]["name"] for q in queues} | set(plan.pending_by_queue) | self._queues_seen
        for queue in names:
            metrics.QUEUE_OLDEST_WAIT.labels(queue=queue).set(plan.oldest_wait_by_queue.get(queue, 0.0))
        for queue in self._timeout_queues - set(plan.admission_timeouts):
            metrics.QUEUE_ADMISSION_TIMEOUT.remove(queue)
        for queue, timeout in plan.admission_timeouts.items():
            metrics.QUEUE_ADMISSION_TIMEOUT.labels(queue=queue).set(timeout)
        self._timeout_queues = set(plan.admission_timeouts)
        self._queues_seen = names

    def _bind(self, bind: Bind) -> GangDecision:
        """Bind every member, or none: on the first failure delete them all."""
        done: list[PodRef] = []
        for pod, node in bind.members:
            try:
                if self.before_bind:
                    self.before_bind(bind, pod, node)
                self.kube.bind(bind.namespace, pod.name, node, uid=pod.uid)
                self.view.bound(pod.uid, node)
                done.append(pod)
            except KubeError as e:
                self._delete_members(bind.namespace, tuple(p for p, _ in bind.members))
                metrics.GANG_BINDS.labels(result="rolled_back").inc()
                metrics.GANG_ROLLBACKS.labels(cause="bind_failed").inc()
                message = (f"binding {pod.name} to {node} failed ({e.status or 'no response'}: {str(e)[-200:]}); "
                           f"deleted all {len(bind.members)} members ({len(done)} already bound) so none holds capacity; "
                           f"the gang is placed again once they are recreated")
                self._event(bind.namespace, bind.name, "Warning", "BindFailed", message)
                return GangDecision(False, "BindFailed", message)
        metrics.GANG_BINDS.labels(result="bound").inc()
        metrics.ADMISSION_WAIT.labels(queue=bind.queue).observe(max(0.0, self.clock() - bind.queued_at))
        self._event(bind.namespace, bind.name, "Normal", "Placed", bind.message)
        return GangDecision(True, "Placed", bind.message)

    def _write_decision(self, obj: dict[str, Any], decision: GangDecision) -> None:
        meta = obj["metadata"]
        patch = {"metadata": {"annotations": {ANNOTATION: decision.to_annotation()}}}
        try:
            self.view.wrote("Slice", self.kube.patch(API_VERSION, "Slice", meta["namespace"], meta["name"], patch,
                                                     field_manager=DECISION_MANAGER))
        except KubeError as e:
            if e.status != 404:
                log.warning("could not record the gang decision on Slice %s/%s: %s", meta["namespace"], meta["name"], e)

    def _delete_members(self, namespace: str, pods: tuple[PodRef, ...]) -> None:
        for pod in pods:
            try:
                self.kube.delete("v1", "Pod", namespace, pod.name, uid=pod.uid)
                self.view.deleted(pod.uid)
            except KubeError as e:
                log.warning("could not delete %s/%s: %s", namespace, pod.name, e)

    def _event(self, namespace: str, name: str, type_: str, reason: str, message: str) -> None:
        self.kube.event(_slice_ref(namespace, name), type_, reason, message)

    def _write_queue_status(self, plan: PassPlan, queues: list[dict[str, Any]]) -> None:
        current = {q["metadata"]["name"]: q.get("status") for q in queues}
        for name, status in plan.queue_status.items():
            if current.get(name) == status:
                continue
            body = {"apiVersion": API_VERSION, "kind": "SliceQueue", "metadata": {"name": name}, "status": status}
            try:
                self.view.wrote("SliceQueue", self.kube.apply(body, subresource="status"))
            except KubeError as e:
                log.warning("could not write status of SliceQueue %s: %s", name, e)
