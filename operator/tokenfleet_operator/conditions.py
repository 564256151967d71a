"""Pure helpers for status conditions (metav1.Condition semantics).

``lastTransitionTime`` changes only when a condition's status changes, so
re-running a reconcile with the same outcome leaves status byte-identical
and the API server sees no change.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["True", "False", "Unknown"]


def now_rfc3339(now: dt.datetime | None = None) -> str:
    moment = now or dt.datetime.now(dt.UTC)
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> dt.datetime:
    """The API server's timestamps ("2026-01-01T00:00:00Z"); ValueError for anything else."""
    if len(text) == 20 and text[4] == text[7] == "-" and text[10] == "T" and text[13] == text[16] == ":" \
            and text[19] == "Z" and text[:19].replace("-", "").replace(":", "").replace("T", "").isdigit():
        # the same answer as strptime below, in a tenth of the time (a gang pass parses thousands)
        return dt.datetime.fromisoformat(text[:19]).replace(tzinfo=dt.UTC)
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)


@dataclass(frozen=True)
class Desired:
    """The outcome of one check: what a condition should say now."""

    type: str
    status: Status
    reason: str
    message: str = ""


def find(conditions: Iterable[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    for cond in conditions or ():
        if cond.get("type") == type_:
            return cond
    return None


def is_true(conditions: Iterable[dict[str, Any]] | None, type_: str) -> bool:
    cond = find(conditions, type_)
    return cond is not None and cond.get("status") == "True"


def is_ready(obj: dict[str, Any]) -> bool:
    """An API object (a Pod, a Node) whose status has a Ready condition that is True."""
    return is_true((obj.get("status") or {}).get("conditions"), "Ready")


def merge(
    existing: Iterable[dict[str, Any]] | None,
    desired: Iterable[Desired],
    *,
    now: str,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """New condition list: desired conditions in the given order, keeping each
    one's lastTransitionTime unless its status changed. Conditions of other
    types that already exist are kept after them, untouched."""
    existing = list(existing or [])
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for want in desired:
        if want.type in seen:
            raise ValueError(f"condition type {want.type} given twice")
        seen.add(want.type)
        old = find(existing, want.type)
        changed = old is None or old.get("status") != want.status
        since = now if old is None or changed else old.get("lastTransitionTime", now)
        cond: dict[str, Any] = {
            "type": want.type,
            "status": want.status,
            "reason": want.reason,
            "message": want.message,
            "lastTransitionTime": since,
        }
        if generation is not None:
            cond["observedGeneration"] = generation
        out.append(cond)
    out.extend(c for c in existing if c.get("type") not in seen)
    return out


@dataclass(frozen=True)
class Transition:
    """A condition whose status changed: worth an Event."""

    type: str
    old_status: str | None
    new_status: str
    reason: str
    message: str


def transitions(before: Iterable[dict[str, Any]] | None, after: Iterable[dict[str, Any]]) -> list[Transition]:
    """Conditions whose status differs between two lists (new ones included)."""
    out = []
    for cond in after:
        old = find(before, cond["type"])
        old_status = old.get("status") if old else None
        if old_status != cond["status"]:
            out.append(Transition(cond["type"], old_status, cond["status"], cond["reason"], cond.get("message", "")))
    return out
