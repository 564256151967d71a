"""The child process that tries each client grammar first (``sandbox.py`` starts it): a grammar that crashes
llguidance's native code kills this process, not the server.

``python -m tokenfleet_serving.engine.structured.compile_worker TOKENIZER_FILE VOCAB_SIZE EOS_IDS``; one JSON
request a line on stdin (``{"kind", "value", "choices", "strict", "param"}``), one JSON answer a line on stdout:
``{"ok": true}`` or ``{"error": "why"}``. The compile runs on a thread with ``STACK_BYTES`` of stack, the
size the server's compile threads get too (``compiler.py``), so what passes here does not overflow there.
The process ends when its stdin does: with the server.
"""
from __future__ import annotations

import json
import sys
import threading

from .sandbox import STACK_BYTES


def _spec(req: dict):
    """The spec as the server sent it, not checked again: the server's bounds (spec.py) passed it, and what
    this process is for is what gets past them."""
    from .spec import StructuredOutputSpec

    spec = object.__new__(StructuredOutputSpec)
    for name, value in (("kind", str(req["kind"])), ("value", str(req["value"])), ("strict", bool(req["strict"])),
                        ("choices", tuple(str(c) for c in req["choices"])), ("param", str(req["param"]))):
        object.__setattr__(spec, name, value)
    return spec


def _answer(checker, line: str) -> dict:
    from .spec import StructuredOutputError

    try:
        checker.build(_spec(json.loads(line)))
        return {"ok": True}
    except StructuredOutputError as e:
        return {"error": e.message}
    except Exception as e:  # noqa: BLE001 - a request this worker cannot read is refused, the worker goes on
        return {"error": f"the compile failed: {type(e).__name__}"}


def main(argv: list[str]) -> int:
    from .compiler import GrammarBuilder

    tokenizer_file, vocab_size, eos = argv[0], int(argv[1]), tuple(int(t) for t in argv[2].split(",") if t)
    builder = GrammarBuilder(tokenizer_file, vocab_size, eos)
    out = sys.stdout
    for line in sys.stdin:
        result: dict = {}
        worker = threading.Thread(target=lambda r=result, text=line: r.update(_answer(builder, text)),
                                  name="grammar-check")
        worker.start()
        worker.join()
        out.write(json.dumps(result or {"error": "the compile failed"}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    threading.stack_size(STACK_BYTES)
    sys.exit(main(sys.argv[1:]))
