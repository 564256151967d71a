"""The answer to a chat request with tools: which reader turns the model's text into content and tool calls,
and the OpenAI shapes of the result (the message's ``tool_calls``, ``finish_reason: tool_calls``).

- no tools, or ``tool_choice: none``: the text is content;
- ``auto``: the server's tool-call parser (``--tool-call-parser``, ``spec.engine.toolCallParser``) reads it;
  a server without one refuses the request (400 naming ``tool_choice``), as vLLM does;
- ``required`` or a named function: decoding is constrained to ``tools.tool_call_schema`` and the constrained
  reader (``tool_parsers/constrained.py``) reads it.

Only calls of the request's functions are calls; a stream sends each one's name as soon as it is written and
then its arguments as they are generated. An answer cut short keeps the calls it completed (streamed or not)
and keeps its ``finish_reason: length``; the call it was cut in is no content.
"""
from __future__ import annotations

from typing import Any

from .errors import bad
from .tool_parsers import TOOL_PARSERS, ToolCall, ToolCallStream, ToolParser
from .tool_parsers.constrained import constrained_parser, tool_names
from .tools import NAMED, NONE, ToolChoice


def tool_output_parser(choice: ToolChoice | None, parser_name: str | None) -> ToolParser | None:
    """How this request's answer is read (None: as plain content). ApiError 400 naming ``tool_choice`` for
    ``auto`` on a server without a tool-call parser."""
    if choice is None or choice.mode == NONE:
        return None
    if choice.constrained:
        return constrained_parser(choice)
    if parser_name is None:
        raise bad("tool_choice", "\"auto\" needs a server started with --tool-call-parser "
                                 "(spec.engine.toolCallParser); this one has none: send \"none\", \"required\" or "
                                 "a named function")
    return TOOL_PARSERS[parser_name]()


def tool_call_stream(choice: ToolChoice, parser: ToolParser) -> ToolCallStream:
    """Streams the answer: each call's name as soon as it is written, then its arguments as they come."""
    return ToolCallStream(parser, tool_names(choice))


def finish_reason(reason: str | None, calls: list[ToolCall], choice: ToolChoice | None) -> str | None:
    """``tool_calls`` when the model stopped after calling tools it chose to call (auto, required); a named
    function's call ends with ``stop``, as OpenAI's forced calls do."""
    if calls and reason == "stop" and choice is not None and choice.mode != NAMED:
        return "tool_calls"
    return reason


def apply_tool_calls(choice_body: dict, text: str, parser: ToolParser, choice: ToolChoice) -> None:
    """Rewrite a chat response's choice (``{"message": ..., "finish_reason": ...}``) with the calls in ``text``."""
    content, calls = parser.parse(text, tool_names(choice))
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.message() for c in calls]
    choice_body["message"] = message
    choice_body["finish_reason"] = finish_reason(choice_body.get("finish_reason"), calls, choice)
