"""What a reconcile read, so that a resync can tell whether running it again could change anything.

A resync queues every object; most of them have not changed since their last pass, and running the whole
pass (parse the spec, build every child, compare, compute status) for each costs a core's worth of CPU at a
few thousand objects. While a reconcile runs, its Context hands it recording views of the cache and the
collector (``RecordingCache``, ``RecordingCollector``): each read is noted with a signature of what it
returned (resourceVersions; for the collector, its latest reading's time or the checkpoint). After a pass
that succeeded and asked for no timed follow-up, the manager keeps these reads as the key's ``Fingerprint``.

The next time the key comes up, the pass is skipped when (1) nothing asked for the key since (every watch
event, collector change or own-write surprise that queues a key drops its fingerprint), (2) every recorded
read returns the same signature now (which catches changes that reach the key without an event for it,
like a Node's labels), and (3) no check with a deadline is due; a due check (the replica key Secret's
existence, ``reconcile/replica_key.py``) runs on its own, and only if it finds a change does the pass run.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenfleet_operator.controller.cache import ObjectCache
from tokenfleet_operator.controller.collector import Collector

Read = tuple[Any, ...]


def _rv(obj: dict[str, Any] | None) -> str | None:
    return None if obj is None else (obj.get("metadata") or {}).get("resourceVersion")


def _names_and_versions(objs: list[dict[str, Any]]) -> tuple[tuple[str, str | None], ...]:
    return tuple(((o.get("metadata") or {}).get("name", ""), _rv(o)) for o in objs)


def cache_signature(cache: ObjectCache, read: Read) -> Any:
    op, *args = read
    if op == "get":
        return _rv(cache.get(*args))
    if op == "list":
        return _names_and_versions(cache.list(*args))
    if op == "by_label":
        return _names_and_versions(cache.by_label(*args))
    if op == "count":
        return cache.count(*args)
    raise ValueError(f"unknown cache read {op!r}")


def collector_signature(collector: Collector, read: Read) -> Any:
    op, *args = read
    if op == "router_history":
        history = collector.router_history(*args)
        latest = history.latest if history is not None else None
        return None if latest is None else latest.at
    if op == "checkpoint":
        value = collector.checkpoint(*args)
        return None if value is None else tuple(sorted(value.items()))
    if op == "adapter_readings":
        readings = collector.adapter_readings(*args)
        return None if readings is None else readings.changed_at
    raise ValueError(f"unknown collector read {op!r}")


class RecordingCache(ObjectCache):
    """The cache as one reconcile sees it: every read goes to the shared cache and is noted; writes go
    through."""

    def __init__(self, inner: ObjectCache):            # noqa: D107 - no ObjectCache state of its own
        self._inner = inner
        self.reads: list[tuple[Read, Any]] = []

    def _note(self, read: Read, value: Any) -> None:
        self.reads.append((read, value))

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        obj = self._inner.get(kind, namespace, name)
        self._note(("get", kind, namespace, name), _rv(obj))
        return obj

    def list(self, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        objs = self._inner.list(kind, namespace)
        self._note(("list", kind, namespace), _names_and_versions(objs))
        return objs

    def by_label(self, kind: str, namespace: str | None, label: str, value: str) -> list[dict[str, Any]]:
        objs = self._inner.by_label(kind, namespace, label, value)
        self._note(("by_label", kind, namespace, label, value), _names_and_versions(objs))
        return objs

    def count(self, kind: str) -> int:
        n = self._inner.count(kind)
        self._note(("count", kind), n)
        return n

    def observe(self, kind: str, event_type: str | None, obj: dict[str, Any]) -> bool:
        return self._inner.observe(kind, event_type, obj)

    def store(self, kind: str, obj: dict[str, Any]) -> bool:
        return self._inner.store(kind, obj)

    def forget(self, kind: str, obj: dict[str, Any]) -> bool:
        return self._inner.forget(kind, obj)

    def replace(self, kind: str, objects: list[dict[str, Any]], namespaces: list[str] | None = None) -> None:
        self._inner.replace(kind, objects, namespaces)


class RecordingCollector(Collector):
    """The collector as one reconcile sees it: its readings are noted; everything else goes through."""

    def __init__(self, inner: Collector):              # noqa: D107 - no Collector state of its own
        self._inner = inner
        self.reads: list[tuple[Read, Any]] = []

    def router_history(self, namespace: str, service: str) -> Any:
        read = ("router_history", namespace, service)
        self.reads.append((read, collector_signature(self._inner, read)))
        return self._inner.router_history(namespace, service)

    def checkpoint(self, namespace: str, slice_name: str) -> dict[str, str] | None:
        read = ("checkpoint", namespace, slice_name)
        self.reads.append((read, collector_signature(self._inner, read)))
        return self._inner.checkpoint(namespace, slice_name)

    def adapter_readings(self, namespace: str, service: str) -> Any:
        read = ("adapter_readings", namespace, service)
        self.reads.append((read, collector_signature(self._inner, read)))
        return self._inner.adapter_readings(namespace, service)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass
class Check:
    """A question a pass asks on a clock, not from the cache: due at ``due`` (the manager's clock);
    ``still`` asks it again and says whether the answer is unchanged."""

    due: float
    period: float
    still: Callable[[], bool]


@dataclass
class Fingerprint:
    cache_reads: list[tuple[Read, Any]]
    collector_reads: list[tuple[Read, Any]]
    checks: list[Check] = field(default_factory=list)

    def unchanged(self, cache: ObjectCache, collector: Collector, now: float) -> bool:
        """Whether a pass now would read what the last one read; runs the checks that are due."""
        if any(cache_signature(cache, read) != seen for read, seen in self.cache_reads):
            return False
        if any(collector_signature(collector, read) != seen for read, seen in self.collector_reads):
            return False
        for check in self.checks:
            if now >= check.due:
                if not check.still():
                    return False
                check.due = now + check.period
        return True
