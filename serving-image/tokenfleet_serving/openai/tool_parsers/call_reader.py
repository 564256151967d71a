"""Reading one tool call's JSON object while it is being written: ``{"name": N, "arguments": {...}}`` (or
``"parameters"``), so that a stream can send the call's name as soon as it is known and its arguments as they
are generated.

A :class:`CallReader` is fed the growing text again and again and resumes where it stopped, so a call of any
length is read once (skips to the next quote or bracket, not a character at a time). It knows:

- ``opened``: the name is complete and names a function of the request, and the arguments have begun as an
  object (or the call ended without arguments): the stream sends the call's id and name now;
- :meth:`arguments_span`: the part of the text that holds the arguments so far, to stream as it grows;
- ``complete``: the name and the whole arguments object are there and the arguments are a JSON object;
- ``closed``: the call object itself has ended (its ``}``), and ``end`` is just after it;
- ``broken``: the text is no call (not an object, a name that is not a string or not one of the request's
  functions, arguments that are not an object, JSON that does not parse).

Arguments given as an encoded string (``"arguments": "{\\"a\\": 1}"``, as some models write them) are decoded
when the string is complete and sent in one piece.
"""
from __future__ import annotations

import json
import re
from collections.abc import Collection

NAME_KEY = "name"
ARGUMENTS_KEYS = ("arguments", "parameters")
MAX_NAME_CHARS = 256               # a function name is at most 64 characters; longer is no call of this request
MAX_DEPTH = 512                    # arguments nested deeper are no JSON the server decodes (nor a client)
_STRING_STOP = re.compile(r'["\\]')
_NESTED_STOP = re.compile(r'["\\{}\[\]]')
_NOT_SPACE = re.compile(r"\S")
_SCALAR_END = re.compile(r"[\s,}\]]")
_CLOSING = {"{": "}", "[": "]"}


def skip_space(text: str, pos: int) -> int:
    m = _NOT_SPACE.search(text, pos)
    return m.start() if m else len(text)


class ValueScan:
    """Finds where one JSON value ends (strings and brackets; the value's JSON is checked by whoever decodes
    it). ``start`` is its first character; ``pos`` how far it has been read; ``end`` set once it is whole."""

    def __init__(self, start: int):
        self.start = self.pos = start
        self.stack: list[str] = []
        self.in_string = False
        self.end: int | None = None
        self.broken = False

    def advance(self, text: str) -> None:
        if self.end is not None or self.broken:
            return
        if self.pos == self.start:
            if self.pos >= len(text):
                return
            first = text[self.pos]
            if first == '"':
                self.in_string, self.pos = True, self.pos + 1
            elif first in _CLOSING:
                self.stack.append(_CLOSING[first])
                self.pos += 1
            else:                                       # a number, true, false, null (or junk)
                m = _SCALAR_END.search(text, self.pos)
                if m and m.start() > self.pos:
                    self.pos = self.end = m.start()
                elif m:
                    self.broken = True
                return
        self._scan(text)

    def _scan(self, text: str) -> None:
        while self.end is None:
            m = (_STRING_STOP if self.in_string else _NESTED_STOP).search(text, self.pos)
            if m is None:
                self.pos = len(text)
                return
            c = m.group()
            if c == "\\":
                if m.end() >= len(text):          # the escaped character has not come yet
                    self.pos = m.start()
                    return
                self.pos = m.end() + 1
            elif c == '"':
                self.in_string = not self.in_string
                self.pos = m.end()
                if not self.in_string and not self.stack:
                    self.end = self.pos
            elif c in _CLOSING:
                self.stack.append(_CLOSING[c])
                self.pos = m.end()
                if len(self.stack) > MAX_DEPTH:
                    self.broken = True
                    return
            else:
                if not self.stack or self.stack.pop() != c:
                    self.broken = True
                    return
                self.pos = m.end()
                if not self.stack:
                    self.end = self.pos


def _decode(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):          # not JSON, or nested past the parser's stack
        return None


class CallReader:
    """One call object from ``start`` on (``{`` after optional whitespace). ``names``: the request's functions
    (None: any name). ``function``: the text is a named function's arguments object alone."""

    def __init__(self, start: int, names: Collection[str] | None = None, function: str | None = None):
        self.names = names
        self.name: str | None = function
        self.arguments: str | None = None          # set when complete: the arguments, as JSON text
        self.opened = self.complete = self.closed = self.broken = False
        self.end = start
        self._bare = function is not None          # no call object around the arguments
        self._pos = start
        self._state = "value" if self._bare else "open"
        self._key: str | None = ARGUMENTS_KEYS[0] if self._bare else None
        self._value: ValueScan | None = None
        self._args: ValueScan | None = None
        self._encoded = False                      # the arguments came as a string holding their JSON

    def arguments_after(self, text: str, sent: int) -> str:
        """The arguments read since the first ``sent`` characters (the model's own JSON text as it grows;
        an encoded string, or no arguments at all, once the call is complete)."""
        a = self._args
        if not self.opened:
            return ""
        if a is None or self._encoded:
            return (self.arguments or "")[sent:]
        return text[a.start + sent:a.end if a.end is not None else a.pos]

    def advance(self, text: str) -> None:
        while not (self.closed or self.broken):
            if not self._step(text):
                return

    def _fail(self) -> bool:
        self.broken = True
        return False

    def _step(self, text: str) -> bool:
        """One move of the reader; False when it needs more text (or is done)."""
        if self._state == "value":
            return self._read_value(text)
        pos = skip_space(text, self._pos)
        if pos >= len(text):
            return False
        c = text[pos]
        if self._state == "open":
            self._state, self._pos = "key", pos + 1
            return c == "{" or self._fail()
        if self._state in ("key", "next"):
            if c == "}":
                return self._close(pos + 1)
            if self._state == "next":
                self._state, self._pos = "key", pos + 1
                return c == "," or self._fail()
            if c != '"':
                return self._fail()
            self._state, self._value = "key_string", ValueScan(pos)
            return True
        if self._state == "key_string":
            assert self._value is not None
            self._value.advance(text)
            if self._value.end is None:
                return self._fail() if self._value.broken else False
            key = _decode(text[self._value.start:self._value.end])
            self._key, self._state, self._pos = (key if isinstance(key, str) else None), "colon", self._value.end
            return True
        # "colon"
        self._state, self._pos, self._value = "value", pos + 1, None
        return c == ":" or self._fail()

    def _read_value(self, text: str) -> bool:
        if self._value is None:
            pos = skip_space(text, self._pos)
            if pos >= len(text):
                return False
            self._value = ValueScan(pos)
            if self._key in ARGUMENTS_KEYS and self._args is None:
                if text[pos] not in '{"':
                    return self._fail()
                self._args = self._value
        v = self._value
        v.advance(text)
        self.opened = self.opened or (self.name is not None and v is self._args and text[v.start] == "{")
        if v.broken:
            return self._fail()
        if self._key == NAME_KEY and self.name is None and v.end is None and v.pos - v.start > MAX_NAME_CHARS:
            return self._fail()
        if v.end is None:
            return False
        self._state, self._pos, self._value = "next", v.end, None
        if v is self._args:
            return self._take_arguments(text[v.start:v.end]) or self._fail()
        if self._key == NAME_KEY and self.name is None:
            name = _decode(text[v.start:v.end])
            if not isinstance(name, str) or not name or self.names is not None and name not in self.names:
                return self._fail()
            self.name = name
            self.complete = self.arguments is not None
            self.opened = self.opened or self.complete
        return True

    def _take_arguments(self, raw: str) -> bool:
        value = _decode(raw)
        if isinstance(value, str) and raw.startswith('"'):
            value, self._encoded = _decode(value), True
            try:
                raw = json.dumps(value, ensure_ascii=False)
            except (ValueError, RecursionError):      # nested past the encoder's stack
                return False
        if not isinstance(value, dict):
            return False
        self.arguments = raw
        self.complete = self.name is not None
        if self._bare:
            self.opened = self.closed = True
            self.end = self._pos
        elif self.complete:
            self.opened = True
        return True

    def _close(self, end: int) -> bool:
        if self.name is None:
            return self._fail()
        if self.arguments is None:
            self.arguments = "{}"
        self.opened = self.complete = self.closed = True
        self.end = end
        return False
