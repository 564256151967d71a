"""Compile structured-output specs into grammars with llguidance, off the engine's step thread.

llguidance (not xgrammar) because it kept to the schema on everything the tests and the benchmark try: xgrammar
0.2.9 turns a string's ``maxLength`` into ``[^"\\\r\n]{0,N}``, which lets control characters into the string
(so about half of the random-weight model's outputs were not JSON), while llguidance's outputs all validated.
Both install from PyPI as wheels and need no GPU; docs/results/structured.md has the measurements.

Bounds:
* shape: ``spec.py`` refuses grammars and schemas deeper than ``bounds.py`` allows before anything compiles;
* crashes: a spec is first compiled in a child process (``sandbox.py``); only what compiled there is compiled
  here, on threads with the child's stack size, so a grammar that crashes llguidance costs one request;
* time: the caller waits at most ``timeout_s``, and a child still compiling then is killed; llguidance's own
  fuel limits (``LIMITS``) stop a compile and every later mask computation from running away;
* clients: at most ``max_pending_per_client`` compiles wait per client and ``max_pending`` in all
  (:class:`CompileQueueFull`, a 429); a spec that failed (other than by time) is answered from the failure
  cache at once;
* memory: at most ``cache_size`` compiled grammars (and as many failures) are kept, least recently used
  dropped first.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import llguidance
from llguidance import LLMatcher, LLTokenizer

from .sandbox import STACK_BYTES, CompileSandbox, CompileTimeout
from .spec import StructuredOutputError, StructuredOutputSpec

log = logging.getLogger("tokenfleet.engine.structured")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 256
DEFAULT_WORKERS = 2                  # child processes (and threads) compiling at once
DEFAULT_PENDING_PER_CLIENT = 4       # compiles one client may have waiting
DEFAULT_PENDING = 64                 # compiles waiting in all
# llguidance's defaults, with the per-step work cut so that one token's mask stays in milliseconds
LIMITS = dict(step_lexer_fuel=100_000, step_max_items=20_000, max_grammar_size=200_000, verbose_errors=False)


def llguidance_grammar(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar of a spec. ``strict`` false: JSON-schema keywords llguidance does not implement are
    ignored (lenient); strict: they make the schema an error. Whitespace is never free: compact JSON."""
    if spec.kind in ("json_schema", "json_object"):
        schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
        options = {"whitespace_flexible": False, "lenient": not spec.strict}
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)     # type: ignore[arg-type]
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", list(spec.choices))             # type: ignore[arg-type]
    return llguidance.grammar_from("grammar", spec.value)                       # Lark, or GBNF/EBNF (::=)


@dataclass
class CompiledGrammar:
    """A checked grammar and a matcher at its start; each request takes a copy of the matcher."""
    spec: StructuredOutputSpec
    prototype: LLMatcher
    compile_seconds: float

    def new_matcher(self) -> LLMatcher:
        return self.prototype.deep_copy()


class CompileQueueFull(StructuredOutputError):
    """Too many compiles wait (for this client, or in all): a 429, the client may retry later."""
    status = 429


@dataclass
class CompilerStats:
    compiles: int = 0
    cache_hits: int = 0
    failures: int = 0
    failure_hits: int = 0         # answered from the failure cache
    timeouts: int = 0
    refused_busy: int = 0         # CompileQueueFull
    compile_seconds: float = 0.0


class GrammarBuilder:
    """Compiles one spec (no cache, no pool): the work both the sandbox's children and the server do."""

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = LLTokenizer(tokenizer_file, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.limits = llguidance.LLParserLimits(**LIMITS)                       # type: ignore[arg-type]

    def build(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        started, what = time.perf_counter(), spec.kind.replace("_", " ")
        try:
            grammar = llguidance_grammar(spec)
        except (ValueError, TypeError, RecursionError) as e:
            raise StructuredOutputError(spec.param, f"cannot compile the {what}: {e}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=self.limits)
        if is_error:
            raise StructuredOutputError(spec.param, f"cannot compile the {what}: {_first_line(messages)}")
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        probe = matcher.deep_copy()
        probe.compute_bitmask()         # the first token's mask: a grammar past the per-token limits fails here
        for m in (matcher, probe):
            if m.is_error():
                raise StructuredOutputError(spec.param, f"cannot compile the {what}: {_first_line([m.get_error()])}")
        return CompiledGrammar(spec, matcher, time.perf_counter() - started)


class GrammarCompiler:
    """Thread-safe: ``submit`` never blocks; ``compile`` may wait ``timeout_s`` (never on the step thread).
    ``client`` names who asked (an API key's hash or a peer), for the per-client bound."""

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_token_ids: tuple[int, ...], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cache_size: int = DEFAULT_CACHE_SIZE,
                 workers: int = DEFAULT_WORKERS, max_pending_per_client: int = DEFAULT_PENDING_PER_CLIENT,
                 max_pending: int = DEFAULT_PENDING, isolate: bool = True):
        if timeout_s <= 0 or cache_size < 1 or workers < 1 or max_pending_per_client < 1 or max_pending < 1:
            raise ValueError("timeout_s must be > 0; cache_size, workers and the pending bounds >= 1")
        self.builder = GrammarBuilder(tokenizer_file, vocab_size, eos_token_ids)
        self.tokenizer, self.limits = self.builder.tokenizer, self.builder.limits
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.max_pending_per_client, self.max_pending = max_pending_per_client, max_pending
        self.stats = CompilerStats()
        self.sandbox = CompileSandbox(tokenizer_file, vocab_size, eos_token_ids, workers) if isolate else None
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._failed: OrderedDict[tuple, StructuredOutputError] = OrderedDict()
        self._pending: dict[tuple, cf.Future] = {}
        self._waiting: Counter[str] = Counter()                       # compiles waiting, per client
        self._waiters: dict[tuple, Counter[str]] = {}                 # the clients waiting for each pending key
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")

    def submit(self, spec: StructuredOutputSpec, client: str = "") -> cf.Future:
        """A future of the compiled grammar of ``spec`` (done at once when cached). Raises the cached
        StructuredOutputError of a spec that failed before, and CompileQueueFull past the pending bounds."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                done: cf.Future = cf.Future()
                done.set_result(hit)
                return done
            failed = self._failed.get(key)
            if failed is not None:
                self._failed.move_to_end(key)
                self.stats.failure_hits += 1
                raise StructuredOutputError(spec.param, failed.message)
            self._admit(spec, client)
            future = self._pending.get(key)
            if future is None:
                future = self._start(spec)
                self._pending[key] = future
            self._waiting[client] += 1
            self._waiters.setdefault(key, Counter())[client] += 1
        return future

    def compile(self, spec: StructuredOutputSpec, client: str = "") -> CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); StructuredOutputError naming ``spec.param`` if it is
        invalid or not compiled within ``timeout_s``."""
        future = self.submit(spec, client)
        try:
            return future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            raise self.timed_out(spec) from None

    def timed_out(self, spec: StructuredOutputSpec) -> StructuredOutputError:
        with self._lock:
            self.stats.timeouts += 1
        return StructuredOutputError(spec.param, f"the grammar did not compile within {self.timeout_s:g} s")

    def _admit(self, spec: StructuredOutputSpec, client: str) -> None:
        """Under the lock: refuse a compile past the per-client or the total bound."""
        if self._waiting[client] >= self.max_pending_per_client:
            why = f"this client already has {self._waiting[client]} grammar compiles waiting"
        elif sum(self._waiting.values()) >= self.max_pending:
            why = f"{sum(self._waiting.values())} grammar compiles are waiting"
        else:
            return
        self.stats.refused_busy += 1
        raise CompileQueueFull(spec.param, f"{why}; retry when they are done")

    def _start(self, spec: StructuredOutputSpec) -> cf.Future:
        """Under the lock: a pool thread created now gets the child's stack size (compile_worker.py)."""
        previous = threading.stack_size(STACK_BYTES)
        try:
            return self._pool.submit(self._build, spec)
        finally:
            threading.stack_size(previous)

    def _release(self, key: tuple) -> None:
        """Under the lock, before the future is done: its waiters no longer count against their clients."""
        self._pending.pop(key, None)
        self._waiting.subtract(self._waiters.pop(key, Counter()))
        for client in [c for c, n in self._waiting.items() if n <= 0]:
            del self._waiting[client]

    def _build(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        key = spec.key
        try:
            if self.sandbox is not None:
                self.sandbox.check(spec, self.timeout_s)
            compiled = self.builder.build(spec)
            with self._lock:
                self._cache[key] = compiled
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
                self.stats.compiles += 1
                self.stats.compile_seconds += compiled.compile_seconds
            return compiled
        except CompileTimeout:
            with self._lock:
                self.stats.timeouts += 1
            raise
        except StructuredOutputError as e:
            with self._lock:
                self.stats.failures += 1
                self._failed[key] = e
                while len(self._failed) > self.cache_size:
                    self._failed.popitem(last=False)
            raise
        except BaseException:
            with self._lock:
                self.stats.failures += 1
            raise
        finally:
            with self._lock:
                self._release(key)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._failed.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.sandbox is not None:
            self.sandbox.close()


def _first_line(messages: list[str]) -> str:
    text = next((m for m in messages if m), "invalid grammar")
    return text.strip().splitlines()[0][:500]
