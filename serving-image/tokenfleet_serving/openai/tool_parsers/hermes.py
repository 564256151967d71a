"""``hermes``: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, after
optional content (Hermes 2 Pro, Qwen2.5 and Qwen3 write them so; vLLM serves Qwen2.5 with this parser too).
A block's call streams as soon as its name is known, then its arguments as they come; a block that is no
call (not JSON, no name, a function the request does not have) stays content."""
from __future__ import annotations

from collections.abc import Collection

from .base import DROP, Item, ScanState, ToolParser, content_to_marker, rest
from .call_reader import CallReader
from .call_sequence import MAX_CALLS

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def advance(self, state: ScanState, text: str, final: bool, names: Collection[str] | None) -> list[Item]:
        items: list[Item] = []
        while True:
            if state.mode:
                return items + rest(state, text)
            if state.reader is None:
                found, at = content_to_marker(state, text, OPEN, final)
                items += found
                if at < 0:
                    return items
                state.block, state.pos = at, at + len(OPEN)
                state.count += 1
                if state.count > MAX_CALLS:          # no more calls are read: the rest is dropped, as a cut
                    state.mode = DROP
                    continue
                state.reader = CallReader(state.pos, names)
                state.search = state.pos
            reader = state.reader
            reader.advance(text)
            items.append(reader)
            end = self._block_end(state, reader, text, final)
            if end is None:
                return items
            if reader.broken and not reader.opened:      # no call: the block is the model's words
                items.append(text[state.block:end])
            state.reader, state.pos = None, end

    @staticmethod
    def _block_end(state: ScanState, reader: CallReader, text: str, final: bool) -> int | None:
        """Where the block ends once its call is read (or is none); None while that needs more text."""
        if not (reader.closed or reader.broken):
            if not final:
                return None
            state.mode = DROP          # the answer ends inside the call: not content
            return len(text)
        close = text.find(CLOSE, max(state.search, reader.end if reader.closed else state.block))
        if close < 0 and not final:
            state.search = max(state.search, len(text) - len(CLOSE))
            return None
        return close + len(CLOSE) if close >= 0 else len(text)
