"""``llama3_json``: the whole answer is one or more JSON objects ``{"name": ..., "parameters": {...}}``
(``arguments`` is read too), separated by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1, 3.2 and 3.3's
JSON tool calling). An answer that starts otherwise is content, streamed as it comes; one that starts with
``{`` is held until it ends, and is content after all when it does not parse."""
from __future__ import annotations

from .base import Segment, ToolParser, call_from_json, json_values

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    keeps_special_tokens = True

    def scan(self, text: str, start: int, final: bool) -> tuple[list[Segment], int]:
        if start:           # an earlier scan found the answer to be content: so is the rest
            return ([text[start:]] if len(text) > start else []), len(text)
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        could_be_call = body.startswith("{") or not body or PYTHON_TAG.startswith(text.lstrip())
        if not could_be_call:
            return [text], len(text)
        if not final:
            return [], 0
        values = json_values(body)
        calls = [call_from_json(v) for v in values or []]
        if values and all(c is not None for c in calls):
            return [c for c in calls if c is not None], len(text)
        return ([text] if text else []), len(text)
