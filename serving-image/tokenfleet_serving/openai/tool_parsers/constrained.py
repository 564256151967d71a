"""The output of a request whose ``tool_choice`` is ``required`` or a named function. Decoding was constrained
to ``openai.tools.tool_call_schema``, so the text is JSON of a known shape and no model-specific parser is
involved (as in vLLM):

- a named function: the text is the call's arguments object; a stream sends the call's name first and then
  the arguments as they are generated, as OpenAI streams them;
- ``required``: the text is a list of ``{"name", "parameters"}`` objects; a stream sends each call's name as
  soon as it is written, then its arguments as they are generated.

An answer cut short (``finish_reason: length``) keeps its complete calls; the call it was cut in is not
content (a stream has sent what there was of it).
"""
from __future__ import annotations

from collections.abc import Collection

from ..tools import NAMED, ToolChoice
from .base import Item, ScanState, ToolCallStream, ToolParser, read_sequence, rest
from .call_sequence import ARGUMENTS, ARRAY, CallSequence


class RequiredCallsParser(ToolParser):
    """``required``: a JSON list of calls."""

    name = "required"

    def advance(self, state: ScanState, text: str, final: bool, names: Collection[str] | None) -> list[Item]:
        if state.mode:
            return rest(state, text)
        if state.calls is None:
            state.calls = CallSequence(0, ARRAY, names)
        return read_sequence(state, text, final)


class NamedCallParser(ToolParser):
    """A named function: the text is its arguments."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def advance(self, state: ScanState, text: str, final: bool, names: Collection[str] | None) -> list[Item]:
        if state.mode:
            return rest(state, text)
        if state.calls is None:
            state.calls = CallSequence(0, ARGUMENTS, None, self.function)
        return read_sequence(state, text, final)


def tool_names(choice: ToolChoice) -> frozenset[str]:
    return frozenset(t["function"]["name"] for t in choice.tools)


def constrained_parser(choice: ToolChoice) -> ToolParser:
    return NamedCallParser(choice.function or "") if choice.mode == NAMED else RequiredCallsParser()


def constrained_stream(choice: ToolChoice) -> ToolCallStream:
    return ToolCallStream(constrained_parser(choice), tool_names(choice))
