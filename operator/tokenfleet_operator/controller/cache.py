"""The operator's view of the cluster: the objects its watches delivered, by kind, with label indexes.

Kopf's watch events fill it (``observe``); so do the objects the operator's own writes return (``store``),
so a pass that runs before the watch event of its own last write already sees that write. An object
replaces the cached one only if its resourceVersion is not older, so a late watch event never rolls the
cache back. Reconciles read from here instead of listing from the API server, and so does the gang pass,
with its own binds laid over what the watch has delivered (``gang/assumed.py``).

Deletions leave a tombstone (the resourceVersion the object was deleted at, for ``TOMBSTONE_SECONDS``), so a
list or an event that was read before the deletion and arrives after it does not bring the object back. A list
(``replace``) forgets what it lacks, except objects newer than the list, which were made after it was read.
The watches start a moment after the leader's first list, and a watch (Kopf's, after a 410) starts over with a
list whose absent objects it never reports: what was deleted in such a gap is forgotten only by the next
``replace`` (the manager relists at every resync; issue 37, defect 11).

Objects are stored compacted (``compact``): without ``metadata.managedFields`` and kubectl's last-applied
copy, which no reconcile reads and which are a third of a pod's bytes, and with their keys interned, so that
ten thousand objects share one copy of each field name instead of holding their own. They are handed out as
stored: callers treat them as read-only.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

Obj = dict[str, Any]
ObjKey = tuple[str | None, str]          # (namespace, name)

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
_SHORT = 32          # values this short (reasons, phases, "True", image names) are interned like the keys
# How long a deleted object's resourceVersion is remembered: longer than any list or event can be in flight.
TOMBSTONE_SECONDS = 600.0


def _compacted(value: Any) -> Any:
    if isinstance(value, dict):
        return {sys.intern(k): _compacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_compacted(v) for v in value]
    if isinstance(value, str) and len(value) <= _SHORT:
        return sys.intern(value)
    return value


def compact(obj: Obj) -> Obj:
    """A copy of an API object as the cache keeps it: no managedFields, no last-applied annotation, keys and
    short strings interned. Everything a reconcile reads is unchanged."""
    meta = obj.get("metadata")
    if isinstance(meta, dict) and ("managedFields" in meta or LAST_APPLIED in (meta.get("annotations") or {})):
        meta = {k: v for k, v in meta.items() if k != "managedFields"}
        if LAST_APPLIED in (meta.get("annotations") or {}):
            meta["annotations"] = {k: v for k, v in meta["annotations"].items() if k != LAST_APPLIED}
        obj = {**obj, "metadata": meta}
    out: Obj = _compacted(obj)
    return out


def _rv(obj: Obj) -> int | None:
    value = (obj.get("metadata") or {}).get("resourceVersion")
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class ObjectCache:
    def __init__(self, indexes: dict[str, Iterable[str]] | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        """``indexes``: kind -> label keys to index objects of that kind by (namespace, label value)."""
        self._lock = threading.Lock()
        self._clock = clock
        # kind -> key -> (resourceVersion it was deleted at, when)
        self._tombstones: dict[str, dict[ObjKey, tuple[int, float]]] = defaultdict(dict)
        self._pruned_at = clock()
        self._objects: dict[str, dict[ObjKey, Obj]] = defaultdict(dict)
        self._index_keys = {kind: tuple(keys) for kind, keys in (indexes or {}).items()}
        # (kind, label key) -> (namespace, value) -> set of names
        self._index: dict[tuple[str, str], dict[ObjKey, set[str]]] = defaultdict(lambda: defaultdict(set))

    # ---- writes -------------------------------------------------------------------
    def observe(self, kind: str, event_type: str | None, obj: Obj) -> bool:
        """Apply one watch event; returns whether the cache changed."""
        if event_type == "DELETED":
            return self.forget(kind, obj)
        return self.store(kind, obj)

    def store(self, kind: str, obj: Obj) -> bool:
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace"), meta.get("name", ""))
        with self._lock:
            old = self._objects[kind].get(key)
            tomb = self._tombstones[kind].get(key)
            if tomb is not None:
                new = _rv(obj)
                if new is not None and new <= tomb[0]:
                    return False             # read before its deletion
                del self._tombstones[kind][key]
            if old is not None:
                old_rv, new_rv = _rv(old), _rv(obj)
                if old_rv is not None and new_rv is not None and new_rv < old_rv:
                    return False
                if old_rv is not None and old_rv == new_rv:
                    return False
                self._unindex(kind, key, old)
            obj = compact(obj)
            self._objects[kind][key] = obj
            self._reindex(kind, key, obj)
            return True

    def forget(self, kind: str, obj: Obj) -> bool:
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace"), meta.get("name", ""))
        with self._lock:
            old = self._objects[kind].pop(key, None)
            self._bury(kind, key, _rv(obj) or (_rv(old) if old is not None else None))
            if old is None:
                return False
            self._unindex(kind, key, old)
            return True

    def replace(self, kind: str, objects: list[Obj], namespaces: list[str] | None = None,
                resource_version: int | None = None) -> bool:
        """A fresh list of a kind (in ``namespaces``, or everywhere), read at ``resource_version`` (None:
        unknown): store it, and forget what it lacks unless that is newer than the list. Returns whether the
        cache changed."""
        listed = {((o.get("metadata") or {}).get("namespace"), (o.get("metadata") or {}).get("name", "")) for o in objects}
        with self._lock:
            gone = [(key, obj) for key, obj in self._objects[kind].items()
                    if key not in listed and (namespaces is None or key[0] in namespaces)
                    and (resource_version is None or (_rv(obj) or 0) <= resource_version)]
            for key, obj in gone:
                del self._objects[kind][key]
                self._unindex(kind, key, obj)
                self._bury(kind, key, resource_version or _rv(obj))
        changed = bool(gone)
        for obj in objects:
            changed = self.store(kind, obj) or changed
        return changed

    def _bury(self, kind: str, key: ObjKey, rv: int | None) -> None:
        """Remember that ``key`` was deleted at ``rv`` (under the lock); forget tombstones past their time."""
        now = self._clock()
        if now - self._pruned_at > TOMBSTONE_SECONDS / 10:
            self._pruned_at = now
            for tombs in self._tombstones.values():
                for old_key in [k for k, (_, t) in tombs.items() if now - t > TOMBSTONE_SECONDS]:
                    del tombs[old_key]
        if rv is not None:
            tombs = self._tombstones[kind]
            tombs[key] = (max(rv, tombs.get(key, (0, 0.0))[0]), now)

    def _reindex(self, kind: str, key: ObjKey, obj: Obj) -> None:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for label in self._index_keys.get(kind, ()):
            if label in labels:
                self._index[(kind, label)][(key[0], labels[label])].add(key[1])

    def _unindex(self, kind: str, key: ObjKey, obj: Obj) -> None:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for label in self._index_keys.get(kind, ()):
            if label in labels:
                names = self._index[(kind, label)].get((key[0], labels[label]))
                if names is not None:
                    names.discard(key[1])

    # ---- reads ----------------------------------------------------------------------
    def get(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        with self._lock:
            return self._objects[kind].get((namespace, name))

    def list(self, kind: str, namespace: str | None = None) -> list[Obj]:
        """Objects of a kind (in one namespace, or all of them with None)."""
        with self._lock:
            return [o for (ns, _), o in self._objects[kind].items() if namespace is None or ns == namespace]

    def by_label(self, kind: str, namespace: str | None, label: str, value: str) -> list[Obj]:
        """Objects of a kind in a namespace whose label ``label`` is ``value`` (an indexed label)."""
        if label not in self._index_keys.get(kind, ()):
            raise KeyError(f"{kind} objects are not indexed by label {label}")
        with self._lock:
            names = self._index[(kind, label)].get((namespace, value), set())
            objects = self._objects[kind]
            return [objects[(namespace, n)] for n in sorted(names) if (namespace, n) in objects]

    def count(self, kind: str) -> int:
        with self._lock:
            return len(self._objects[kind])
