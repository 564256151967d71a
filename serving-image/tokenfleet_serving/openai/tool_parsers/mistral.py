"""``mistral``: ``[TOOL_CALLS]`` and then a JSON list of ``{"name": ..., "arguments": {...}}`` (Mistral 7B v0.3,
Mistral Nemo and Small), after optional content. ``[TOOL_CALLS]`` is a special token, so the answer is
detokenized with special tokens kept. Call ids are 9 letters and digits, which Mistral's templates require
when the calls come back in the conversation."""
from __future__ import annotations

from .base import MarkedToolParser, ToolCall, call_from_json, json_values, mistral_call_id


class MistralToolParser(MarkedToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def calls_after_marker(self, section: str) -> list[ToolCall] | None:
        values = json_values(section)
        if not values or len(values) != 1:
            return None
        items = values[0] if isinstance(values[0], list) else [values[0]]
        calls = [call_from_json(v, make_id=mistral_call_id) for v in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]
