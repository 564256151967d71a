"""What every tool-call parser shares: the calls it finds, and how a text is cut into content and calls, whole
or while it streams.

A parser's :meth:`ToolParser.advance` reads the growing text of one answer from where it stopped (its state,
kept by the :class:`ToolCallStream`) and returns what it is sure of: content, and the calls being written
(:class:`CallReader`). A call streams as soon as its name is known (a delta with its index, id, type and
name), then its arguments as they are generated, as vLLM and OpenAI stream them. The same reading serves a
whole answer (one push of all of it) and a stream (a push per delta), so both cut the text the same way.

- Text that looks like a call but is none (not JSON, no name, a function the request does not have) stays
  content: a model's malformed call reaches the client as its words, never as an error.
- A call cut short (``finish_reason: length``, or an answer that ends inside it) is not content either: a
  stream has sent its name and its arguments so far; a whole answer leaves it out and keeps the complete
  calls before it.
"""
from __future__ import annotations

import secrets
import string
from collections.abc import Collection
from dataclasses import dataclass, field

from .call_reader import CallReader
from .call_sequence import CallSequence

Item = str | CallReader          # settled content, or a call being read


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                  # a JSON object, encoded, as OpenAI sends it
    id: str = field(default_factory=lambda: new_call_id())

    def message(self) -> dict:
        """The call in an assistant message's ``tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def mistral_call_id() -> str:
    """Mistral's templates take 9 letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def partial_marker_suffix(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest end of ``text[start:]`` that is a beginning of ``marker`` (held back while
    streaming)."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@dataclass
class ScanState:
    """Where one answer's reading stands (a parser is shared by the choices of a request; this is not)."""
    pos: int = 0                       # the text before this is settled
    mode: str = ""                     # "" reading; CONTENT: the rest is content; DROP: the rest is dropped
    block: int = 0                     # where the calls being read began (their text, if they are none)
    reader: CallReader | None = None   # hermes: the call of the open block
    calls: CallSequence | None = None  # the calls being read, for the parsers that write several together
    search: int = 0                    # hermes: where to look for the closing marker next
    count: int = 0                     # hermes: the call blocks opened


CONTENT, DROP = "content", "drop"


def content_to_marker(state: ScanState, text: str, marker: str, final: bool) -> tuple[list[Item], int]:
    """Content up to ``marker`` (its index, or -1 when it has not come: an end that could begin it is held)."""
    at = text.find(marker, state.pos)
    end = at if at >= 0 else len(text) - (0 if final else partial_marker_suffix(text, marker, state.pos))
    items: list[Item] = [text[state.pos:end]] if end > state.pos else []
    state.pos = max(state.pos, end)
    return items, at


def rest(state: ScanState, text: str) -> list[Item]:
    """After the calls: the rest of the answer is content, or dropped (after calls that broke off)."""
    items: list[Item] = [text[state.pos:]] if state.mode == CONTENT and len(text) > state.pos else []
    state.pos = len(text)
    return items


def read_sequence(state: ScanState, text: str, final: bool) -> list[Item]:
    """Advance ``state.calls``: the calls that moved, and what their text turned out to be when it is no
    sequence of calls after all (content, when no call had been sent) or when it ends."""
    seq = state.calls
    assert seq is not None
    items: list[Item] = list(seq.advance(text))
    if seq.broken and not seq.opened:         # no call at all: the model's words
        state.mode, state.pos = CONTENT, state.block
    elif seq.broken or (final and not seq.finished()):   # a call broke off or was cut: the rest is no content
        state.mode = DROP
    elif seq.done:
        state.mode, state.pos = CONTENT, seq.end or state.pos
    else:
        return items
    return items + rest(state, text)


class ToolParser:
    """Reads a model's tool calls out of its text. Subclasses implement :meth:`advance`."""

    name = ""
    # The call markers are special tokens, which detokenization would drop: keep them in the text.
    keeps_special_tokens = False
    make_id = staticmethod(new_call_id)

    def advance(self, state: ScanState, text: str, final: bool, names: Collection[str] | None) -> list[Item]:
        """What ``text[state.pos:]`` settles (``final``: the answer is complete); ``names``: the request's
        functions (None: any)."""
        raise NotImplementedError

    def parse(self, text: str, names: Collection[str] | None = None) -> tuple[str | None, list[ToolCall]]:
        """A whole answer: its content (None when it is only calls) and its complete calls."""
        stream = ToolCallStream(self, names)
        stream.push(text, final=True)
        if stream.calls:
            return stream.content.strip() or None, stream.calls
        return stream.content or None, []


@dataclass
class _Sent:
    index: int
    id: str
    arguments: int = 0      # characters of the arguments sent
    complete: bool = False


class ToolCallStream:
    """Streams one answer's content and tool calls as OpenAI's deltas."""

    def __init__(self, parser: ToolParser, names: Collection[str] | None = None):
        self.parser, self.names = parser, names
        self.state = ScanState()
        self.text = ""
        self.content = ""
        self.calls: list[ToolCall] = []          # the complete calls, in order
        self._sent: dict[CallReader, _Sent] = {}

    def push(self, delta: str, final: bool = False) -> list[dict]:
        """The chat ``delta`` objects for this much more text (``final``: the answer is complete)."""
        text, self.text = self.text, ""
        text += delta             # in place: the attribute no longer holds it (a long answer is not copied per delta)
        self.text = text
        out: list[dict] = []
        for item in self.parser.advance(self.state, self.text, final, self.names):
            if isinstance(item, CallReader):
                out += self._follow(item)
            elif item and not (self._sent and not item.strip()):
                out.append({"content": item})
                self.content += item
        return out

    def _follow(self, reader: CallReader) -> list[dict]:
        sent = self._sent.get(reader)
        out: list[dict] = []
        if sent is None:
            if not reader.opened or reader.name is None:
                return out
            sent = self._sent[reader] = _Sent(len(self._sent), self.parser.make_id())
            out.append({"tool_calls": [{"index": sent.index, "id": sent.id, "type": "function",
                                        "function": {"name": reader.name, "arguments": ""}}]})
        more = reader.arguments_after(self.text, sent.arguments)
        if more:
            sent.arguments += len(more)
            out.append({"tool_calls": [{"index": sent.index, "function": {"arguments": more}}]})
        if reader.complete and not sent.complete and reader.name is not None and reader.arguments is not None:
            sent.complete = True
            self.calls.append(ToolCall(reader.name, reader.arguments, sent.id))
        return out
