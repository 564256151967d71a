"""Serialising reconciles per object, and the resync loop.

Kopf calls handlers from a thread pool, and a child's event may trigger its
parent's reconcile while the parent's own handler runs; one lock per object
keeps passes over the same object sequential. The resync loop is the
level-based safety net: it re-reconciles every object every resync period,
and any object a pass asked to look at again after a delay.
"""
from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Any, Callable

from tokenfleet_operator import metrics
from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.handlers.errors import InvalidSpec, RetryLater
from tokenfleet_operator.handlers.inference_service import reconcile_inference_service
from tokenfleet_operator.handlers.slice import reconcile_slice
from tokenfleet_operator.kube import Kube, KubeError

log = logging.getLogger("tokenfleet.runtime")

RECONCILERS: dict[str, Callable[[Kube, dict[str, Any]], float | None]] = {
    "InferenceService": reconcile_inference_service,
    "Slice": reconcile_slice,
}


class Runtime:
    def __init__(self, kube: Kube, namespaces: list[str] | None, resync_seconds: float):
        self.kube = kube
        self.namespaces = namespaces  # None: all namespaces
        self.resync_seconds = resync_seconds
        self._locks: dict[tuple[str, str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._running: set[tuple[str, str, str]] = set()
        self._pending: set[tuple[str, str, str]] = set()
        self._due: list[tuple[float, str, str, str]] = []
        self._due_guard = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _lock(self, key: tuple[str, str, str]) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def reconcile(self, kind: str, body: dict[str, Any], *, fetch: bool = False) -> float | None:
        """Run one pass over an object; raises InvalidSpec, RetryLater or KubeError."""
        meta = body["metadata"]
        key = (kind, meta["namespace"], meta["name"])
        with self._lock(key):
            if fetch:  # re-read under the lock so the pass sees the latest status
                fresh = self.kube.get(API_VERSION, kind, meta["namespace"], meta["name"])
                if fresh is None:
                    return None
                body = fresh
            started = time.monotonic()
            result = "ok"
            try:
                delay = RECONCILERS[kind](self.kube, body)
            except InvalidSpec:
                result = "invalid"
                raise
            except RetryLater as e:
                result = "retry"
                self.requeue(kind, meta["namespace"], meta["name"], e.delay)
                raise
            except KubeError as e:
                result = "retry" if e.transient else "error"
                raise
            except Exception:
                result = "error"
                raise
            finally:
                metrics.RECONCILES.labels(kind=kind, result=result).inc()
                metrics.RECONCILE_SECONDS.labels(kind=kind).observe(time.monotonic() - started)
        if delay:
            self.requeue(kind, meta["namespace"], meta["name"], delay)
        return delay

    def reconcile_quietly(self, kind: str, namespace: str, name: str) -> None:
        """Fetch and reconcile; log failures instead of raising (event and resync paths).

        Triggers for an object that is already being reconciled are coalesced:
        the running pass runs once more afterwards instead of each trigger
        holding a worker thread while it waits for the lock."""
        key = (kind, namespace, name)
        with self._locks_guard:
            if key in self._running:
                self._pending.add(key)
                return
            self._running.add(key)
        try:
            while True:
                self._reconcile_logged(kind, namespace, name)
                with self._locks_guard:
                    if key not in self._pending:
                        break
                    self._pending.discard(key)
        finally:
            with self._locks_guard:
                self._running.discard(key)
                self._pending.discard(key)

    def _reconcile_logged(self, kind: str, namespace: str, name: str) -> None:
        try:
            self.reconcile(kind, {"metadata": {"namespace": namespace, "name": name}}, fetch=True)
        except InvalidSpec as e:
            log.info("%s %s/%s: invalid spec: %s", kind, namespace, name, e)
        except RetryLater as e:
            log.info("%s %s/%s: %s", kind, namespace, name, e)
        except KubeError as e:
            log.warning("%s %s/%s: %s", kind, namespace, name, e)
            if e.transient:
                self.requeue(kind, namespace, name, 2.0)
        except Exception:
            log.exception("%s %s/%s: reconcile failed", kind, namespace, name)
            self.requeue(kind, namespace, name, 10.0)

    def requeue(self, kind: str, namespace: str, name: str, delay: float) -> None:
        with self._due_guard:
            heapq.heappush(self._due, (time.monotonic() + delay, kind, namespace, name))
            self._due_guard.notify()

    def _resync_all(self) -> None:
        for kind in ("InferenceService", "Slice"):
            for namespace in self.namespaces or [None]:
                try:
                    items = self.kube.list(API_VERSION, kind, namespace) if namespace else self._list_all(kind)
                except KubeError as e:
                    log.warning("resync: cannot list %s: %s", kind, e)
                    continue
                for item in items:
                    if self._stop.is_set():
                        return
                    self.reconcile_quietly(kind, item["metadata"]["namespace"], item["metadata"]["name"])

    def _list_all(self, kind: str) -> list[dict[str, Any]]:
        plural = {"InferenceService": "inferenceservices", "Slice": "slices"}[kind]
        return self.kube._call("GET", f"/apis/{API_VERSION}/{plural}").get("items", [])

    def _loop(self) -> None:
        next_resync = time.monotonic() + self.resync_seconds
        while not self._stop.is_set():
            with self._due_guard:
                now = time.monotonic()
                wake = min(next_resync, self._due[0][0]) if self._due else next_resync
                if wake > now:
                    self._due_guard.wait(timeout=min(wake - now, 1.0))
                    continue
                due = []
                while self._due and self._due[0][0] <= now:
                    due.append(heapq.heappop(self._due)[1:])
            for kind, namespace, name in dict.fromkeys(due):
                self.reconcile_quietly(kind, namespace, name)
            if time.monotonic() >= next_resync:
                self._resync_all()
                next_resync = time.monotonic() + self.resync_seconds

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tokenfleet-resync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._due_guard:
            self._due_guard.notify()
        if self._thread:
            self._thread.join(timeout=5)
