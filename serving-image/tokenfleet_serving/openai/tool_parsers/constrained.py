"""The output of a request whose ``tool_choice`` is ``required`` or a named function. Decoding was constrained
to ``openai.tools.tool_call_schema``, so the text is JSON of a known shape and no model-specific parser is
involved (as in vLLM):

- a named function: the text is the call's arguments object; a stream sends the call's name first and then
  the arguments as they are generated, as OpenAI streams them;
- ``required``: the text is a list of ``{"name", "parameters"}`` objects; a stream sends the calls when the
  list is complete.

Only an answer cut short (``finish_reason: length``) fails to parse; it is returned as content.
"""
from __future__ import annotations

import json

from ..tools import NAMED, ToolChoice
from .base import Segment, ToolCall, ToolCallStream, ToolParser, call_from_json


class RequiredCallsParser(ToolParser):
    """``required``: a JSON list of calls, read when the answer is complete."""

    name = "required"

    def scan(self, text: str, start: int, final: bool) -> tuple[list[Segment], int]:
        if not final:
            return [], start
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):     # not JSON, or nested past the parser's stack
            items = None
        calls = [call_from_json(i, ("parameters", "arguments")) for i in items] if isinstance(items, list) else []
        if calls and all(c is not None for c in calls):
            return [c for c in calls if c is not None], len(text)
        return ([text] if text else []), len(text)


class NamedCallParser(ToolParser):
    """A named function: the text is its arguments."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def scan(self, text: str, start: int, final: bool) -> tuple[list[Segment], int]:
        if not final:
            return [], start
        try:
            args = json.loads(text)
        except (ValueError, RecursionError):     # not JSON, or nested past the parser's stack
            args = None
        if isinstance(args, dict):
            return [ToolCall(self.function, json.dumps(args, ensure_ascii=False))], len(text)
        return ([text] if text else []), len(text)


class NamedCallStream(ToolCallStream):
    """Streams a named function's call: its id and name at once, then its arguments as they come."""

    def __init__(self, function: str):
        super().__init__(NamedCallParser(function))
        self.call = ToolCall(function, "")

    def push(self, delta: str, final: bool = False) -> list[dict]:
        out: list[dict] = []
        if not self.calls:
            self.calls.append(self.call)
            out.append({"tool_calls": [self.call.delta(0)]})
        self.text += delta
        if delta:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
        return out


def constrained_parser(choice: ToolChoice) -> ToolParser:
    return NamedCallParser(choice.function or "") if choice.mode == NAMED else RequiredCallsParser()


def constrained_stream(choice: ToolChoice) -> ToolCallStream:
    return NamedCallStream(choice.function or "") if choice.mode == NAMED else ToolCallStream(RequiredCallsParser())
