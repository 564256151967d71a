"""Compile structured-output specs into grammars with llguidance, off the engine's step thread.

llguidance (not xgrammar) because it kept to the schema on everything the tests and the benchmark try: xgrammar
0.2.9 turns a string's ``maxLength`` into ``[^"\\\r\n]{0,N}``, which lets control characters into the string
(so about half of the random-weight model's outputs were not JSON), while llguidance's outputs all validated.
Both install from PyPI as wheels and need no GPU; docs/results/structured.md has the measurements.

Bounds:
* time: a compile runs on a small worker pool and the caller waits at most ``timeout_s``
  (:class:`StructuredOutputError` after that, while the engine goes on serving the others); llguidance's own
  fuel limits (``LIMITS``) stop the worker's compile and every later mask computation from running away;
* memory: at most ``cache_size`` compiled grammars are kept, least recently used dropped first.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
from llguidance import LLMatcher, LLTokenizer

from .spec import StructuredOutputError, StructuredOutputSpec

log = logging.getLogger("tokenfleet.engine.structured")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 256
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


@dataclass
class CompilerStats:
    compiles: int = 0
    cache_hits: int = 0
    failures: int = 0
    timeouts: int = 0
    compile_seconds: float = 0.0


class GrammarCompiler:
    """Thread-safe: ``compile`` may be called from any thread but the step thread (it may wait ``timeout_s``)."""

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_token_ids: tuple[int, ...], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cache_size: int = DEFAULT_CACHE_SIZE, workers: int = 1):
        if timeout_s <= 0 or cache_size < 1 or workers < 1:
            raise ValueError("timeout_s must be > 0, cache_size and workers >= 1")
        self.tokenizer = LLTokenizer(tokenizer_file, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.limits = llguidance.LLParserLimits(**LIMITS)                       # type: ignore[arg-type]
        self.stats = CompilerStats()
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple, cf.Future] = {}
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); StructuredOutputError naming ``spec.param`` if it is
        invalid or not compiled within ``timeout_s``."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return hit
            future = self._pending.get(key)
            if future is None:
                future = self._pool.submit(self._build, spec)
                self._pending[key] = future
        try:
            return future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            with self._lock:
                self.stats.timeouts += 1
            raise StructuredOutputError(spec.param, f"the grammar did not compile within {self.timeout_s:g} s"
                                        ) from None

    def _build(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        key, started = spec.key, time.perf_counter()
        try:
            try:
                grammar = llguidance_grammar(spec)
            except (ValueError, TypeError) as e:
                raise StructuredOutputError(spec.param, f"cannot compile the {spec.kind.replace('_', ' ')}: {e}"
                                            ) from None
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=self.limits)
            if is_error:
                raise StructuredOutputError(spec.param, f"cannot compile the {spec.kind.replace('_', ' ')}: "
                                                        f"{_first_line(messages)}")
            matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
            if matcher.is_error():
                raise StructuredOutputError(spec.param, f"cannot compile the {spec.kind.replace('_', ' ')}: "
                                                        f"{_first_line([matcher.get_error()])}")
            compiled = CompiledGrammar(spec, matcher, time.perf_counter() - started)
            with self._lock:
                self._cache[key] = compiled
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
                self.stats.compiles += 1
                self.stats.compile_seconds += compiled.compile_seconds
            return compiled
        except BaseException:
            with self._lock:
                self.stats.failures += 1
            raise
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _first_line(messages: list[str]) -> str:
    text = next((m for m in messages if m), "invalid grammar")
    return text.strip().splitlines()[0][:500]
