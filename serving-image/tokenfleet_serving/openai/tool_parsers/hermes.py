"""``hermes``: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, after
optional content (Hermes 2 Pro, Qwen2.5 and Qwen3 write them so; vLLM serves Qwen2.5 with this parser too).
Each block streams as soon as it closes; a block that does not parse stays content, and so does an unclosed
last block that does not."""
from __future__ import annotations

import json

from .base import Segment, ToolParser, call_from_json, partial_marker_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, start: int, final: bool) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        i = start
        while True:
            opened = text.find(OPEN, i)
            if opened < 0:
                keep = 0 if final else partial_marker_suffix(text[i:], OPEN)
                if len(text) - keep > i:
                    segments.append(text[i:len(text) - keep])
                return segments, len(text) - keep
            if opened > i:
                segments.append(text[i:opened])
            end = text.find(CLOSE, opened)
            if end < 0 and not final:
                return segments, opened
            body = text[opened + len(OPEN):end if end >= 0 else len(text)]
            stop = end + len(CLOSE) if end >= 0 else len(text)
            try:
                call = call_from_json(json.loads(body))
            except (ValueError, RecursionError):     # not JSON, or nested past the parser's stack
                call = None
            segments.append(call if call is not None else text[opened:stop])
            i = stop
