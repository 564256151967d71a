"""Calls written one after another as JSON, read while they are being written: a list ``[{call}, {call}]``
(``required`` tool choice, ``mistral``), objects separated by ``;`` (``llama3_json``), or a named function's
arguments alone. Each call is a :class:`CallReader`; the sequence knows where the calls are, whether the text
is still a sequence of calls (``broken``: it is not) and whether it has ended as one (``finished``).
"""
from __future__ import annotations

from collections.abc import Collection

from .call_reader import CallReader, skip_space

ARRAY = "array"                      # [ call, call, ... ]
ARRAY_OR_OBJECT = "array_or_object"  # mistral: a list of calls, or one call
OBJECTS = "objects"                  # llama3_json: call; call ... until the end of the answer
ARGUMENTS = "arguments"              # a named function: its arguments object is the whole text
MAX_CALLS = 1024                     # calls read from one answer; the rest is dropped (a cut, not content)


class CallSequence:
    def __init__(self, start: int, mode: str, names: Collection[str] | None, function: str | None = None):
        self.mode, self.names, self.function = mode, names, function
        self.pos = start
        self.readers: list[CallReader] = []
        self.broken = self.done = False
        self.end: int | None = None      # just after the sequence, once done
        self._phase = "begin"
        self._bracket = False
        self._reported = 0               # readers before this one are finished and were reported

    @property
    def opened(self) -> bool:
        """A call of this sequence has been sent (its name): its text is calls, whatever follows."""
        return bool(self.readers) and self.readers[0].opened     # a later call follows a complete one

    def finished(self) -> bool:
        """The sequence ended as a whole sequence of calls (``objects``: none is left half written)."""
        if self.mode == OBJECTS:
            return bool(self.readers) and self._phase in ("item", "after_item") and self.readers[-1].closed
        return self.done

    def advance(self, text: str) -> list[CallReader]:
        """Reads as far as the text goes; the calls that may have moved since the last time."""
        while not (self.broken or self.done) and self._move(text):
            pass
        moved = self.readers[self._reported:]
        self._reported = max(self._reported, len(self.readers) - 1)
        return moved

    def _move(self, text: str) -> bool:
        if self._phase == "in_item":
            reader = self.readers[-1]
            reader.advance(text)
            if reader.broken:
                self.broken = True
            if not reader.closed:
                return False
            self._phase, self.pos = "after_item", reader.end
            if self.mode in (ARGUMENTS, ARRAY_OR_OBJECT) and not self._bracket:
                self.done, self.end = True, reader.end
            return not self.done
        pos = skip_space(text, self.pos)
        while self.mode == OBJECTS and self._phase == "item" and pos < len(text) and text[pos] == ";":
            pos = skip_space(text, pos + 1)
        if pos >= len(text):
            return False
        c = text[pos]
        if self._phase == "begin" and c == "[" and self.mode in (ARRAY, ARRAY_OR_OBJECT):
            self._bracket, self._phase, self.pos = True, "item", pos + 1
        elif len(self.readers) >= MAX_CALLS:
            self.broken = True
        elif (c == "{" or self.mode == ARGUMENTS) and (self._phase == "item" or self._phase == "begin"
                                                        and self.mode != ARRAY):
            self.readers.append(CallReader(pos, self.names, self.function))
            self._phase = "in_item"
        elif self._phase == "after_item" and self._bracket and c in ",]":
            self._phase, self.pos = "item", pos + 1
            self.done, self.end = c == "]", pos + 1
        elif self._phase == "after_item" and self.mode == OBJECTS and c in ";{":
            self._phase, self.pos = "item", pos
        else:
            self.broken = True
        return not (self.broken or self.done)
