"""Structured outputs, logit_bias, min_tokens and n > 1 in the engine, on a random-weight model.

The words are noise; the structure must hold: every constrained output parses and validates against its
schema with ``jsonschema`` (a validator no one here wrote).
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from llguidance import LLMatcher

from tokenfleet_serving.engine import LLMEngine, SamplingParams, logits_processors
from tokenfleet_serving.engine.continuation import Continuation
from tokenfleet_serving.engine.request import Request
from tokenfleet_serving.engine.speculative import SpeculativeConfig
from tokenfleet_serving.engine.structured import StructuredOutputError, StructuredOutputSpec
from tokenfleet_serving.engine.structured.spec import MAX_SPEC_BYTES

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "status": {"type": "string", "enum": ["active", "idle", "failed"]},
        "replicas": {"type": "integer", "minimum": 0, "maximum": 64},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["gpu", "cpu", "cache"]}, "maxItems": 3},
        "nodes": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                             "ready": {"type": "boolean"}},
            "required": ["id", "ready"], "additionalProperties": False}},
    },
    "required": ["name", "status", "replicas", "tags", "nodes"],
    "additionalProperties": False,
}
SCHEMAS = [
    NESTED,
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
     "required": ["ok", "score"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"pick": {"anyOf": [{"type": "null"}, {"type": "string", "enum": ["a", "b"]}]}},
     "required": ["pick"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def eng(llama_dir):
    return LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=8 << 20, block_size=4)


def sampled(seed: int, spec: StructuredOutputSpec, max_tokens: int = 400) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=spec)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["nested", "flat", "array", "anyof"])
def test_every_json_schema_output_validates(eng, schema):
    spec = StructuredOutputSpec.json_schema(schema)
    outs = eng.generate([[5, 6, 7, 8]] * 6, [sampled(seed, spec) for seed in range(6)])
    for out in outs:
        assert out.finish_reason == "stop", out.text_delta
        jsonschema.validate(json.loads(out.text_delta), schema)


def test_json_object_regex_choice_and_grammar(eng):
    obj = eng.generate([[9, 10]] * 3, [sampled(s, StructuredOutputSpec("json_object")) for s in range(3)])
    assert all(isinstance(json.loads(o.text_delta), dict) for o in obj)
    regex = r"(pod|node)-[0-9]{2,4}"
    outs = eng.generate([[9, 10]] * 4, [sampled(s, StructuredOutputSpec("regex", regex)) for s in range(4)])
    assert all(re.fullmatch(regex, o.text_delta) for o in outs), [o.text_delta for o in outs]
    choices = ("yes", "no", "maybe later")
    outs = eng.generate([[9, 10]] * 4, [sampled(s, StructuredOutputSpec("choice", choices=choices)) for s in range(4)])
    assert all(o.text_delta in choices for o in outs)
    gbnf = 'root ::= "size=" [0-9] [0-9]? " unit=" ("gib" | "mib")'
    lark = 'start: "size=" /[0-9]{1,2}/ " unit=" ("gib" | "mib")'
    for grammar in (gbnf, lark):
        outs = eng.generate([[9, 10]] * 3, [sampled(s, StructuredOutputSpec("grammar", grammar)) for s in range(3)])
        assert all(re.fullmatch(r"size=[0-9]{1,2} unit=(gib|mib)", o.text_delta) for o in outs), \
            [o.text_delta for o in outs]


def test_constrained_and_free_requests_share_a_step_and_free_rows_are_untouched(eng):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [alone] = eng.generate([[30, 31, 32]], free)
    spec = StructuredOutputSpec.json_schema(NESTED)
    prompts = [[30, 31, 32], [5, 6], [30, 31, 32], [7, 8, 9]]
    params = [free, sampled(1, spec), free, sampled(2, spec)]
    steps_with_both = 0
    ids = [f"mix-{i}" for i in range(4)]
    for rid, prompt, p in zip(ids, prompts, params):
        eng.add_request(rid, prompt, p)
    text = {rid: "" for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while eng.has_unfinished():
        outs = eng.step()
        stepped = {o.request_id for o in outs if o.new_token_ids}
        steps_with_both += stepped >= {"mix-0", "mix-1"}
        for o in outs:
            text[o.request_id] += o.text_delta
            tokens[o.request_id] += o.new_token_ids
    assert steps_with_both >= 10          # one batch held both kinds, step after step
    assert tokens["mix-0"] == tokens["mix-2"] == alone.new_token_ids
    for rid in ("mix-1", "mix-3"):
        jsonschema.validate(json.loads(text[rid]), NESTED)


def test_batched_mask_equals_each_rows_own_mask(eng):
    """The batch mask (one fill for all constrained rows, one masked_fill) forbids exactly what llguidance's
    per-matcher bitmask forbids, and leaves free rows as they were."""
    compiled = [eng.compile_structured(StructuredOutputSpec.json_schema(NESTED)),
                eng.compile_structured(StructuredOutputSpec("regex", "[a-z]+ [0-9]+"))]
    reqs = []
    for i, c in enumerate([compiled[0], None, compiled[1], None, compiled[0]]):
        r = Request(f"m{i}", [1, 2], SamplingParams(max_tokens=8))
        if c is not None:
            r.grammar = c.new_matcher()
        reqs.append(r)
    reqs[4].grammar.consume_tokens(eng.tokenizer.encode('{"name":"', add_special_tokens=False))
    vocab = eng.model_config.vocab_size
    logits = torch.randn(len(reqs), vocab, generator=torch.Generator().manual_seed(0))
    out = logits_processors.apply(logits, reqs)
    assert out is not None
    for i, r in enumerate(reqs):
        if r.grammar is None:
            assert torch.equal(out[i], logits[i])
            continue
        bits = r.grammar.compute_bitmask()
        allowed = torch.tensor([(bits[t // 8] >> (t % 8)) & 1 for t in range(vocab)], dtype=torch.bool)
        assert 0 < int(allowed.sum()) < vocab
        assert torch.equal(torch.isinf(out[i]), ~allowed)
        assert torch.equal(out[i][allowed], logits[i][allowed])


def test_logit_bias_forces_and_forbids_tokens(eng):
    greedy = dict(temperature=0.0, ignore_eos=True, max_tokens=8)
    [ref] = eng.generate([[40, 41, 42]], SamplingParams(**greedy))
    banned = ref.new_token_ids[0]
    [out] = eng.generate([[40, 41, 42]], SamplingParams(**greedy, logit_bias={banned: -100}))
    assert banned not in out.new_token_ids
    [forced] = eng.generate([[40, 41, 42]], SamplingParams(**greedy, logit_bias={"123": 100}))
    assert forced.new_token_ids == [123] * 8
    vocab = eng.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        eng.add_request("oov", [1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    for bad in ({5: 100.5}, {5: float("nan")}, {-1: 1.0}, {"x": 1.0}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_min_tokens_holds_back_eos_and_stops(eng):
    eos = eng.eos_token_ids[0]
    force_eos = {eos: 100}
    [quick] = eng.generate([[50, 51]], SamplingParams(max_tokens=20, temperature=0.0, logit_bias=force_eos))
    assert quick.new_token_ids == [eos] and quick.finish_reason == "stop"
    [held] = eng.generate([[50, 51]], SamplingParams(max_tokens=20, temperature=0.0, logit_bias=force_eos, min_tokens=5))
    assert len(held.new_token_ids) == 6 and held.new_token_ids[-1] == eos and eos not in held.new_token_ids[:5]
    assert held.finish_reason == "stop"
    [ref] = eng.generate([[50, 51]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    stop = ref.new_token_ids[0]
    [out] = eng.generate([[50, 51]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=(stop,), min_tokens=4))
    assert len(out.new_token_ids) > 4 and stop not in out.new_token_ids[:4]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_n_siblings_take_the_prompt_from_the_prefix_cache(llama_dir):
    eng = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=8 << 20, block_size=4)
    prompt = list(range(10, 50))                     # 40 tokens: 9 full blocks (36 tokens) below the last token
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in range(3)]
    before = eng.stats()
    eng.add_request("n-0", prompt, params[0])
    eng.add_request("n-1", prompt, params[1], share_prompt_with="n-0")
    eng.add_request("n-2", prompt, params[2], share_prompt_with="n-0")
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    after = eng.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 2 * 36
    assert after.prompt_tokens - before.prompt_tokens == 40 + 2 * 4
    # the shared KV is the same KV: each sibling samples what it samples alone
    solo = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=8 << 20, block_size=4,
                                     enable_prefix_caching=False)
    for i, p in enumerate(params):
        [alone] = solo.generate([prompt], p)
        assert got[f"n-{i}"] == alone.new_token_ids


def test_bad_specs_are_refused_naming_the_field(eng):
    with pytest.raises(StructuredOutputError) as e:
        eng.compile_structured(StructuredOutputSpec.json_schema({"type": "object", "properties": {"a": {"type": 7}}}))
    assert e.value.param == "response_format"
    with pytest.raises(StructuredOutputError):
        StructuredOutputSpec.json_schema({"enum": ["x" * 100] * (MAX_SPEC_BYTES // 100)})
    with pytest.raises(StructuredOutputError) as e:
        eng.compile_structured(StructuredOutputSpec("regex", "(unclosed", param="structured_outputs.regex"))
    assert e.value.param == "structured_outputs.regex"
    with pytest.raises(StructuredOutputError):
        eng.compile_structured(StructuredOutputSpec("grammar", "start: undefined_rule"))
    with pytest.raises(StructuredOutputError):
        StructuredOutputSpec.json_schema("{not json")


def test_a_compile_past_its_time_bound_is_refused_and_others_are_served(llama_dir):
    eng = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=4 << 20, block_size=4,
                                    structured_output_timeout_s=1e-4)
    eng.add_request("free", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    big = {"type": "object", "properties": {f"k{i}": {"type": "array", "items": NESTED} for i in range(40)}}
    with pytest.raises(StructuredOutputError, match="did not compile within") as e:
        eng.add_request("slow", [1, 2, 3], SamplingParams(structured=StructuredOutputSpec.json_schema(big)))
    assert e.value.param == "response_format"
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == ["free"] and outs[-1].num_output_tokens == 4


def test_cached_compile_is_reused(eng):
    spec = StructuredOutputSpec.json_schema({"type": "object", "properties": {"cached": {"type": "boolean"}}})
    first = eng.compile_structured(spec)
    hits = eng.grammar_compiler.stats.cache_hits
    assert eng.compile_structured(StructuredOutputSpec.json_schema(json.loads(spec.value))) is first
    assert eng.grammar_compiler.stats.cache_hits == hits + 1


def test_constrained_requests_do_not_speculate(llama_dir):
    eng = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=8 << 20, block_size=4,
                                    speculative=SpeculativeConfig("ngram", 4, prompt_lookup_min=1))
    spec = StructuredOutputSpec("regex", "(ab){20}")
    prompt = eng.tokenizer.encode("ab" * 30, add_special_tokens=False)      # ngram lookup would propose "ab"s
    eng.add_request("c", prompt, SamplingParams(max_tokens=60, temperature=0.0, structured=spec))
    text = ""
    while eng.has_unfinished():
        assert all(not r.spec_token_ids for r in eng.scheduler.running if r.grammar is not None)
        text += "".join(o.text_delta for o in eng.step())
    assert text == "ab" * 20
    assert eng.speculator is not None and eng.speculator.stats.num_draft_tokens == 0


def test_continuation_restores_the_grammar_state(eng):
    spec = StructuredOutputSpec.json_schema(NESTED)
    [full] = eng.generate([[5, 6]], sampled(3, spec))
    head = full.new_token_ids[:5]
    text = eng.tokenizer.decode(head)
    eng.add_request("cont", [5, 6], sampled(4, spec), continuation=Continuation(tuple(head), text))
    while eng.has_unfinished():
        text += "".join(o.text_delta for o in eng.step())
    jsonschema.validate(json.loads(text), NESTED)
    not_json = tuple(eng.tokenizer.encode("hello", add_special_tokens=False))
    with pytest.raises(StructuredOutputError, match="continuation"):
        eng.add_request("cont-bad", [5, 6], sampled(4, spec), continuation=Continuation(not_json, "hello"))


def test_matcher_rejects_what_the_mask_forbids(eng):
    """The mask and the matcher agree: a forbidden token fails the request alone (finish_reason error)."""
    compiled = eng.compile_structured(StructuredOutputSpec("choice", choices=("yes",)))
    m: LLMatcher = compiled.new_matcher()
    assert not m.consume_token(eng.tokenizer.encode("no", add_special_tokens=False)[0])
