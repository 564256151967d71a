"""What the gang scheduler has done that its watch has not shown yet: binds and deletions in flight.

The pass reads the operator's cache, which the watches fill a moment after each write. A pod the last pass
bound still shows no node there until its watch event arrives; read as it is, the next pass would place it
again (and its second bind would fail with 409). So, as kube-scheduler "assumes" a pod on its node, every
bind that succeeded is remembered here, and so is every member deletion that the API server accepted, and
``overlay`` lays them over the cached pods: a bound pod shows its node, a deleted one its deletionTimestamp.

An entry ends once the cache shows what it assumed (the pod with a node, the pod terminating or gone), so
the overlay never outlives the lag of the watch; an entry older than ``ttl`` ends anyway, so a watch that
missed an event cannot pin a wrong view for long.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from tokenfleet_operator.gang.snapshot import to_rfc3339

Obj = dict[str, Any]


class AssumedState:
    def __init__(self, *, ttl: float = 120.0, clock: Callable[[], float] = time.time):
        self.ttl = ttl
        self.clock = clock
        self._lock = threading.Lock()
        self._bound: dict[str, tuple[str, float]] = {}     # pod uid -> (node, when)
        self._deleted: dict[str, float] = {}               # pod uid -> when

    def bound(self, uid: str, node: str) -> None:
        with self._lock:
            self._bound[uid] = (node, self.clock())

    def deleted(self, uid: str) -> None:
        with self._lock:
            self._deleted[uid] = self.clock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._bound) + len(self._deleted)

    def overlay(self, pods: Iterable[Obj]) -> list[Obj]:
        """The cached pods as they are after this scheduler's own writes. The pods are not changed: an
        assumed one is a shallow copy with the assumed field set. Entries the cache has caught up with, and
        expired ones, are dropped."""
        now = self.clock()
        out: list[Obj] = []
        seen: set[str] = set()
        with self._lock:
            for pod in pods:
                meta = pod.get("metadata") or {}
                uid = meta.get("uid") or ""
                seen.add(uid)
                deleted_at = self._deleted.get(uid)
                if deleted_at is not None:
                    if meta.get("deletionTimestamp") or now - deleted_at > self.ttl:
                        del self._deleted[uid]
                    else:
                        pod = {**pod, "metadata": {**meta, "deletionTimestamp": to_rfc3339(deleted_at)}}
                bound = self._bound.get(uid)
                if bound is not None:
                    spec = pod.get("spec") or {}
                    if spec.get("nodeName") or now - bound[1] > self.ttl:
                        del self._bound[uid]
                    else:
                        pod = {**pod, "spec": {**spec, "nodeName": bound[0]}}
                out.append(pod)
            for uid in [u for u in self._bound if u not in seen]:
                del self._bound[uid]                 # gone from the cache: nothing left to assume
            for uid in [u for u in self._deleted if u not in seen]:
                del self._deleted[uid]
        return out
