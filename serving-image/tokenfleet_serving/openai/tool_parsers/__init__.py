"""Tool-call parsers by vLLM's names (``--tool-call-parser``, ``spec.engine.toolCallParser``): each reads the
calls a model family writes out of its text (``tool_choice`` ``auto``).

| name | format | models |
|---|---|---|
| ``hermes`` | ``<tool_call>{"name", "arguments"}</tool_call>`` blocks | Hermes 2 Pro, Qwen2.5, Qwen3 |
| ``llama3_json`` | the answer is ``{"name", "parameters"}`` (``;``-separated), after an optional ``<|python_tag|>`` | Llama 3.1-3.3 |
| ``mistral`` | ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` | Mistral 7B v0.3, Nemo, Small |

``required`` and named tool choices need no parser: their output is constrained JSON (``constrained.py``).
"""
from __future__ import annotations

from .base import ToolCall, ToolCallStream, ToolParser
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser
from .mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallStream", "ToolParser"]
