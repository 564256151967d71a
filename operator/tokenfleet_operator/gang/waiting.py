"""Whether the gang scheduler has anything to do, read from the operator's cache without a request.

A full pass plans over every Node, Pod and Slice (about half a second of CPU at 2,500 Slices). The pass is
needed when something changed (a watch event
queues it: ``controller.triggers``) or while some gang Slice still waits for it; an idle fleet, where every
gang Slice is placed with all its members bound, needs none. Then the periodic pass is skipped, and a full
one still runs every ``controller.manager.GANG_FULL_PASS_SECONDS`` in case the cache missed something.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenfleet_operator.controller.triggers import is_gang_slice
from tokenfleet_operator.gang.decision import GangDecision
from tokenfleet_operator.gang.plan import SCHEDULER_NAME
from tokenfleet_operator.gang.snapshot import TERMINAL_PHASES
from tokenfleet_operator.naming import SLICE_LABEL


def _live(obj: dict[str, Any]) -> bool:
    return not (obj.get("metadata") or {}).get("deletionTimestamp") and \
        (obj.get("status") or {}).get("phase") not in TERMINAL_PHASES


def gang_work_waiting(slices: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]]) -> bool:
    """True while some gang Slice is not placed with all its members bound, or some member pod of the
    gang scheduler is unbound."""
    members: dict[tuple[str | None, str], list[dict[str, Any]]] = {}
    for pod in pods:
        if not _live(pod):
            continue
        spec = pod.get("spec") or {}
        if spec.get("schedulerName") == SCHEDULER_NAME and not spec.get("nodeName"):
            return True
        meta = pod.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(SLICE_LABEL)
        if owner:
            members.setdefault((meta.get("namespace"), owner), []).append(pod)
    for obj in slices:
        if not is_gang_slice(obj) or not _live(obj):
            continue
        decision = GangDecision.from_object(obj)
        if decision is None or not decision.placed:
            return True
        meta = obj["metadata"]
        live = members.get((meta.get("namespace"), meta.get("name", "")), [])
        if len(live) != int((obj.get("spec") or {}).get("hosts", 1)) or not all((p.get("spec") or {}).get("nodeName") for p in live):
            return True
    return False
