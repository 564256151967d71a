"""Where the gang pass reads the cluster from, and where it tells what it wrote.

``CachedCluster`` (the operator): Nodes, Slices, SliceQueues and tokenfleet's own pods come from the
operator's watch cache, with the pass's own binds and deletions laid over them (``assumed.AssumedState``), so
a pass costs no list of thousands of pods and no memory for a second copy of them. What the cache does not
hold, pods of other managers (and, when the operator serves only some namespaces, tokenfleet pods outside
them), is listed with ``resourceVersion=0``, at most every ``FOREIGN_MAX_AGE`` seconds: the API server
answers from its own watch cache, filtered to pods bound to a node and not finished, without a read from
etcd. Those pods are placed by other schedulers, which race with this one whatever is read, so a view a few
seconds old costs nothing that a quorum read would save.
Decisions and SliceQueue status the pass writes go into the cache at once, so the next pass compares with
what it wrote, not with what the watch has delivered so far.

``ListedCluster`` (tests and tools that run a pass without an operator): quorum lists of everything, so every
earlier write is visible and nothing needs to be assumed.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tokenfleet_operator.api import API_VERSION
from tokenfleet_operator.controller.cache import ObjectCache
from tokenfleet_operator.gang.assumed import AssumedState
from tokenfleet_operator.gang.snapshot import pod_requests
from tokenfleet_operator.kube import Kube, KubeError
from tokenfleet_operator.naming import MANAGED_BY, MANAGED_BY_LABEL

Obj = dict[str, Any]
BOUND_AND_LIVE = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
# Other managers' pods are listed at most this often: their schedulers race with this one whatever is read.
FOREIGN_MAX_AGE = 5.0


@dataclass
class Snapshot:
    nodes: list[Obj]
    pods: list[Obj]
    slices: list[Obj]
    queues: list[Obj]


class ClusterView(Protocol):
    def snapshot(self) -> Snapshot: ...
    def bound(self, uid: str, node: str) -> None: ...
    def deleted(self, uid: str) -> None: ...
    def wrote(self, kind: str, obj: Obj) -> None: ...


def _list_queues(kube: Kube) -> list[Obj]:
    try:
        return kube.list_cluster(API_VERSION, "SliceQueue")
    except KubeError as e:
        if e.status != 404:
            raise
        return []  # the SliceQueue CRD is not installed: only the implicit 'default' queue exists


class ListedCluster:
    def __init__(self, kube: Kube, namespaces: list[str] | None):
        self.kube, self.namespaces = kube, namespaces

    def snapshot(self) -> Snapshot:
        nodes = self.kube.list_cluster("v1", "Node")
        pods = self.kube.list_cluster("v1", "Pod", field_selector="status.phase!=Succeeded,status.phase!=Failed")
        if self.namespaces:
            slices = [s for ns in self.namespaces for s in self.kube.list(API_VERSION, "Slice", ns)]
        else:
            slices = self.kube.list_cluster(API_VERSION, "Slice")
        return Snapshot(nodes, pods, slices, _list_queues(self.kube))

    def bound(self, uid: str, node: str) -> None:
        pass             # the next quorum list shows it

    def deleted(self, uid: str) -> None:
        pass

    def wrote(self, kind: str, obj: Obj) -> None:
        pass


class CachedCluster:
    def __init__(self, kube: Kube, cache: ObjectCache, namespaces: list[str] | None, *,
                 store: Callable[[str, Obj], None], assumed: AssumedState | None = None,
                 foreign_max_age: float = FOREIGN_MAX_AGE, clock: Callable[[], float] = time.monotonic):
        """``store``: put an object a write returned into the cache (the manager's, which also remembers it
        as the gang pass's own write, so its watch event does not trigger another pass)."""
        self.kube, self.cache, self.namespaces = kube, cache, namespaces
        self.store = store
        self.assumed = assumed or AssumedState()
        self.clock = clock
        self.foreign_max_age = foreign_max_age
        self._foreign: tuple[float, list[Obj]] | None = None

    def foreign_pods(self) -> list[Obj]:
        """Bound, unfinished pods the cache does not hold that hold an extended resource (only those can take
        accelerators from a gang). Listed again once the last list is ``foreign_max_age`` seconds old."""
        now = self.clock()
        if self._foreign is None or now - self._foreign[0] >= self.foreign_max_age:
            self._foreign = (now, self._list_foreign())
        return self._foreign[1]

    def _list_foreign(self) -> list[Obj]:
        queries = [(f"{MANAGED_BY_LABEL}!={MANAGED_BY}", BOUND_AND_LIVE)]
        if self.namespaces:
            outside = ",".join(f"metadata.namespace!={ns}" for ns in self.namespaces)
            queries.append((f"{MANAGED_BY_LABEL}={MANAGED_BY}", f"{BOUND_AND_LIVE},{outside}"))
        out = []
        for labels, fields in queries:
            for pod in self.kube.list_cluster("v1", "Pod", label_selector=labels, field_selector=fields,
                                              resource_version="0"):
                if pod_requests(pod):
                    out.append(pod)
        return out

    def snapshot(self) -> Snapshot:
        pods = self.assumed.overlay(self.cache.list("Pod")) + self.foreign_pods()
        return Snapshot(self.cache.list("Node"), pods, self.cache.list("Slice"), self.cache.list("SliceQueue"))

    def bound(self, uid: str, node: str) -> None:
        self.assumed.bound(uid, node)

    def deleted(self, uid: str) -> None:
        self.assumed.deleted(uid)

    def wrote(self, kind: str, obj: Obj) -> None:
        if obj:
            obj.setdefault("kind", kind)
            self.store(kind, obj)
