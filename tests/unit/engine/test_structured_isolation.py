"""Client grammars cannot take the server down or starve other clients: shapes that crash llguidance are refused
before compiling, a crash that gets past that costs one request (the compile runs in a child process first),
failures are answered from a cache, and each client may have only a few compiles waiting.

The crashing grammar is real: a chain of thousands of rules (``r0: r1``, ``r1: r2``, ...) overflows llguidance's
stack with SIGSEGV. The test process compiles nothing itself that it did not first see compile in a child, so a
regression here kills pytest, which fails loudly.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tokenfleet_serving.engine import LLMEngine, SamplingParams
from tokenfleet_serving.engine.structured import bounds
from tokenfleet_serving.engine.structured.compiler import CompileQueueFull, GrammarCompiler
from tokenfleet_serving.engine.structured.spec import StructuredOutputError, StructuredOutputSpec

LARK_JSON = """start: value
value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" [pair ("," pair)*] "}"
pair: STRING ":" value
array: "[" [value ("," value)*] "]"
STRING: /"[a-z]*"/
NUMBER: /[0-9]+/
"""
AMBIGUOUS = ("start: s\ns: " + " | ".join(f"x{i}" for i in range(40)) + "\n"     # each "a" grows the parser's
             + "".join(f"x{i}: s s | A |\n" for i in range(40)) + 'A: "a"\n')    # row: at its limit after ~15
WIDE = "start: " + " | ".join(f"r{i}" for i in range(100)) + "\n" + "".join(        # the first mask passes the
    f"r{i}: " + " | ".join(f'"{chr(97 + j)}" r{(i + 1) % 100}' for j in range(26)) + "\n" for i in range(100))  # limit


def chain(n: int, parens: int = 0) -> str:
    return "start: r0\n" + "".join(f"r{i}: {'(' * parens}r{i + 1}{')' * parens}\n" for i in range(n)) + f'r{n}: "x"\n'


def unchecked_grammar(text: str) -> StructuredOutputSpec:
    """A grammar spec that skips spec.py's bounds: a shape those bounds would miss."""
    spec = object.__new__(StructuredOutputSpec)
    for name, value in (("kind", "grammar"), ("value", text), ("choices", ()), ("strict", True),
                        ("param", "structured_outputs.grammar")):
        object.__setattr__(spec, name, value)
    return spec


@pytest.fixture(scope="module")
def compiler(llama_dir):
    c = GrammarCompiler(str(Path(llama_dir) / "tokenizer.json"), 512, (2,), timeout_s=30, workers=1)
    yield c
    c.close()


@pytest.mark.parametrize("text, words", [
    (chain(3000), f"at most {bounds.MAX_GRAMMAR_RULES} are accepted"),
    (chain(bounds.MAX_GRAMMAR_DEPTH), f"at most {bounds.MAX_GRAMMAR_DEPTH} is accepted"),
    (chain(40, parens=10), f"at most {bounds.MAX_GRAMMAR_DEPTH} is accepted"),
])
def test_deep_grammars_are_refused_before_compiling(text, words):
    with pytest.raises(StructuredOutputError) as e:
        StructuredOutputSpec("grammar", text, param="structured_outputs.grammar")
    assert e.value.param == "structured_outputs.grammar" and words in e.value.message


def test_recursive_and_moderate_grammars_still_compile(compiler):
    for text in (LARK_JSON, chain(100), chain(20, parens=5), 'root ::= item+\nitem ::= [a-z] | "(" root ")"\n'):
        compiler.compile(StructuredOutputSpec("grammar", text, param="structured_outputs.grammar"))


def test_deep_schemas_are_refused_without_recursion_errors():
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    text = '{"items":' * 5000 + "{}" + "}" * 5000                # 55 KB: under the size bound
    for make in (lambda: StructuredOutputSpec.json_schema(schema), lambda: StructuredOutputSpec.json_schema(text)):
        with pytest.raises(StructuredOutputError, match=f"at most {bounds.MAX_SCHEMA_DEPTH} levels"):
            make()


def ref_chain(n: int) -> dict:
    """Object definitions each holding a ``$ref`` to the next: about 1,000 crashed llguidance (in 64 KiB)."""
    defs = {f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}}} for i in range(n)}
    return {"$ref": "#/$defs/a0", "$defs": {**defs, f"a{n}": {"type": "string"}}}


def test_long_ref_chains_are_refused_and_recursive_schemas_are_not(compiler):
    with pytest.raises(StructuredOutputError, match=f"at most {bounds.MAX_SCHEMA_REF_DEPTH} is accepted"):
        StructuredOutputSpec.json_schema(ref_chain(850))
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}}}
    for schema in (tree, ref_chain(20)):
        compiler.compile(StructuredOutputSpec.json_schema(schema))


def test_a_grammar_that_crashes_the_compiler_costs_one_request(compiler):
    crashing = unchecked_grammar(chain(8000))
    with pytest.raises(StructuredOutputError, match="crashed the grammar compiler \\(SIGSEGV\\)") as e:
        compiler.compile(crashing)
    assert e.value.param == "structured_outputs.grammar" and compiler.sandbox.crashes == 1
    started = time.monotonic()
    with pytest.raises(StructuredOutputError, match="crashed"):       # the same grammar again: from the cache
        compiler.compile(crashing)
    assert time.monotonic() - started < 0.5 and compiler.sandbox.crashes == 1 and compiler.stats.failure_hits == 1
    # a fresh child serves the next grammar
    compiled = compiler.compile(StructuredOutputSpec.json_schema({"type": "object", "properties": {"a": {}}}))
    assert not compiled.new_matcher().is_error()


def test_a_failed_grammar_is_answered_from_the_cache(compiler):
    bad = StructuredOutputSpec("grammar", "start: missing_rule", param="structured_outputs.grammar")
    with pytest.raises(StructuredOutputError) as first:
        compiler.compile(bad)
    hits = compiler.stats.failure_hits
    with pytest.raises(StructuredOutputError) as again:
        compiler.submit(StructuredOutputSpec("grammar", "start: missing_rule", param="response_format"))
    assert again.value.message == first.value.message and again.value.param == "response_format"
    assert compiler.stats.failure_hits == hits + 1


def test_each_client_may_have_only_a_few_compiles_waiting(llama_dir):
    c = GrammarCompiler(str(Path(llama_dir) / "tokenizer.json"), 512, (2,), timeout_s=30, workers=1,
                        max_pending_per_client=2, max_pending=3)
    try:
        specs = [StructuredOutputSpec.json_schema({"type": "object", "properties": {f"k{i}_{j}": {"type": "integer"}
                                                                                   for j in range(30)}})
                 for i in range(5)]
        waiting = [c.submit(specs[0], "greedy"), c.submit(specs[1], "greedy")]
        with pytest.raises(CompileQueueFull) as e:
            c.submit(specs[2], "greedy")
        assert e.value.status == 429 and e.value.param == "response_format"
        waiting.append(c.submit(specs[3], "polite"))             # another client is still admitted
        with pytest.raises(CompileQueueFull, match="3 grammar compiles are waiting"):
            c.submit(specs[4], "third")                           # ... up to the total bound
        for f in waiting:
            f.result(timeout=60)
        c.submit(specs[2], "greedy").result(timeout=60)           # done: the client may compile again
        assert json.loads(specs[2].value)["properties"] and c.stats.refused_busy == 2
    finally:
        c.close()


def test_a_grammar_past_the_per_token_limits_at_the_first_token_is_refused_at_compile(compiler):
    with pytest.raises(StructuredOutputError, match="Too many items") as e:
        compiler.compile(StructuredOutputSpec("grammar", WIDE, param="structured_outputs.grammar"))
    assert e.value.param == "structured_outputs.grammar"


def test_a_grammar_past_the_per_token_limits_later_fails_its_request_naming_the_field(llama_dir):
    eng = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=8 << 20, block_size=4)
    spec = StructuredOutputSpec("grammar", AMBIGUOUS, param="structured_outputs.grammar")
    eng.add_request("ambiguous", [5, 6, 7], SamplingParams(max_tokens=60, min_tokens=59, structured=spec))
    eng.add_request("free", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    last = {}
    while eng.has_unfinished():
        for out in eng.step():
            last[out.request_id] = out
    assert last["ambiguous"].finish_reason == "error" and "max is" in last["ambiguous"].error
    assert last["ambiguous"].error_param == "structured_outputs.grammar"
    assert last["free"].finish_reason == "length" and last["free"].error_param is None


def test_a_compile_past_its_deadline_is_killed_and_not_cached_as_a_failure(llama_dir):
    c = GrammarCompiler(str(Path(llama_dir) / "tokenizer.json"), 512, (2,), timeout_s=0.001, workers=1)
    try:
        spec = StructuredOutputSpec("regex", "[a-z]+", param="structured_outputs.regex")
        for attempt in (1, 2):                  # the child never answers in a millisecond: killed each time
            with pytest.raises(StructuredOutputError, match="did not compile within") as e:
                c.submit(spec).result(timeout=60)
            assert e.value.param == "structured_outputs.regex" and c.stats.timeouts == attempt
        assert c.stats.failure_hits == 0 and c.sandbox.crashes == 0
    finally:
        c.close()
