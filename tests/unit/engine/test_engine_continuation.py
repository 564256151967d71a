"""A request continued from the output another replica delivered: the rest equals an uninterrupted run.

The tests cut an uninterrupted run after k of its outputs, hand those tokens and the text streamed with them
to a fresh request as its continuation, and compare what follows, token for token and character for
character (float32, as every token-equality test here)."""
from __future__ import annotations

import pytest

from tokenfleet_serving.engine import LLMEngine, SamplingParams
from tokenfleet_serving.engine.continuation import Continuation

PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def eng(llama_dir):
    return LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=2 << 20, block_size=4)


def run(eng, rid, prompt, params, continuation=None):
    eng.add_request(rid, prompt, params, continuation=continuation)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def cut_and_continue(eng, params, cut, prompt=PROMPT):
    full = run(eng, f"full-{cut}", prompt, params)
    head = full[:cut]
    cont = Continuation(tuple(t for o in head for t in o.new_token_ids), "".join(o.text_delta for o in head))
    rest = run(eng, f"rest-{cut}", prompt, params, cont)
    return full, head, rest


def ids(outs):
    return [t for o in outs for t in o.new_token_ids]


def text(outs):
    return "".join(o.text_delta for o in outs)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.8,
                   presence_penalty=0.5, ignore_eos=True),
], ids=["greedy", "seeded-top-p", "seeded-top-k", "greedy-penalties"])
@pytest.mark.parametrize("cut", [1, 5, 17])
def test_the_continued_request_yields_what_the_uninterrupted_one_did(eng, params, cut):
    full, head, rest = cut_and_continue(eng, params, cut)
    assert ids(head) + ids(rest) == ids(full)
    assert text(head) + text(rest) == text(full)
    last = rest[-1]
    assert last.finished and last.finish_reason == full[-1].finish_reason == "length"
    assert last.num_output_tokens == 24 and last.num_prompt_tokens == len(PROMPT)
    assert all(len(o.new_token_ids) == 1 for o in rest)        # only new tokens are reported


def test_unseeded_sampling_continues_after_the_delivered_tokens(eng):
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    full, head, rest = cut_and_continue(eng, params, 4)
    assert len(ids(rest)) == 8 and rest[-1].num_output_tokens == 12


def test_a_stop_string_across_the_cut_and_the_held_back_text_come_out_as_in_one_run(eng):
    base = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    [ref] = eng.generate([PROMPT], base)
    # a stop string that starts in the 6th token's text and ends in a later one
    start = len(eng.tokenizer.decode(ref.new_token_ids[:5]))
    stop = ref.text_delta[start + 1:start + 5]
    assert len(stop) == 4 and stop.strip() and ref.text_delta.index(stop) == start + 1
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(stop,))
    for cut in (5, 6):
        full, head, rest = cut_and_continue(eng, params, cut)
        assert full[-1].finish_reason == "stop" and full[-1].stop_reason == stop
        assert text(head) + text(rest) == text(full) == ref.text_delta[:start + 1]
        assert rest[-1].finish_reason == "stop" and rest[-1].stop_reason == stop
        assert ids(head) + ids(rest) == ids(full)


def test_usage_counts_the_delivered_tokens_and_cached_tokens_only_the_prompt(eng):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    full = run(eng, "u-full", PROMPT, params)
    # the same request again: its prompt and delivered output are in the prefix cache now
    cont = Continuation(tuple(ids(full[:8])), text(full[:8]))
    rest = run(eng, "u-rest", PROMPT, params, cont)
    assert rest[-1].num_output_tokens == 10 and len(ids(rest)) == 2
    assert rest[-1].num_cached_tokens <= len(PROMPT)


@pytest.mark.parametrize("cont, message", [
    (Continuation((1, 2, 3), "definitely not what these tokens decode to"), "is not the text"),
    (Continuation(tuple(range(10))), "max_tokens is 10"),
    (Continuation((0, 10**6)), "must be integers in"),
    (Continuation((), "text without tokens"), "no output token ids"),
])
def test_a_continuation_this_replica_cannot_take_is_refused_with_a_reason(eng, cont, message):
    with pytest.raises(ValueError, match=message):
        eng.add_request("bad", PROMPT, SamplingParams(max_tokens=10, temperature=0.0), continuation=cont)
    assert "bad" not in eng.requests
