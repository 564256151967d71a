"""What every tool-call parser shares: the calls it finds, and how a text is cut into content and calls, whole
or while it streams.

A parser's :meth:`ToolParser.scan` reads a text from where the last scan stopped (``start``) and returns the
segments it is sure of (content, or complete calls) and where they end; with ``final`` it must take all of
it. The same scan serves a whole answer (one final scan) and a stream (a scan per delta, then a final one),
so both cut the text the same way. Text that looks like a call but does not parse stays content: a model's
malformed call reaches the client as its words, never as an error.
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                  # a JSON object, encoded, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{secrets.token_hex(16)}")

    def message(self) -> dict:
        """The call in an assistant message's ``tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict:
        """The call as one streamed ``tool_calls`` delta entry."""
        return {"index": index, **self.message()}


Segment = str | ToolCall         # settled text: content, or a complete call


def call_from_json(obj: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters"),
                   make_id: Any = None) -> ToolCall | None:
    """``{"name": N, "arguments"|"parameters": {...}}`` (arguments may be an encoded object) as a ToolCall, else
    None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in arguments_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):     # not JSON, or nested past the parser's stack
            return None
    if not isinstance(args, dict):
        return None
    try:
        encoded = json.dumps(args, ensure_ascii=False)
    except RecursionError:
        return None
    return ToolCall(obj["name"], encoded) if make_id is None else ToolCall(obj["name"], encoded, make_id())


def partial_marker_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a beginning of ``marker`` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` holds one after another (separated by whitespace or ``;``), or None when any
    part is not JSON."""
    decoder, values, i = json.JSONDecoder(), list[Any](), 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):     # not JSON, or nested past the parser's stack
            return None
        values.append(value)


def mistral_call_id() -> str:
    """Mistral's templates take 9 letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class ToolParser:
    """Reads a model's tool calls out of its text. Subclasses implement :meth:`scan`."""

    name = ""
    # The call markers are special tokens, which detokenization would drop: keep them in the text.
    keeps_special_tokens = False

    def scan(self, text: str, start: int, final: bool) -> tuple[list[Segment], int]:
        """The segments of ``text[start:]`` that are settled, and where the next scan starts."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer: its content (None when it is only calls) and its calls."""
        segments, _ = self.scan(text, 0, final=True)
        calls = [s for s in segments if isinstance(s, ToolCall)]
        content = "".join(s for s in segments if isinstance(s, str))
        if calls:
            return (content.strip() or None), calls
        return text, []


class MarkedToolParser(ToolParser):
    """Calls that follow a marker: content until the marker, then the call section (parsed by
    :meth:`calls_after_marker`, at the end of the answer)."""

    marker = ""

    def calls_after_marker(self, section: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def scan(self, text: str, start: int, final: bool) -> tuple[list[Segment], int]:
        at = text.find(self.marker, start)
        if at < 0:
            end = len(text) - (0 if final else partial_marker_suffix(text[start:], self.marker))
            return ([text[start:end]] if end > start else []), end
        segments: list[Segment] = [text[start:at]] if at > start else []
        if not final:
            return segments, at
        calls = self.calls_after_marker(text[at + len(self.marker):])
        if calls:
            segments += calls
        else:
            segments.append(text[at:])
        return segments, len(text)


class ToolCallStream:
    """Streams one answer's content and tool calls as OpenAI's deltas."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.taken = 0
        self.calls: list[ToolCall] = []

    def push(self, delta: str, final: bool = False) -> list[dict]:
        """The chat ``delta`` objects for this much more text (``final``: the answer is complete)."""
        self.text += delta
        segments, self.taken = self.parser.scan(self.text, self.taken, final)
        out: list[dict] = []
        for value in segments:
            if isinstance(value, ToolCall):
                out.append({"tool_calls": [value.delta(len(self.calls))]})
                self.calls.append(value)
            elif value and not (self.calls and not value.strip()):
                out.append({"content": value})
        return out
