"""``mistral``: ``[TOOL_CALLS]`` and then a JSON list of ``{"name": ..., "arguments": {...}}`` (Mistral 7B v0.3,
Mistral Nemo and Small), after optional content. ``[TOOL_CALLS]`` is a special token, so the answer is
detokenized with special tokens kept. Each call streams as soon as its name is known. Call ids are 9 letters
and digits, which Mistral's templates require when the calls come back in the conversation."""
from __future__ import annotations

from collections.abc import Collection

from .base import Item, ScanState, ToolParser, content_to_marker, mistral_call_id, read_sequence, rest
from .call_sequence import ARRAY_OR_OBJECT, CallSequence

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True
    make_id = staticmethod(mistral_call_id)

    def advance(self, state: ScanState, text: str, final: bool, names: Collection[str] | None) -> list[Item]:
        if state.mode:
            return rest(state, text)
        items: list[Item] = []
        if state.calls is None:
            items, at = content_to_marker(state, text, MARKER, final)
            if at < 0:
                return items
            state.block, state.pos = at, at + len(MARKER)
            state.calls = CallSequence(state.pos, ARRAY_OR_OBJECT, names)
        return items + read_sequence(state, text, final)
