"""``llama3_json``: the whole answer is one or more JSON objects ``{"name": ..., "parameters": {...}}``
(``arguments`` is read too), separated by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1, 3.2 and 3.3's
JSON tool calling). An answer that starts otherwise is content, streamed as it comes; one that starts with
``{`` streams its calls as they are written, and is content after all when it is no call."""
from __future__ import annotations

from collections.abc import Collection

from .base import CONTENT, Item, ScanState, ToolParser, read_sequence, rest
from .call_reader import skip_space
from .call_sequence import OBJECTS, CallSequence

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    keeps_special_tokens = True

    def advance(self, state: ScanState, text: str, final: bool, names: Collection[str] | None) -> list[Item]:
        if state.mode:
            return rest(state, text)
        if state.calls is None:
            begin = skip_space(text, 0)
            if text.startswith(PYTHON_TAG, begin):
                begin = skip_space(text, begin + len(PYTHON_TAG))
            elif PYTHON_TAG.startswith(text[begin:]) and not final:
                return []                                   # the tag may be coming
            if begin >= len(text) and not final:
                return []
            if begin >= len(text) or text[begin] != "{":
                state.mode = CONTENT
                return rest(state, text)
            state.calls = CallSequence(begin, OBJECTS, names)
        return read_sequence(state, text, final)
