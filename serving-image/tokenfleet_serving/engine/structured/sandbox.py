"""Child processes that compile a client's grammar before the server does (``compile_worker.py`` is their
main): llguidance compiles in native code, where a grammar that overflows its stack is a SIGSEGV, so the first
compile of every spec happens where a crash costs one process, not every stream of the replica.

A child that dies on a spec makes that spec a :class:`StructuredOutputError` (a 400 naming the field); one
that is still compiling at the deadline is killed (the same error, "did not compile in time"); either way the
next check starts a fresh child. A child that cannot start at all (it exits without a signal) is
:class:`SandboxUnavailable`, a 503: the server is at fault, not the grammar.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from .spec import StructuredOutputError, StructuredOutputSpec

log = logging.getLogger("tokenfleet.engine.structured")

STACK_BYTES = 16 * 2**20       # of the threads that compile, here and in the children
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])     # holds tokenfleet_serving/


class CompileTimeout(StructuredOutputError):
    """Still compiling at the deadline: not cached as the spec's failure, the host may just have been busy."""


class SandboxUnavailable(RuntimeError):
    """No child could compile the spec for a reason of the server's own (a 503)."""


class _Child:
    """One compile_worker process and the buffer of what it has written."""

    def __init__(self, argv: list[str]):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))
                                                           if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenfleet_serving.engine.structured.compile_worker",
                                      *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        self._buffer = b""
        self.timed_out = False

    def ask(self, request: dict, deadline: float) -> dict | None:
        """The child's answer; None when it died or the deadline passed (it is killed then)."""
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")          # type: ignore[union-attr]
            self.proc.stdin.flush()                                              # type: ignore[union-attr]
        except OSError:
            return None
        fd = self.proc.stdout.fileno()                                           # type: ignore[union-attr]
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.timed_out = True
                    self.kill()
                    return None
                if not sel.select(min(left, 60.0)):        # a huge timeout must not overflow the poll
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.proc.wait()
                    return None
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def died_of_signal(self) -> str | None:
        code = self.proc.poll()
        if code is None or code >= 0:
            return None
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class CompileSandbox:
    """``workers`` children, started at once (the tokenizer loads while the server goes on); ``check`` may be
    called from up to ``workers`` threads at a time (the compiler's pool), each taking one child."""

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_token_ids: tuple[int, ...], workers: int):
        self.argv = [tokenizer_file, str(vocab_size), ",".join(str(t) for t in eos_token_ids)]
        self.crashes = 0
        self._idle: queue.Queue[_Child] = queue.Queue()
        for _ in range(workers):
            self._idle.put(_Child(self.argv))

    def check(self, spec: StructuredOutputSpec, timeout_s: float) -> None:
        """Returns when ``spec`` compiles in a child; StructuredOutputError naming ``spec.param`` when it does
        not, crashes the child or takes longer than ``timeout_s``."""
        child = self._idle.get()
        try:
            if not child.alive:
                child = _Child(self.argv)
            answer = child.ask({"kind": spec.kind, "value": spec.value, "choices": list(spec.choices),
                                "strict": spec.strict, "param": spec.param}, time.monotonic() + timeout_s)
            if answer is not None:
                if "error" in answer:
                    raise StructuredOutputError(spec.param, str(answer["error"]))
                return
            if child.timed_out:
                raise CompileTimeout(spec.param, f"the grammar did not compile within {timeout_s:g} s")
            crash = child.died_of_signal()
            if crash is not None:
                self.crashes += 1
                log.warning("the grammar compiler crashed (%s) on a client's %s; that request is refused and the "
                            "compiler restarted", crash, spec.param)
                raise StructuredOutputError(spec.param, f"the {spec.kind.replace('_', ' ')} crashed the grammar "
                                                        f"compiler ({crash}); simplify it")
            raise SandboxUnavailable(f"the grammar compiler exited with status {child.proc.returncode}")
        finally:
            self._idle.put(child if child.alive else _Child(self.argv))

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return
