"""The engine API a server consumes: streaming outputs, stops, aborts, stats, hashes, limits."""
from __future__ import annotations

import threading

import pytest

from tokenfleet_serving.engine import LLMEngine, SamplingParams, hash_prefix_blocks

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def eng(llama_dir):
    return LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=2 << 20, block_size=4)


def run(eng, rid, prompt, params):
    eng.add_request(rid, prompt, params)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def test_streamed_outputs_are_incremental_and_text_matches_decode(eng):
    prompt = eng.tokenizer.encode("the fleet serves tokens")
    outs = run(eng, "s1", prompt, SamplingParams(max_tokens=10, **GREEDY))
    ids = [t for o in outs for t in o.new_token_ids]
    assert len(ids) == 10 and all(len(o.new_token_ids) == 1 for o in outs)
    assert [o.finished for o in outs] == [False] * 9 + [True] and outs[-1].finish_reason == "length"
    text = "".join(o.text_delta for o in outs)
    assert text == eng.tokenizer.decode(ids)
    assert outs[-1].num_prompt_tokens == len(prompt) and outs[-1].num_output_tokens == 10


def test_stop_token_ids_and_eos(eng):
    [ref] = eng.generate([[20, 21, 22]], SamplingParams(max_tokens=8, **GREEDY))
    stop = ref.new_token_ids[3]
    first = ref.new_token_ids.index(stop)
    [out] = eng.generate([[20, 21, 22]], SamplingParams(max_tokens=8, stop_token_ids=(stop,), **GREEDY))
    assert out.new_token_ids == ref.new_token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    eos_engine = LLMEngine.from_pretrained(eng.config.model, dtype="float32", kv_cache_bytes=1 << 20)
    eos_engine.eos_token_ids = (stop,)
    [out] = eos_engine.generate([[20, 21, 22]], SamplingParams(max_tokens=8, temperature=0.0))
    assert out.finish_reason == "stop" and out.new_token_ids[-1] == stop and out.stop_reason is None
    [out] = eos_engine.generate([[20, 21, 22]], SamplingParams(max_tokens=8, **GREEDY))
    assert out.finish_reason == "length"


def test_stop_strings_truncate_text(eng):
    [ref] = eng.generate([[30, 31, 32]], SamplingParams(max_tokens=12, **GREEDY))
    full = ref.text_delta
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip() and stop in full
    outs = run(eng, "st", [30, 31, 32], SamplingParams(max_tokens=12, stop=(stop,), **GREEDY))
    text = "".join(o.text_delta for o in outs)
    assert text == full[:full.index(stop)] and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    [inc] = eng.generate([[30, 31, 32]], SamplingParams(max_tokens=12, stop=(stop,),
                                                          include_stop_str_in_output=True, **GREEDY))
    assert inc.text_delta == full[:full.index(stop) + len(stop)]


def test_seeded_sampling_is_reproducible_across_batches(eng):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=42)
    [alone] = eng.generate([[5, 6, 7]], params)
    together = eng.generate([[9, 9, 9], [5, 6, 7], [1, 2, 3, 4]],
                            [SamplingParams(max_tokens=8, temperature=1.0), params, params])
    assert together[1].new_token_ids == alone.new_token_ids


def test_logprobs_are_returned_per_token(eng):
    [out] = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, logprobs=3, **GREEDY))
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.new_token_ids, out.logprobs):
        assert lp.token_id == tok and lp.top[0][0] == tok and len(lp.top) == 3 and lp.logprob <= 0


def test_abort_frees_blocks_at_once_and_reports(eng):
    free0 = eng.kv.pool.num_free
    eng.add_request("ab", list(range(10, 30)), SamplingParams(max_tokens=50, **GREEDY))
    eng.step()
    assert eng.kv.pool.num_free < free0
    assert eng.abort_request("ab")
    assert eng.kv.pool.num_free == free0 and not eng.abort_request("ab")
    outs = eng.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("ab", True, "abort")]
    assert not eng.has_unfinished() and eng.stats().finished["abort"] >= 1


def test_add_and_abort_from_another_thread_while_stepping(eng):
    done = []
    def producer():
        for i in range(20):
            eng.add_request(f"t{i}", [3 + i, 4, 5], SamplingParams(max_tokens=5, **GREEDY))
            if i % 3 == 0:
                eng.abort_request(f"t{i}")
    th = threading.Thread(target=producer)
    th.start()
    while th.is_alive() or eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    th.join()
    assert sorted(o.request_id for o in done) == sorted(f"t{i}" for i in range(20))
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks


def test_stats_and_cached_block_hashes_follow_the_spec(llama_dir):
    eng = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    prompt = list(range(40, 58))
    eng.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))
    s = eng.stats()
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    assert s.prompt_tokens == 18 and s.generation_tokens == 3 and s.prefix_cache_queries == 18
    assert s.prefix_cache_hits == 0 and s.finished == {"length": 1}
    # full blocks of prompt + generated tokens written to the cache (the last sampled token is not cached)
    [out] = eng.generate([prompt], SamplingParams(max_tokens=1, **GREEDY))
    expected = {h.hex() for h in hash_prefix_blocks(prompt, 4)}
    assert expected <= set(eng.cached_block_hashes())
    assert out.num_cached_tokens == 16 and eng.stats().prefix_cache_hits == 16


def test_reset_prefix_cache_forgets_cached_blocks_but_not_while_requests_run(llama_dir):
    eng = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    prompt = list(range(40, 58))
    [first] = eng.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))
    assert eng.cached_block_hashes()
    eng.add_request("running", prompt, SamplingParams(max_tokens=2, **GREEDY))
    eng.step()
    assert eng.reset_prefix_cache() is False                   # its blocks are in use: nothing is dropped
    assert len(eng.cached_block_hashes()) >= 4
    while eng.has_unfinished():
        eng.step()
    assert eng.reset_prefix_cache() is True
    assert eng.cached_block_hashes() == []
    [again] = eng.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))
    assert again.num_cached_tokens == 0 and again.new_token_ids == first.new_token_ids
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks     # every block came back after the reset


def test_request_validation(eng):
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("v1", [], SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request("v2", [10 ** 6], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("v3", [1] * 5000, SamplingParams())
    eng.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    while eng.has_unfinished():
        eng.step()


def test_request_larger_than_the_pool_is_rejected(llama_dir):
    eng = LLMEngine.from_pretrained(llama_dir, dtype="float32", block_size=4, kv_cache_bytes=4 * 4 * 2 * 2 * 32 * 4)
    assert eng.kv.pool.num_blocks == 4
    with pytest.raises(ValueError, match="KV cache"):
        eng.add_request("big", list(range(10)), SamplingParams(max_tokens=10))


def test_max_model_len_finishes_with_length(llama_dir):
    eng = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=1 << 20, max_model_len=12)
    [out] = eng.generate([list(range(10))], SamplingParams(max_tokens=50, **GREEDY))
    assert out.finish_reason == "length" and out.num_output_tokens == 2
