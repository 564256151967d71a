"""The operator's one concurrency model: Kopf watches feed a cache and one work queue; worker threads drain it.

    Kopf watch events (asyncio)  ──observe──▶  ObjectCache  (what the cluster looks like)
                                     │
                                     └──triggers──▶  WorkQueue of keys  ──▶  workers ──▶  reconcilers
                                                      ▲  (dedup, one key at a time,          │
                                                      │   delays, backoff)                   ▼
                                              requeues, periodic passes               Kube (writes) ──▶ cache

- Every reconcile is keyed by ``(kind, namespace, name)``; the gang scheduler's pass is one more key.
  The queue coalesces triggers and never runs one key on two workers at once, so reconciles of one object
  are sequential without any lock of ours.
- Periodic work is a delayed key: the resync (every ``resync_seconds``), the gang pass (every
  ``gang_interval``), a reconcile's "look again in N s". A periodic gang pass runs only while a gang Slice
  waits for it (``gang/waiting.py``) or once every ``GANG_FULL_PASS_SECONDS``; a watch event that changes
  what placement reads always gets one.
- A write's result goes into the cache at once; its watch event, when it comes back, does not queue the
  key that wrote it again (the write is remembered by resourceVersion).
- A resync of a key whose last pass read nothing that has changed since, and that nothing asked for since,
  is skipped (``reads.py``); the reconcile metrics count it as ``result="unchanged"``.
- Only the leader (``leader.py``) works the queue and runs the collector; a standby keeps its cache warm
  and starts with a full resync the moment it takes over.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenfleet_operator import metrics
from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.autoscale.memory import ServiceMemory
from tokenfleet_operator.controller.cache import ObjectCache
from tokenfleet_operator.controller.collector import Collector
from tokenfleet_operator.controller.errors import InvalidSpec, RetryLater
from tokenfleet_operator.controller.reads import Check, Fingerprint, RecordingCache, RecordingCollector
from tokenfleet_operator.controller.route_triggers import routes_naming
from tokenfleet_operator.controller.triggers import (
    GANG_PASS,
    PLACEMENT_FILTERED,
    RESYNC,
    Key,
    changes_placement,
    is_gang_slice,
    pvc_claims,
    triggers,
)
from tokenfleet_operator.controller.workqueue import WorkQueue
from tokenfleet_operator.gang.waiting import gang_work_waiting
from tokenfleet_operator.kube import Kube, KubeError
from tokenfleet_operator.naming import MANAGED_BY, MANAGED_BY_LABEL, SERVICE_LABEL, SLICE_LABEL

log = logging.getLogger("tokenfleet.manager")

# What the operator watches and caches: (kind, apiVersion, plural, label selector: "key" or "key=value", or None).
WATCHED: tuple[tuple[str, str, str, str | None], ...] = (
    ("InferenceService", API_VERSION, "inferenceservices", None),
    ("Slice", API_VERSION, "slices", None),
    ("SliceQueue", API_VERSION, "slicequeues", None),
    ("TokenRoute", API_VERSION, "tokenroutes", None),
    ("Pod", "v1", "pods", f"{MANAGED_BY_LABEL}={MANAGED_BY}"),     # Slice members and router pods
    ("Deployment", "apps/v1", "deployments", SERVICE_LABEL),
    ("ConfigMap", "v1", "configmaps", SERVICE_LABEL),
    ("Service", "v1", "services", f"{MANAGED_BY_LABEL}={MANAGED_BY}"),   # a service's and a Slice's
    ("NetworkPolicy", "networking.k8s.io/v1", "networkpolicies", SERVICE_LABEL),
    ("PodDisruptionBudget", "policy/v1", "poddisruptionbudgets", SERVICE_LABEL),
    ("Node", "v1", "nodes", None),
    ("PersistentVolumeClaim", "v1", "persistentvolumeclaims", None),
)
CLUSTER_SCOPED = {"SliceQueue", "Node"}

# A new leader lists everything again this soon after its first list (the watches may have started after it).
FIRST_RELIST_SECONDS = 5.0
# A periodic gang pass with nothing waiting is skipped (gang/waiting.py); a full one runs at least this often.
GANG_FULL_PASS_SECONDS = 60.0

# A gang pass starts no sooner after the last one than GANG_GAP_FACTOR times what that one spent computing,
# up to GANG_MAX_GAP_SECONDS: during a burst, passes take at most a fifth of the operator's CPU.
GANG_GAP_FACTOR = 4.0
GANG_MAX_GAP_SECONDS = 5.0

# kind -> labels its cached objects are indexed by
CACHE_INDEXES = {
    "Slice": (SERVICE_LABEL,),
    "Pod": (SLICE_LABEL, SERVICE_LABEL),
    "Deployment": (SERVICE_LABEL,),
    "ConfigMap": (SERVICE_LABEL,),
    "Service": (SERVICE_LABEL, SLICE_LABEL),
    "NetworkPolicy": (SERVICE_LABEL,),
    "PodDisruptionBudget": (SERVICE_LABEL,),
}


@dataclass
class Context:
    """What a reconcile works with: the cache to read, the API to write (writes land in the cache at once),
    the collector's readings, and the key being reconciled."""

    kube: Kube
    cache: ObjectCache
    collector: Collector
    key: Key
    gang_scheduling: bool
    _note_write: Callable[[str, dict[str, Any], Key, dict[str, Any] | None], None]
    _again: Callable[[Key], None]
    memory: ServiceMemory = field(default_factory=ServiceMemory)   # this key's memory across passes (leader only)
    checks: list[Check] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic

    def recheck(self, seconds: float, still: Callable[[], bool]) -> None:
        """This pass asked something that is not in the cache (``still`` asks it again and says whether the
        answer is the same): until ``seconds`` from now an unchanged resync may be skipped, then it is asked
        again (``controller/reads.py``)."""
        self.checks.append(Check(self.clock() + seconds, seconds, still))

    def _wrote(self, kind: str, obj: dict[str, Any] | None, before: dict[str, Any] | None, part: str) -> dict[str, Any] | None:
        """Store what a write returned and remember it as this key's own write, whose watch event is no news
        to this key. If it shows that someone else changed the object since the cache last saw it, that is
        news the watch will not bring any more (its event is older than what is cached now): run again."""
        if obj:
            obj.setdefault("kind", kind)
            self.cache.store(kind, obj)
            self._note_write(kind, obj, self.key, before)
            if before is not None and not _untouched_by_others(before, obj, part):
                self._again(self.key)
        return obj

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        before = self.cache.get(manifest["kind"], manifest["metadata"].get("namespace"), manifest["metadata"]["name"])
        out = self._wrote(manifest["kind"], self.kube.apply(manifest), before, "spec")
        assert out is not None
        return out

    def apply_status(self, obj: dict[str, Any], status: dict[str, Any], *, resource_version: str | None = None) -> None:
        before = self.cache.get(obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        self._wrote(obj["kind"], self.kube.apply_status(obj, status, resource_version=resource_version), before, "status")

    def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        return self._wrote(manifest["kind"], self.kube.create(manifest), None, "spec")

    def delete(self, api_version: str, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        return self.kube.delete(api_version, kind, namespace, name, uid=uid)

    def event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.kube.event(obj, type_, reason, message)


Reconciler = Callable[[Context, str, str], float | None]


def _untouched_by_others(before: dict[str, Any], after: dict[str, Any], part: str) -> bool:
    """Whether the object a write returned differs from the cached one only in the part that was written:
    ``status`` (a status write), or everything but status (an apply of a child's spec)."""
    def others(o: dict[str, Any]) -> Any:
        meta = o.get("metadata") or {}
        if part == "status":
            return (o.get("spec"), o.get("data"), meta.get("labels"), meta.get("annotations"),
                    meta.get("deletionTimestamp"), meta.get("generation"))
        return (o.get("status"), meta.get("deletionTimestamp"))
    return bool(others(before) == others(after))


class Manager:
    def __init__(self, kube: Kube, reconcilers: dict[str, Reconciler], *, gang_pass: Callable[[], float] | None,
                 namespaces: list[str] | None = None, workers: int = 4, resync_seconds: float = 300.0,
                 collector_period: float = 10.0, gang_interval: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.namespaces = namespaces
        self.reconcilers = reconcilers
        self.gang_pass = gang_pass
        self.resync_seconds = resync_seconds
        self.gang_interval = gang_interval
        self.clock = clock
        self._gang_news = True               # the first pass of a leader is a full one
        self._last_full_pass: float | None = None
        self._gang_ready_at = float("-inf")   # no gang pass starts before this (clock)
        self.cache = ObjectCache(CACHE_INDEXES)
        self.queue = WorkQueue("reconcile", on_wait=lambda name, s: metrics.QUEUE_WAIT.observe(s), first=(GANG_PASS,))
        self.collector = Collector(self.cache, on_change=self._measured, period=collector_period)
        self.leading = threading.Event()
        self._workers = workers
        self._threads: list[threading.Thread] = []
        self._writes_lock = threading.Lock()
        # (kind, namespace, name) -> (resourceVersion, the writer's key, whether the write moved what placement reads)
        self._own_writes: dict[tuple[str, str | None, str], tuple[int, Key, bool]] = {}
        self._memory: dict[Key, ServiceMemory] = {}
        self._asked_lock = threading.Lock()
        self._asked: dict[Key, int] = {}           # key -> how many times something asked for it
        self._fingerprints: dict[Key, tuple[int, Fingerprint]] = {}
        self.triggers_seen = 0

    # ---- from the watches ---------------------------------------------------------------
    def observe(self, kind: str, event_type: str | None, obj: dict[str, Any]) -> None:
        """One watch event (Kopf's): update the cache, queue what it asks for."""
        old = None
        if kind in PLACEMENT_FILTERED and event_type != "DELETED":
            meta = obj.get("metadata") or {}
            old = self.cache.get(kind, meta.get("namespace"), meta.get("name", ""))
            if old is not None and (old.get("metadata") or {}).get("resourceVersion") == meta.get("resourceVersion"):
                old = None       # the echo of an own write, stored before its event: the write noted what it moved
        changed = self.cache.observe(kind, event_type, obj)
        # The echo of a write is no change to the cache (the write's result is stored at once), but it is news
        # to every key the event concerns except the writer: a Slice an InferenceService created must be
        # reconciled itself, and a Slice's status write must reach its InferenceService.
        writer, moved = self._writer_of(kind, obj, forget=True)
        if not changed and writer is None:
            return
        if kind == "Slice" and event_type != "DELETED" and (obj.get("spec") or {}).get("role") == "batch" \
                and (obj.get("spec") or {}).get("checkpoint") and self.leading.is_set():
            meta = obj["metadata"]
            self.collector.track(("Slice", meta["namespace"], meta["name"]))
        if not self.leading.is_set():
            return                       # a standby keeps its cache; the leader it becomes resyncs everything
        keys = triggers(kind, obj) + routes_naming(self.cache, kind, obj)
        if kind == "PersistentVolumeClaim":
            ns, claim = obj["metadata"]["namespace"], obj["metadata"]["name"]
            keys = [("InferenceService", ns, s["metadata"]["name"]) for s in self.cache.list("InferenceService", ns)
                    if claim in pvc_claims(s)]
        if kind == "Slice" and event_type == "DELETED" and is_gang_slice(obj):
            keys = [k for k in keys if k[0] != "Slice"]
        for key in keys:
            if key == writer:
                continue                 # the echo of a key's own write: nothing new for it
            if key == GANG_PASS and event_type != "DELETED" and not (
                    moved if writer is not None else changes_placement(kind, old, obj)):
                continue                 # a heartbeat, a pod's readiness, a Slice's Ready condition: nothing placement reads
            self.triggers_seen += 1
            metrics.TRIGGERS.labels(kind=key[0]).inc()
            if key == GANG_PASS:
                self._gang_news = True
                self.queue.add_after(key, 0.05)     # let a burst of member-pod events settle into one pass
            else:
                self._ask(key)

    def store_own(self, kind: str, obj: dict[str, Any], writer: Key) -> None:
        """What a write outside a reconcile's Context returned (the gang pass's decisions): into the cache at
        once, and remembered as ``writer``'s own, so its watch event queues every other key it concerns."""
        meta = obj.get("metadata") or {}
        before = self.cache.get(kind, meta.get("namespace"), meta.get("name", ""))
        self.cache.store(kind, obj)
        self._note_write(kind, obj, writer, before)

    def _ask(self, key: Key) -> None:
        """Queue a key because something may have changed for it: its next pass runs in full."""
        with self._asked_lock:
            self._asked[key] = self._asked.get(key, 0) + 1
            self._fingerprints.pop(key, None)
        self.queue.add(key)

    def _times_asked(self, key: Key) -> int:
        with self._asked_lock:
            return self._asked.get(key, 0)

    def _note_write(self, kind: str, obj: dict[str, Any], writer: Key, before: dict[str, Any] | None = None) -> None:
        """Remember a write by ``writer``; ``before``: the object as cached before it (None: a new one), to
        tell whether the write changed anything the gang pass reads, which its echo then reports."""
        meta = obj.get("metadata") or {}
        try:
            rv = int(meta.get("resourceVersion"))
        except (TypeError, ValueError):
            return
        moved = changes_placement(kind, before, obj)
        with self._writes_lock:
            self._own_writes[(kind, meta.get("namespace"), meta.get("name", ""))] = (rv, writer, moved)

    def _writer_of(self, kind: str, obj: dict[str, Any], *, forget: bool = False) -> tuple[Key | None, bool]:
        """The key whose own write this event reports, if it does, and whether that write moved what the gang
        pass reads (``forget``: and this was its echo, which comes once: a later event of the same
        resourceVersion, as after a relist, is no news to anyone)."""
        meta = obj.get("metadata") or {}
        name = (kind, meta.get("namespace"), meta.get("name", ""))
        with self._writes_lock:
            written = self._own_writes.get(name)
            if written is None:
                return None, True
            try:
                echo = int(meta.get("resourceVersion")) == written[0]
            except (TypeError, ValueError):
                return None, True
            if echo and forget:
                del self._own_writes[name]
        return (written[1], written[2]) if echo else (None, True)

    def _measured(self, key: Key) -> None:
        """The collector read a new value: the owner's status should show it."""
        if self.leading.is_set():
            self._ask(key)

    # ---- leadership -----------------------------------------------------------------------
    def prime(self) -> bool:
        """List every watched kind into the cache (quorum reads), so the first passes of a new leader see the
        whole cluster, not whatever part of it the watches have delivered so far; the list replaces what the
        cache holds (``ObjectCache.replace``). Returns whether the cache changed."""
        changed = False
        for kind, api_version, _, label in WATCHED:
            selector = label  # "key" alone selects objects that have the label
            scope = None if kind in CLUSTER_SCOPED else self.namespaces
            try:
                listings = [self.kube.listing(api_version, kind, ns, label_selector=selector)
                            for ns in (scope or [None])]
            except KubeError as e:
                if e.status == 404 and kind in ("SliceQueue", "TokenRoute"):
                    continue      # the SliceQueue and TokenRoute CRDs are optional
                raise
            versions = [v for _, v in listings]
            oldest = None if None in versions else min(v for v in versions if v is not None)
            changed = self.cache.replace(kind, [o for items, _ in listings for o in items], scope, oldest) or changed
        return changed

    def start_leading(self) -> None:
        """Called once this replica holds the Lease (or at once without leader election)."""
        while True:
            try:
                self.prime()
                break
            except KubeError as e:
                log.warning("cannot list the cluster to start leading (%s); trying again", e)
                time.sleep(2.0)
        metrics.LEADER.set(1)
        self.leading.set()
        self.collector.start()
        # the watches may start only after that list: list again soon, not only at the next resync
        self._resync(relist=False, next_in=min(self.resync_seconds, FIRST_RELIST_SECONDS))
        if self.gang_pass is not None:
            self.queue.add(GANG_PASS)
        for i in range(self._workers):
            t = threading.Thread(target=self._work, name=f"tokenfleet-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _resync(self, relist: bool = True, next_in: float | None = None) -> None:
        """Queue every object the operator owns; a reconcile of an unchanged object writes nothing. First
        (``relist``) list everything again: a watch reports no deletion that happened before it started (the
        watches start after a new leader's first list, and start over after an expired resourceVersion), so the
        cache would keep such an object for good (issue 37, defect 11: a Slice whose rolled-back members the
        cache still showed, and which never made them again)."""
        if relist:
            try:
                if self.prime():
                    self._gang_news = True
            except KubeError as e:
                log.warning("cannot list the cluster to resync (%s); the next resync tries again", e)
        for kind in ("InferenceService", "Slice", "TokenRoute"):
            for obj in self.cache.list(kind):
                meta = obj["metadata"]
                self.queue.add((kind, meta["namespace"], meta["name"]))
                if kind == "InferenceService":
                    self.collector.track((kind, meta["namespace"], meta["name"]))
                elif (obj.get("spec") or {}).get("role") == "batch" and (obj.get("spec") or {}).get("checkpoint"):
                    self.collector.track((kind, meta["namespace"], meta["name"]))
        self.queue.add_after(RESYNC, self.resync_seconds if next_in is None else next_in)

    def stop(self) -> None:
        self.leading.clear()
        metrics.LEADER.set(0)
        self.queue.shutdown()
        self.collector.stop()
        for t in self._threads:
            t.join(timeout=10)

    def _gang_pass_due(self) -> bool:
        """A full gang pass runs after news from a watch event, while a gang Slice waits for one, or when the
        last full one is ``GANG_FULL_PASS_SECONDS`` old; otherwise the periodic pass is skipped."""
        news, self._gang_news = self._gang_news, False
        now = self.clock()
        due = news or self._last_full_pass is None or now - self._last_full_pass >= GANG_FULL_PASS_SECONDS \
            or gang_work_waiting(self.cache.list("Slice"), self.cache.list("Pod"))
        if due:
            self._last_full_pass = now
        return due

    # ---- the workers ------------------------------------------------------------------------
    def _work(self) -> None:
        self.queue.work(self.process)

    def process(self, key: Key) -> None:
        """Run the work of one key and queue whatever comes next."""
        kind, namespace, name = key
        if key == RESYNC:
            self._resync()
            return
        if key == GANG_PASS and (wait := self._gang_ready_at - self.clock()) > 0:
            self.queue.add_after(GANG_PASS, wait)      # the last pass's planning time has not passed yet
            return
        started = time.monotonic()
        result = "ok"
        try:
            if key == GANG_PASS:
                assert self.gang_pass is not None
                if self._gang_pass_due():
                    cpu = time.thread_time()
                    interval = self.gang_pass()
                    # GANG_GAP_FACTOR times as long as this pass computed (not the time its writes waited) before
                    # the next one, so that passes during a burst of events leave the workers most of the CPU.
                    self._gang_ready_at = self.clock() + min(GANG_GAP_FACTOR * (time.thread_time() - cpu),
                                                             GANG_MAX_GAP_SECONDS)
                    self.queue.add_after(GANG_PASS, interval)
                else:
                    result = "skipped"
                    self.queue.add_after(GANG_PASS, self.gang_interval)
                return
            assert namespace is not None
            if kind == "InferenceService":
                self.collector.track(key)
            asked = self._times_asked(key)
            with self._asked_lock:
                last = self._fingerprints.pop(key, None)
            if last is not None and last[0] == asked and last[1].unchanged(self.cache, self.collector, self.clock()):
                with self._asked_lock:
                    self._fingerprints[key] = last
                result = "unchanged"
                self.queue.forget(key)
                return
            cache, collector = RecordingCache(self.cache), RecordingCollector(self.collector)
            ctx = Context(self.kube, cache, collector, key, self.gang_pass is not None, self._note_write,
                          self._ask, self._memory.setdefault(key, ServiceMemory()), clock=self.clock)
            delay = self.reconcilers[kind](ctx, namespace, name)
            self.queue.forget(key)
            if delay:
                self.queue.add_after(key, delay)
            elif self.cache.get(kind, namespace, name) is not None:
                with self._asked_lock:
                    if self._asked.get(key, 0) == asked:      # nothing asked for it while it ran
                        self._fingerprints[key] = (asked, Fingerprint(cache.reads, collector.reads, ctx.checks))
            else:
                with self._asked_lock:
                    self._asked.pop(key, None)                # gone: nothing to remember
        except InvalidSpec as e:
            result = "invalid"
            self.queue.forget(key)
            log.info("%s %s/%s: invalid spec: %s", kind, namespace, name, e)
        except RetryLater as e:
            result = "retry"
            log.info("%s %s/%s: %s", kind, namespace, name, e)
            self.queue.add_after(key, e.delay)
        except KubeError as e:
            result = "retry" if e.transient else "error"
            delay = self.queue.add_rate_limited(key)
            log.warning("%s %s/%s: %s (again in %.1f s)", kind, namespace or "", name, e, delay)
        except Exception:
            result = "error"
            delay = self.queue.add_rate_limited(key)
            log.exception("%s %s/%s: reconcile failed (again in %.1f s)", kind, namespace or "", name, delay)
        finally:
            metrics.RECONCILES.labels(kind=kind, result=result).inc()
            if namespace is not None:
                metrics.RECONCILES_BY_OBJECT.labels(kind=kind, namespace=namespace, name=name).inc()
            if result not in ("unchanged", "skipped"):
                metrics.RECONCILE_SECONDS.labels(kind=kind).observe(time.monotonic() - started)
            metrics.QUEUE_DEPTH.set(len(self.queue))

