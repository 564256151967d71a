"""Greedy output and logits of the engine vs transformers on random-weight checkpoints (fp32)."""
from __future__ import annotations

import random

import pytest
import torch

from tokenfleet_serving.engine import LLMEngine, SamplingParams, cpu_kernels
from tokenfleet_serving.engine import batch as batch_module
from tokenfleet_serving.engine.batch import SeqChunk, build_batch
from tokenfleet_serving.engine.layers.linear import Linear

from harness.engine_checkpoints import CHECKPOINTS, hf_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LOGIT_TOLERANCE = 1e-4   # max |engine - transformers| over all logits, fp32


def prompts(seed: int, n: int, lo: int = 3, hi: int = 40, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def engine(path, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", 4 << 20)
    kw.setdefault("block_size", 4)
    return LLMEngine.from_pretrained(path, dtype="float32", device="cpu", **kw)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_single_request_greedy_matches_transformers(name, checkpoints, hf_models):
    eng = engine(checkpoints[name])
    for prompt in prompts(0, 2):
        [out] = eng.generate([prompt], GREEDY)
        assert out.new_token_ids == hf_greedy(hf_models[name], prompt, GREEDY.max_tokens)
        assert out.finish_reason == "length"


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "torch"])
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_batched_greedy_matches_transformers(name, kernels, checkpoints, hf_models):
    eng = engine(checkpoints[name], cpu_kernels=kernels)
    assert (eng.runner.kernels is not None) == kernels
    batch = prompts(1, 8)
    outs = eng.generate(batch, GREEDY)
    for prompt, out in zip(batch, outs):
        assert out.new_token_ids == hf_greedy(hf_models[name], prompt, GREEDY.max_tokens)


def test_prefix_cache_hits_keep_greedy_parity(llama_dir, hf_models):
    eng = engine(llama_dir)
    shared = prompts(2, 1, 41, 42)[0]
    first = [shared + [7, 8, 9]]
    later = [shared + tail for tail in ([10], [11, 12, 13], [14, 15, 16, 17, 18])]
    [o0] = eng.generate(first, GREEDY)
    assert o0.num_cached_tokens == 0
    outs = eng.generate(later, GREEDY)
    for prompt, out in zip(first + later, [o0] + outs):
        assert out.new_token_ids == hf_greedy(hf_models["llama"], prompt, GREEDY.max_tokens)
    assert all(o.num_cached_tokens == 40 for o in outs)   # 10 full blocks of 4 of the shared 41 tokens
    stats = eng.stats()
    assert stats.prefix_cache_hits == 120 and stats.prefix_cache_queries == 44 + sum(map(len, later))
    # an identical prompt still recomputes its last token to get logits
    [again] = eng.generate(first, GREEDY)
    assert again.num_cached_tokens == 40 and again.new_token_ids == o0.new_token_ids


def test_chunked_prefill_keeps_greedy_parity(llama_dir, hf_models):
    eng = engine(llama_dir, max_num_batched_tokens=7)
    batch = prompts(3, 5, 10, 40)
    outs = eng.generate(batch, GREEDY)
    assert eng.stats().num_chunked_prefills >= sum(len(p) // 7 for p in batch)
    for prompt, out in zip(batch, outs):
        assert out.new_token_ids == hf_greedy(hf_models["llama"], prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_keeps_greedy_parity(llama_dir, hf_models, prefix_caching):
    # 24 blocks of 4 tokens = 96 slots for 6 requests needing ~35-50 tokens each: preemption must happen
    eng = engine(llama_dir, enable_prefix_caching=prefix_caching)
    eng = engine(llama_dir, enable_prefix_caching=prefix_caching,
                 kv_cache_bytes=24 * eng.runner.kv_block_bytes(4))
    assert eng.kv.pool.num_blocks == 24
    batch = prompts(4, 6, 20, 35)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = eng.generate(batch, params)
    assert eng.stats().num_preemptions > 0
    for prompt, out in zip(batch, outs):
        assert out.new_token_ids == hf_greedy(hf_models["llama"], prompt, params.max_tokens)
    assert eng.kv.pool.num_free == 24


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "torch"])
@pytest.mark.parametrize("long_chunk", [512, 2], ids=["padded-groups", "sdpa-spans"])
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_logits_match_transformers_on_every_attention_path(name, long_chunk, kernels, checkpoints, hf_models,
                                                           monkeypatch):
    monkeypatch.setattr(batch_module, "LONG_CHUNK", long_chunk)   # chunks >= LONG_CHUNK take the SDPA path
    eng = engine(checkpoints[name], cpu_kernels=kernels)
    assert (eng.runner.kernels is not None) == kernels
    model, bs = eng.runner, eng.kv.block_size
    prompt = prompts(5, 1, 30, 31)[0]
    with torch.inference_mode():
        ref = hf_models[name](torch.tensor([prompt])).logits[0].float()
    table = list(range(-(-len(prompt) // bs)))
    eng.kv.pool.allocate(len(table))
    # 1) fresh prefill of 20 tokens (causal attention over the new keys)
    step = lambda chunk: build_batch([chunk], bs, model.device, model.compiled_prefill)    # as the engine builds it
    got = model.forward(step(SeqChunk(prompt[:20], 0, table, True)), all_logits=True)
    assert (got - ref[:20]).abs().max() < LOGIT_TOLERANCE
    # 2) a chunk of 9 tokens on top of the cached 20 (paged attention with a causal offset)
    got = model.forward(step(SeqChunk(prompt[20:29], 20, table, True)), all_logits=True)
    assert (got - ref[20:29]).abs().max() < LOGIT_TOLERANCE
    # 3) one decode token over the 29 cached
    got = model.forward(step(SeqChunk(prompt[29:], 29, table, True)))
    assert (got[0] - ref[29]).abs().max() < LOGIT_TOLERANCE


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "torch"])
def test_mixed_step_of_decodes_short_and_long_prefills_matches_transformers(llama_dir, hf_models, monkeypatch,
                                                                           kernels):
    monkeypatch.setattr(batch_module, "LONG_CHUNK", 16)
    eng = engine(llama_dir, max_num_batched_tokens=64, cpu_kernels=kernels)
    batch = prompts(6, 3, 3, 8) + prompts(7, 3, 20, 60)      # short and long prompts, chunked by the budget
    outs = eng.generate(batch, GREEDY)
    for prompt, out in zip(batch, outs):
        assert out.new_token_ids == hf_greedy(hf_models["llama"], prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "torch"])
@pytest.mark.parametrize("long_chunk", [512, 8], ids=["padded-groups", "sdpa-spans"])
def test_last_layer_on_sampled_rows_only_gives_the_full_logits(llama_dir, long_chunk, kernels, monkeypatch):
    # The last layer runs attention and the MLP only for rows that are sampled; their logits must be those of
    # the full computation, in a step mixing decodes, a finishing prompt chunk and one that does not sample.
    monkeypatch.setattr(batch_module, "LONG_CHUNK", long_chunk)
    eng = engine(llama_dir, cpu_kernels=kernels)
    model, bs = eng.runner, eng.kv.block_size
    seqs = prompts(11, 4, 40, 41)
    tables = [eng.kv.pool.allocate(-(-len(p) // bs)) for p in seqs]
    # fill each sequence's cache up to where this step starts (its first 30 tokens, or 10 for the last two)
    starts = [30, 30, 10, 10]
    for p, table, start in zip(seqs, tables, starts):
        model.forward(build_batch([SeqChunk(p[:start], 0, table, True)], bs, model.device, model.compiled_prefill))
    chunks = [SeqChunk(seqs[0][30:31], 30, tables[0], True),             # decodes
              SeqChunk(seqs[1][30:31], 30, tables[1], True),
              SeqChunk(seqs[2][10:40], 10, tables[2], True),             # a prompt chunk that ends its prompt
              SeqChunk(seqs[3][10:25], 10, tables[3], False)]            # a chunk in the middle of a prompt
    step = build_batch(chunks, bs, model.device, model.compiled_prefill)
    assert step.logits_rows.shape[0] == 3 < step.input_ids.shape[0]
    trimmed = model.forward(step)
    full = model.forward(step, all_logits=True)[step.logits_rows]
    assert trimmed.shape == full.shape
    assert (trimmed - full).abs().max() < 1e-5


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
@pytest.mark.parametrize("small_parts", [False, True], ids=["whole", "pieces-and-runs"])
def test_one_call_decoder_layers_give_the_layer_loops_bits(name, small_parts, checkpoints, monkeypatch):
    # tf_decoder_layers runs the kernels of the Python layer loop in the same order: logits must be identical,
    # for a step mixing decodes, a prefix-cache-style chunk after cached tokens, a fresh prompt and a chunk
    # that stops mid-prompt, with the last layer trimmed to the sampled rows and with all rows kept.
    eng = engine(checkpoints[name])
    model, bs = eng.runner, eng.kv.block_size
    assert model.decoder_call is not None
    if small_parts:       # several MLP row pieces, and one prefill-attention run per chunk
        model.decoder_call.shape.piece = 7
        monkeypatch.setattr(Linear, "PIECE", 7)
        monkeypatch.setattr(cpu_kernels, "PREFILL_SCRATCH_BYTES", 1)
    seqs = prompts(5, 5, 40, 60)
    tables = [eng.kv.pool.allocate(-(-len(p) // bs)) for p in seqs]
    starts = [33, 20, 20, 0, 0]
    for p, table, start in zip(seqs, tables, starts):
        if start:
            model.use_decoder_call = False
            model.forward(build_batch([SeqChunk(p[:start], 0, table, True)], bs, model.device, True))
    chunks = [SeqChunk(seqs[0][33:34], 33, tables[0], True),             # a decode
              SeqChunk(seqs[1][20:40], 20, tables[1], True),             # new tokens after cached ones
              SeqChunk(seqs[2][20:23], 20, tables[2], False),            # a chunk in the middle of a prompt
              SeqChunk(seqs[3][:37], 0, tables[3], True),                # a whole fresh prompt
              SeqChunk(seqs[4][:9], 0, tables[4], False)]
    step = build_batch(chunks, bs, model.device, True)
    results = {}
    for fused in (False, True):
        model.use_decoder_call = fused
        results[fused] = (model.forward(step), model.forward(step, all_logits=True))
    for loop, one_call in zip(results[False], results[True]):
        assert torch.equal(loop, one_call)
    assert results[True][0].shape[0] == 3 and results[True][1].shape[0] == step.input_ids.shape[0]
