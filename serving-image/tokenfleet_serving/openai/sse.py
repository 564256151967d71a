"""Server-Sent Events as OpenAI streams them: ``data: {json}\n\n`` per chunk, ``data: [DONE]\n\n`` at the end,
and an error mid-stream as ``data: {"error": {...}}`` before ``[DONE]``. Written by the server, read and
rewritten by the router.
"""
from __future__ import annotations

import json
from typing import Any

from .errors import error_body

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def error_event(status: int, message: str) -> bytes:
    """OpenAI's stream error: ``data: {"error": {...}}`` (the caller follows it with ``[DONE]``)."""
    return sse_event(error_body(status, message))


def is_done(event: bytes) -> bool:
    return any(line.startswith(b"data:") and line[5:].strip() == b"[DONE]" for line in event.split(b"\n"))


class SseEvents:
    """Splits a byte stream of Server-Sent Events into whole events (each ending in a blank line)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        events: list[bytes] = []
        while True:
            cut = self._buffer.find(b"\n\n")
            if cut < 0:
                return events
            events.append(self._buffer[:cut + 2])
            self._buffer = self._buffer[cut + 2:]

    def rest(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest


def event_json(event: bytes) -> dict[str, Any] | None:
    """The JSON object of a ``data:`` event, or None (``[DONE]``, comments, other fields, bad JSON)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return None
            try:
                value = json.loads(payload)
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None
