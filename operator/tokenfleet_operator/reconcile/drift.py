"""Whether a live object already holds what a desired manifest says, so an unchanged child costs no write.

Server-side apply is idempotent, but each apply is a request: at a thousand services, a resync that
re-applies every child costs thousands of requests for nothing. A child is applied only when some field of
its manifest is missing from, or different in, the live object as cached. Fields the API server adds
(defaults, status, managedFields) do not count. A field the server normalises (a quantity written as
"1000m" and stored as "1") reads as different, and is applied again: harmless, only a request.
"""
from __future__ import annotations

from typing import Any


def holds(desired: Any, live: Any) -> bool:
    """True when every field of ``desired`` is in ``live`` with the same value (lists element by element)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and holds(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(holds(d, x) for d, x in zip(desired, live))
    return bool(desired == live)


def needs_apply(manifest: dict[str, Any], live: dict[str, Any] | None) -> bool:
    if live is None or (live.get("metadata") or {}).get("deletionTimestamp"):
        return True
    return not holds({k: v for k, v in manifest.items() if k not in ("apiVersion", "kind")}, live)
