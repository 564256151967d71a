"""Counting one user's requests in the API server's audit log (JSON lines, level Metadata).

The operator's own counter sees only the requests its code makes. The audit
log sees every request its credentials make: Kopf's watches and its
annotation patches too, and whatever a rewritten operator sends by another
path. Verbs are the API server's (an apply is a ``patch``); resources carry
their subresource as RBAC writes them (``pods/binding``).
"""
from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Iterable


def _epoch(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def count_requests(lines: Iterable[str], user: str,
                   windows: dict[str, tuple[float, float]]) -> dict[str, Counter]:
    """Per window (name -> [start, end) in epoch seconds, by when the request was received):
    Counter of (verb, resource) for the finished requests of ``user``."""
    out: dict[str, Counter] = {name: Counter() for name in windows}
    for line in lines:
        if user not in line:  # cheap filter before parsing
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut short when the server stopped
        if (event.get("user") or {}).get("username") != user or event.get("stage") != "ResponseComplete":
            continue
        ref = event.get("objectRef") or {}
        resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        received = _epoch(event["requestReceivedTimestamp"])
        for name, (start, end) in windows.items():
            if start <= received < end:
                out[name][(event.get("verb", ""), resource)] += 1
    return out
