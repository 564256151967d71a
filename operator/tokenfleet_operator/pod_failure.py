"""Why a pod's container stopped, in one line, for a Slice's conditions and Events.

A container that exits leaves a termination message (``status.containerStatuses[].state.terminated.message``):
what the process wrote to its termination log (``tokenfleet serve`` and ``route`` write why they exit 1 or 2),
or, with ``terminationMessagePolicy: FallbackToLogsOnError`` and nothing written, the end of its log. Its last
line is the reason a person needs ("tokenfleet serve: error: unrecognized arguments: --bogus", a traceback's
exception), so that line goes into the message, not "exited with code 2" alone.
"""
from __future__ import annotations

from typing import Any

MAX_MESSAGE = 400


def last_words(message: str | None) -> str:
    """The last non-empty line of a termination message, shortened to MAX_MESSAGE characters."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    if not lines:
        return ""
    line = " ".join(lines[-1].split())
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "..."


def _terminated(container_status: dict[str, Any]) -> dict[str, Any] | None:
    for key in ("state", "lastState"):
        term = (container_status.get(key) or {}).get("terminated")
        if term:
            return dict(term)
    return None


def _first_exit(pod_status: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(container status, its terminated state) of the first container that failed, else the first that exited."""
    exited = []
    for cs in [*(pod_status.get("initContainerStatuses") or []), *(pod_status.get("containerStatuses") or [])]:
        term = _terminated(cs)
        if term is not None:
            exited.append((cs, term))
    if not exited:
        return None
    return next(((c, t) for c, t in exited if t.get("exitCode")), exited[0])


def exit_code(pod_status: dict[str, Any]) -> int | None:
    """The exit code of the first container that failed (0 when every exited one succeeded), None if none exited."""
    first = _first_exit(pod_status)
    code = first[1].get("exitCode") if first else None
    return code if isinstance(code, int) else None


def container_failure(pod_status: dict[str, Any]) -> str:
    """"container NAME exited with code N (REASON): LAST LINE" for the first container that failed (else the
    first that exited), or "" when none has."""
    first = _first_exit(pod_status)
    if first is None:
        return ""
    cs, term = first
    text = f"container {cs.get('name')} exited with code {term.get('exitCode')} ({term.get('reason', '')})"
    words = last_words(term.get("message"))
    return f"{text}: {words}" if words else text
