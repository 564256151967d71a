"""A failure caused by one request fails that request alone; the rest of the batch is served unchanged.

Faults are injected into one request of a running batch at the seams the engine isolates (its sampling,
the append of its token); a fault nobody can be blamed for (the forward pass) still stops the step.
"""
from __future__ import annotations

import pytest

from tokenfleet_serving.engine import LLMEngine, SamplingParams
from tokenfleet_serving.engine import engine as engine_module

GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=10)
PROMPTS = {"a": [5, 6, 7, 8], "victim": [9, 10, 11], "c": [12, 13, 14, 15, 16]}


@pytest.fixture
def eng(llama_dir):
    return LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=2 << 20, block_size=4)


def reference(eng) -> dict[str, list[int]]:
    outs = eng.generate(list(PROMPTS.values()), SamplingParams(**GREEDY))
    return {rid: o.new_token_ids for rid, o in zip(PROMPTS, outs)}


def run_with_fault(eng, arm, params=None) -> dict[str, list]:
    """Start all three, step until every one is decoding, arm the fault, run to the end."""
    for rid, prompt in PROMPTS.items():
        eng.add_request(rid, prompt, (params or {}).get(rid, SamplingParams(**GREEDY)))
    outs: dict[str, list] = {rid: [] for rid in PROMPTS}
    for _ in range(3):
        for o in eng.step():
            outs[o.request_id].append(o)
    assert all(len(v) >= 2 and not v[-1].finished for v in outs.values()), "all three run in one batch"
    arm()
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].append(o)
    return outs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_a_sampling_fault_in_one_request_fails_it_alone(eng, monkeypatch):
    ref = reference(eng)
    real_sample = engine_module.sample

    def faulty(logits, reqs):
        if any(r.request_id == "victim" for r in reqs):
            raise RuntimeError("injected sampling fault")
        return real_sample(logits, reqs)

    outs = run_with_fault(eng, lambda: monkeypatch.setattr(engine_module, "sample", faulty))
    last = outs["victim"][-1]
    assert last.finished and last.finish_reason == "error" and "injected sampling fault" in last.error
    assert len(tokens(outs["victim"])) < GREEDY["max_tokens"]
    for rid in ("a", "c"):
        assert tokens(outs[rid]) == ref[rid] and outs[rid][-1].finish_reason == "length"
        assert outs[rid][-1].error is None
    stats = eng.stats()
    assert stats.finished.get("error") == 1 and stats.kv_cache_usage == 0.0 and not eng.requests
    monkeypatch.setattr(engine_module, "sample", real_sample)
    assert [o.new_token_ids for o in eng.generate([PROMPTS["a"]], SamplingParams(**GREEDY))] == [ref["a"]]


def test_an_append_fault_in_one_request_fails_it_alone(eng):
    ref = reference(eng)

    def arm():
        victim = eng.requests["victim"]

        def broken(ids):
            raise UnicodeError("injected detokenizer fault")
        victim.detokenizer.push = broken

    outs = run_with_fault(eng, arm)
    assert outs["victim"][-1].finish_reason == "error" and "injected detokenizer fault" in outs["victim"][-1].error
    assert tokens(outs["a"]) == ref["a"] and tokens(outs["c"]) == ref["c"]
    assert eng.stats().kv_cache_usage == 0.0


def test_non_finite_logits_in_one_row_fail_that_request_through_the_real_sampler(eng, monkeypatch):
    """The sampler's own check (a NaN row cannot be sampled) is what the isolation catches."""
    ref = reference(eng)
    real_sample = engine_module.sample

    def nan_for_the_victim(logits, reqs):
        logits = logits.clone()
        for i, r in enumerate(reqs):
            if r.request_id == "victim":
                logits[i] = float("nan")
        return real_sample(logits, reqs)

    params = {"victim": SamplingParams(temperature=0.7, seed=3, ignore_eos=True, max_tokens=10)}
    outs = run_with_fault(eng, lambda: monkeypatch.setattr(engine_module, "sample", nan_for_the_victim), params)
    last = outs["victim"][-1]
    assert last.finish_reason == "error" and "SamplingError" in last.error and "NaN" in last.error
    assert tokens(outs["a"]) == ref["a"] and tokens(outs["c"]) == ref["c"]


def test_a_fault_no_request_can_be_blamed_for_stops_the_step(eng, monkeypatch):
    eng.add_request("x", [1, 2, 3], SamplingParams(**GREEDY))
    eng.step()

    def broken(batch):
        raise RuntimeError("device lost")
    monkeypatch.setattr(eng.runner, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()
