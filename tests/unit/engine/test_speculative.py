"""Speculative decoding: prompt lookup, verification (greedy: token-for-token; sampled: the target's
distribution, tested statistically), the KV roll-back, the cost rule that switches speculation off, its
counters, and the errors for settings and draft models the engine cannot take."""
from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from tokenfleet_serving.engine import LLMEngine, SamplingParams
from tokenfleet_serving.engine import speculative as spec_module
from tokenfleet_serving.engine.batch import SeqChunk, build_batch
from tokenfleet_serving.engine.config import CheckpointError
from tokenfleet_serving.engine.ngram import TokenHistory, propose
from tokenfleet_serving.engine.rejection_sampler import verify
from tokenfleet_serving.engine.request import Request
from tokenfleet_serving.engine.speculative import SpeculativeConfig, SpeculativeConfigError, StepCost, choose, draft_count, expected_tokens
from tokenfleet_serving.testing_models import create_random_checkpoint

GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller random model with the test checkpoints' vocabulary and tokenizer."""
    return create_random_checkpoint(tmp_path_factory.mktemp("draft") / "draft", num_layers=1, hidden_size=32,
                                    num_heads=2, num_kv_heads=1, intermediate_size=64, initializer_range=0.2, seed=9)


@pytest.fixture(scope="module")
def near_draft_dir(llama_dir, tmp_path_factory):
    """The llama test checkpoint with a perturbed lm_head: its distributions overlap the target's without
    being equal, so verification both accepts and rejects sampled drafts."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("near") / "near"
    shutil.copytree(llama_dir, path)
    [weights_file] = sorted(path.glob("*.safetensors"))
    tensors = load_file(str(weights_file))
    gen = torch.Generator().manual_seed(0)
    head = tensors["lm_head.weight"]
    tensors["lm_head.weight"] = head * (1 + 0.7 * torch.randn(head.shape, generator=gen))
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    return path


def repetitive_prompts(seed: int, n: int, vocab: int = 512) -> list[list[int]]:
    """Prompts that repeat spans of themselves, so prompt lookup finds matches (and random models, which
    fall into loops, often agree with them)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        span = [rng.randrange(5, vocab) for _ in range(rng.randrange(6, 20))]
        out.append(span + [rng.randrange(5, vocab)] + span[:rng.randrange(2, len(span))])
    return out


def engine(path, speculative=None, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", 4 << 20)
    kw.setdefault("block_size", 4)
    return LLMEngine.from_pretrained(path, dtype="float32", device="cpu", speculative=speculative, **kw)


def fixed(method: str, draft=None, k: int = 4) -> SpeculativeConfig:
    """Speculation in every step that has drafts (no cost rule), so the tests exercise verification."""
    return SpeculativeConfig(method, k, draft_model=str(draft) if draft else None, prompt_lookup_min=1,
                             adaptive=False)


# ---- prompt lookup -------------------------------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_longest_earliest_match():
    t = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 1, 2, 3, 4])
    assert propose(t, 3, 1, 4) == [5, 9, 2]            # suffix 1 2 3 4 matches at 0 (longest, earliest)
    assert propose(t, 10, 1, 4) == [5, 9, 2, 3, 4, 7, 1, 2, 3, 4]
    assert propose(np.array([8, 2, 3, 6, 5, 2, 3]), 2, 2, 3) == [6, 5]       # n = 2 after 3 found nothing
    assert propose(np.array([1, 2, 3, 4]), 3, 1, 4) == []                    # nothing repeats
    assert propose(np.array([5, 6, 5, 6]), 3, 3, 4) == []                    # below prompt_lookup_min
    assert propose(np.array([7, 7, 7]), 3, 1, 2) == [7]                      # overlapping match
    assert propose(t, 0, 1, 4) == []


def test_token_history_extends_and_restarts():
    h = TokenHistory()
    tokens = list(range(300))
    assert h.sync(tokens[:10]).tolist() == tokens[:10]
    assert h.sync(tokens).tolist() == tokens                                 # grows past its buffer
    assert h.sync([1, 2, 3]).tolist() == [1, 2, 3]                           # not an extension


# ---- verification --------------------------------------------------------------------------------------
def test_greedy_verification_accepts_the_argmax_prefix_and_adds_one_token():
    req = Request("r", [1], SamplingParams(temperature=0.0))
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 3, 5, 1]):
        logits[row, best] = 1.0
    assert verify(logits, [2, 3, 5], req).tokens == [2, 3, 5, 1]            # all accepted, then the bonus
    assert verify(logits, [2, 4, 5], req).tokens == [2, 3]                  # first mismatch: the argmax
    result = verify(logits, [0, 3, 5], req)
    assert (result.tokens, result.num_accepted) == ([2], 0)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs``: the p-value (the upper tail of the
    chi-square distribution, a regularized incomplete gamma function)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token the target gives no probability was emitted"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    observed = counts[keep]
    rare = expected < 5                    # cells expecting fewer than 5 counts are pooled into one
    if rare.any():
        expected = np.append(expected[~rare], expected[rare].sum())
        observed = np.append(observed[~rare], observed[rare].sum())
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
def test_sampled_verification_emits_the_target_distribution(drafter):
    """Whatever the drafts, the first emitted token is distributed as p_0, and after an accepted first draft
    the second as p_1 (chi-square over 6,000 verifications, seeded: p-value well above 1e-3)."""
    gen = torch.Generator().manual_seed(11)
    vocab, k = 6, 2
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=-1)
    req = Request("r", [1], SamplingParams(temperature=1.0, seed=5))
    first, second = np.zeros(vocab), np.zeros(vocab)
    second_likeliest = [int(row.argsort()[-2]) for row in p[:k]]
    accepted = 0
    for _ in range(6_000):
        if drafter == "draft-model":
            drafts = [int(torch.multinomial(q[i], 1, generator=req.generator)) for i in range(k)]
            result = verify(p.log(), drafts, req, q)
        else:
            drafts = second_likeliest                         # deterministic drafts, as prompt lookup's
            result = verify(p.log(), drafts, req)
        first[result.tokens[0]] += 1
        if result.num_accepted >= 1:
            accepted += 1
            second[result.tokens[1]] += 1
    assert chi_square_p(first, p[0].numpy()) > 1e-3
    assert accepted > 300 and chi_square_p(second, p[1].numpy()) > 1e-3


# ---- greedy output is plain decoding's, token for token ------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("name", ["llama", "llama3-tied", "qwen2"])     # plain, 4:1 GQA + tied, q/k/v biases
def test_greedy_speculative_output_is_token_for_token_plain_decoding(method, name, checkpoints, draft_dir):
    path = checkpoints[name]
    batch = repetitive_prompts(3, 8)
    plain = engine(path).generate(batch, GREEDY)
    spec = engine(path, fixed(method, draft_dir if method == "draft" else None))
    got = spec.generate(batch, GREEDY)
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in plain]
    stats = spec.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_steps_speculated > 0
    if method == "ngram":                       # drafts were rejected: the KV roll-back ran
        assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_draft_model_identical_to_the_target_accepts_everything(llama_dir):
    spec = engine(llama_dir, fixed("draft", llama_dir, k=3))
    [out] = spec.generate([[5, 6, 7]], SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True))
    assert out.new_token_ids == engine(llama_dir).generate([[5, 6, 7]], SamplingParams(
        max_tokens=21, temperature=0.0, ignore_eos=True))[0].new_token_ids
    s = spec.stats().spec_decode
    assert s.num_accepted_tokens == s.num_draft_tokens == 3 * s.num_drafts
    assert s.accepted_per_position == [s.num_drafts] * 3
    assert spec.stats().num_steps == 1 + 5              # the prefill, then 4 tokens per verification


def test_stops_inside_accepted_drafts_end_the_request_exactly_where_plain_decoding_does(llama_dir):
    prompts = repetitive_prompts(5, 3)
    plain, spec = engine(llama_dir), engine(llama_dir, fixed("draft", llama_dir))
    ref = plain.generate(prompts, GREEDY)
    for out, prompt in zip(ref, prompts):
        stop_token = out.new_token_ids[7]
        params = [SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop_token,))]
        for p in params:
            want = plain.generate([prompt], p)[0]
            got = spec.generate([prompt], p)[0]
            assert (got.new_token_ids, got.finish_reason, got.stop_reason, got.text_delta) == \
                (want.new_token_ids, want.finish_reason, want.stop_reason, want.text_delta)


def test_prefix_hits_preemption_and_chunked_prefill_keep_greedy_output(llama_dir, near_draft_dir):
    """A pool too small for the batch (preemptions), a small token budget (chunked prefill, drafts cut to the
    budget) and shared prefixes (prefix-cache hits on blocks next to rolled-back drafts)."""
    shared = repetitive_prompts(7, 1)[0] * 3
    batch = [shared + tail for tail in repetitive_prompts(8, 10)]
    kw = dict(kv_cache_bytes=56 * 4 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=24)
    plain = engine(llama_dir, **kw)
    want = plain.generate(batch, GREEDY)
    spec = engine(llama_dir, fixed("draft", near_draft_dir), **kw)      # its drafts often, not always, hold
    got = spec.generate(batch, GREEDY)
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    stats = spec.stats()
    assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens


def test_verification_rows_have_the_bits_of_plain_decode_rows(llama_dir):
    """The engine verifies a request's last token and drafts as one-token decode rows, each attending its own
    prefix: their logits are bitwise those of decoding the same tokens one step at a time."""
    eng = engine(llama_dir)
    model, bs = eng.runner, eng.kv.block_size
    tokens = repetitive_prompts(9, 1)[0]
    table = eng.kv.pool.allocate(-(-(len(tokens) + 8) // bs))
    model.forward(build_batch([SeqChunk(tokens[:-4], 0, table, True)], bs, model.device, model.compiled_prefill))
    n = len(tokens) - 4
    rows = [SeqChunk([t], n + i, table, True) for i, t in enumerate(tokens[-4:])]
    together = model.forward(build_batch(rows, bs, model.device, model.compiled_prefill))
    one_by_one = torch.cat([model.forward(build_batch([r], bs, model.device, model.compiled_prefill)) for r in rows])
    assert torch.equal(together, one_by_one)


# ---- sampled requests follow the target's distribution ---------------------------------------------------
def exact_joint(eng: LLMEngine, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple, float]:
    """P(first ``length`` tokens) under the target with ``params``' truncation, by enumeration."""
    from tokenfleet_serving.engine.rejection_sampler import target_probs

    req = Request("exact", prompt, params)
    model, bs = eng.runner, eng.kv.block_size
    table = eng.kv.pool.allocate(-(-(len(prompt) + length) // bs))
    out: dict[tuple, float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == length:
            out[tuple(prefix)] = prob
            return
        seq = prompt + prefix
        logits = model.forward(build_batch([SeqChunk(seq, 0, table, True)], bs, model.device,
                                           model.compiled_prefill))
        probs = target_probs(logits, req)[0]
        for t in torch.nonzero(probs).flatten().tolist():
            walk(prefix + [t], prob * float(probs[t]))

    walk([], 1.0)
    eng.kv.pool.release(table)
    return out


def test_seeded_sampling_with_a_draft_model_follows_the_target_distribution(llama_dir, near_draft_dir):
    """The joint distribution of the first four tokens (top_k 2: 16 sequences) over 2,000 seeded requests
    is the target's, computed exactly. The draft's distributions overlap the target's without being equal,
    so drafts are both accepted and rejected (the first token comes from the prefill, the next three from
    verifications: residual draws, accepted drafts and bonus tokens)."""
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=2, seed=s, ignore_eos=True) for s in range(2000)]
    prompt = [11, 12, 13, 14, 15, 11, 12]
    spec = engine(llama_dir, fixed("draft", near_draft_dir, k=2), kv_cache_bytes=32 << 20, max_num_seqs=512,
                  max_num_batched_tokens=8192)
    counts: dict[tuple, int] = {}
    for start in range(0, len(params), 500):
        for out in spec.generate([prompt] * 500, params[start:start + 500]):
            key = tuple(out.new_token_ids)
            counts[key] = counts.get(key, 0) + 1
    exact = exact_joint(engine(llama_dir), prompt, params[0], 4)
    keys = sorted(exact)
    assert set(counts) <= set(exact)
    p_value = chi_square_p(np.array([counts.get(k, 0) for k in keys], dtype=float), np.array([exact[k] for k in keys]))
    assert p_value > 1e-3, (counts, exact)
    s = spec.stats().spec_decode
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    again = spec.generate([prompt], params[:1])[0].new_token_ids
    assert again == spec.generate([prompt], params[:1])[0].new_token_ids          # a seed reproduces its tokens


# ---- the cost rule --------------------------------------------------------------------------------------
def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.6, 4) == pytest.approx(1 + 0.6 + 0.36 + 0.216 + 0.1296)


def test_the_rule_speculates_while_it_raises_tokens_per_second():
    cost = StepCost(base=0.010, per_token=0.0003)                # weight reads ~ 33 tokens of compute
    good, poor = (expected_tokens(0.9, 4) - 1, 4), (expected_tokens(0.3, 4) - 1, 4)
    assert choose([good], 1, cost, 0) == 1                      # batch 1: nearly free rows
    assert choose([poor], 1, cost, 0) == 1
    assert choose([poor] * 64, 64, cost, 0) == 0                # big batch: poor drafts cost more than they give
    assert choose([good] * 16 + [poor] * 48, 64, cost, 0) == 16   # only the good ones still pay
    assert choose([good] * 4, 4, StepCost(0.0, 0.001), 0) == 0    # compute-bound: a row costs a token, k rows
    draft = StepCost(0.010, 0.0003, draft_base=0.002, draft_per_token=0.0001)
    assert choose([poor], 1, draft, 4) == 0             # 4 draft passes outweigh what poor drafts give
    assert choose([good], 1, draft, 4) == 1


def test_each_request_verifies_as_many_drafts_as_pay_at_its_acceptance():
    cheap = StepCost(base=0.010, per_token=0.0003)          # memory-bound: a row is 3 % of a step
    assert draft_count(0.0, 4, 1, cheap, False) == 0          # drafts that never hold never pay
    assert draft_count(0.1, 4, 1, cheap, False) == 1          # one cheap row pays at 10 %, four do not ...
    assert choose([(expected_tokens(0.1, 4) - 1, 4)], 1, cheap, 0) == 0
    assert draft_count(0.9, 4, 1, cheap, False) == 4          # ... and drafts that nearly always hold take all k
    assert draft_count(0.9, 2, 1, cheap, False) == 2          # (never more than the request has room for)
    dear = StepCost(base=0.001, per_token=0.001)              # compute-bound: a row costs what a request does
    assert draft_count(0.6, 4, 32, dear, False) == 0
    # a draft model's forwards count against its drafts
    with_draft = StepCost(base=0.010, per_token=0.0003, draft_base=0.004, draft_per_token=0.0001)
    assert draft_count(0.6, 4, 1, with_draft, True) < draft_count(0.6, 4, 1, cheap, False)


def test_a_measured_step_cost_is_interpolated_and_a_jump_in_it_stops_the_rule():
    # int8-like: flat up to 16 rows (the weights are read once), then three times the cost (widened weights)
    measured = StepCost(base=0.0, per_token=0.0, points=((1, 0.010), (4, 0.011), (16, 0.012), (20, 0.033), (32, 0.036)))
    assert measured.seconds(1) == 0.010 and measured.seconds(0) == 0.010
    assert measured.seconds(10) == pytest.approx(0.0115) and measured.seconds(18) == pytest.approx(0.0225)
    assert measured.seconds(64) == pytest.approx(0.036 + 0.003 / 12 * 32)          # the last slope, onwards
    assert StepCost(0.0, 0.0, points=measured.points, overhead=0.002).seconds(4) == pytest.approx(0.013)
    good = (expected_tokens(0.8, 4) - 1, 4)
    line = StepCost(base=0.010, per_token=(0.036 - 0.010) / 31)     # a straight line through 1 and 32 rows
    assert choose([good] * 4, 4, line, 0) == 4                      # the line thinks 20 rows are cheap ...
    assert choose([good] * 4, 4, measured, 0) == 3                  # ... the measured cost stays under the jump
    assert choose([good], 1, measured, 0) == 1


def test_the_engine_switches_speculation_off_for_big_batches_and_probes(llama_dir, monkeypatch):
    monkeypatch.setattr(spec_module, "measure_cost", lambda *a, **k: StepCost(base=0.010, per_token=0.0003))
    monkeypatch.setattr(spec_module, "OVERHEAD_DECAY", 0.0)      # the given cost only, not this host's timing
    eng = engine(llama_dir, SpeculativeConfig("ngram", 4, prompt_lookup_min=1), kv_cache_bytes=32 << 20,
                 max_num_seqs=64)
    eng.speculator.engine_rate = 0.2                       # a workload whose drafts rarely hold
    eng.generate(repetitive_prompts(1, 64), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    s = eng.stats().spec_decode
    assert s.num_steps_declined >= 32 and s.num_steps_speculated <= s.num_steps_declined // spec_module.PROBE_EVERY + 1
    # one request whose drafts always hold (the draft model is the target): every step speculates
    one = engine(llama_dir, SpeculativeConfig("draft", 4, draft_model=str(llama_dir)))
    one.speculator.cost = StepCost(base=0.010, per_token=0.0003, draft_base=0.001, draft_per_token=0.0001)
    one.generate(repetitive_prompts(2, 1), GREEDY)
    s = one.stats().spec_decode
    assert s.num_steps_declined == 0 and s.num_steps_speculated == s.num_drafts > 0
    # prompt lookup on this random model: its drafts fail, so after a few tries even a lone request stops,
    # where a row costs something (a fifth of a step; at 3 % one draft would still pay at 3 % acceptance)
    alone = engine(llama_dir, SpeculativeConfig("ngram", 4, prompt_lookup_min=1))
    alone.speculator.cost = StepCost(base=0.010, per_token=0.002)
    alone.generate(repetitive_prompts(2, 1), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    s = alone.stats().spec_decode
    assert s.num_accepted_tokens == 0 and s.num_steps_declined > s.num_steps_speculated > 0


def test_the_step_cost_is_measured_on_the_model_and_the_engine(llama_dir):
    eng = engine(llama_dir, SpeculativeConfig("ngram", 4))
    cost = eng.speculator.cost
    assert cost is not None and cost.base >= 0 and cost.per_token > 0
    assert cost.draft_base == cost.draft_per_token == 0
    assert eng.speculator.overhead == 0.0
    eng.generate(repetitive_prompts(4, 2), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert eng.speculator.overhead > 0              # the engine's own time per step outside the forward pass


# ---- settings and draft models the engine cannot take ----------------------------------------------------
@pytest.mark.parametrize("kw,field", [
    (dict(method="medusa"), "method"),
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=17), "num_speculative_tokens"),
    (dict(method="draft"), "draft_model"),
    (dict(method="ngram", draft_model="/x"), "draft_model"),
    (dict(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
])
def test_bad_settings_are_errors_naming_the_setting(kw, field):
    with pytest.raises(SpeculativeConfigError, match=f"^{field} "):
        SpeculativeConfig(**kw)


def test_more_speculative_tokens_than_the_context_is_an_error(llama_dir):
    with pytest.raises(SpeculativeConfigError, match="num_speculative_tokens 8 must be below the context of 8"):
        engine(llama_dir, fixed("ngram", k=8), max_model_len=8)


def test_a_draft_model_with_another_vocabulary_is_an_error_naming_its_file(llama_dir, tmp_path):
    other = create_random_checkpoint(tmp_path / "other-vocab", vocab_size=640, seed=3)
    with pytest.raises(CheckpointError, match=r"other-vocab/config\.json: field 'vocab_size' = 640, but the "
                                              r"target model's is 512"):
        engine(llama_dir, fixed("draft", other))
    swapped = tmp_path / "other-tokenizer"
    shutil.copytree(llama_dir, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[100], sorted(vocab)[200]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match=r"other-tokenizer/tokenizer\.json: the draft's vocabulary differs"):
        engine(llama_dir, fixed("draft", swapped))
    with pytest.raises(CheckpointError, match=r"missing/config\.json: file not found"):
        engine(llama_dir, fixed("draft", tmp_path / "missing"))

