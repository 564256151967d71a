"""``tokenfleet bench levers``: what each cost lever does to $/Mtok, measured in one run on this host.

One row per lever, added one at a time, each measured against the configuration before it on the same
workload:

* baseline: static batches (transformers ``generate``, 16 at a time, each run to its longest request) on WM;
* + continuous batching and the paged KV cache (this engine, prefix caching off) on WM;
* + prefix caching, on WS (every prompt starts with one 512-token prefix);
* + int8 weights, on WS;
* + speculative decoding (prompt lookup), on W5 at batch 1, 4 and 16: extractive requests whose answers copy
  spans of their prompt, served by a Llama of the reference model's size whose first two layers copy by
  construction (``copy_task.py``), int8 weights computed in fp32 (``W5_DTYPE``);
* + a host-memory tier under the prefix cache, and + int8 KV (where this build has ``--kv-cache-dtype``), on
  ``bench kvcache``'s workload (WT: 16 shared 1,024-token prefixes, the accelerator tier holds 3), each
  against the accelerator tier alone.
* + an int8 KV cache, on WL (16 requests of 1,984 prompt + 64 output tokens at once, fp32) with a KV budget of
  four 2,048-token contexts in fp32: the int8 cache holds more of them at once (``kv_quality.py``
  also reports its quality against the model dtype's cache and the concurrency it buys at 1 GiB).

Workloads (seeded): WM, 48 requests of 32-256 prompt and 16-192 output tokens, at most 16 at once; WS,
32 requests of the shared prefix + 32 tokens, 32 output tokens; W5, documents of 96-160 tokens whose answers
the model writes (greedy, up to 96 tokens or EOS), ``batch`` requests in flight at a time; W1 (bench
engine's): 64 x 128 prompt x 128 output tokens at once. Tokens per second count output tokens; TTFT runs from
a request's submission to its first token, TPOT is (last - first) / (tokens - 1); $/Mtok is the price per
hour over output tokens per hour.

``--quick`` runs about a quarter of the work (smaller workloads, W5 at batch 1, 4 and 16 only, one round), for
a host others load; the JSON says ``"quick": true`` and lists the sizes.

It also measures int8 on the reference model (decoding at batch 1 and 4 against the faster unquantized
dtype, W1, weight bytes, quality against the unquantized engine), prompt lookup on W1, a draft model on W5,
and the speculation rule: W5 at batch 1 to 32 with speculation off, always on, and as the rule decides.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine import LLMEngine, SamplingParams
from ..engine.batch import SeqChunk, build_batch
from ..engine.speculative import SpeculativeConfig
from . import copy_task
from .engine import REFERENCE, hardware

MAX_BATCH = 16           # WM and WS: requests in flight at once, for the static batches and the engine alike
# W5's engines compute in fp32 over int8 weights: the faster int8 path at the 1-4 rows where speculation matters, on
# AVX2 and AVX-512 hosts alike (the int8 decode rows of this benchmark measure both dtypes). dtype auto would probe
# at 16 rows, where bf16 can win on an AVX-512 host, and the speculation rows would then measure torch's bf16 path.
W5_DTYPE = "float32"


@dataclass(frozen=True)
class Scale:
    """Workload sizes: the full benchmark, or ``--quick`` (about a quarter of the work, for a loaded host;
    its JSON says so, and its numbers are not the full workloads')."""
    wm_requests: int = 48
    wm_prompt: tuple[int, int] = (32, 256)
    wm_output: tuple[int, int] = (16, 192)
    ws_requests: int = 32
    ws_prefix: int = 512
    w1: tuple[int, int, int] = (64, 128, 128)          # requests, prompt, output
    w5_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    w5_max_tokens: int = 96
    decode_tokens: int = 96
    rounds: int = 2
    w1_rounds: int = 4                                # W1's ratios: the median of this many paired rounds
    quality_sequences: int = 64                       # x 64 positions each (KL: 4,096); 8 x 128 greedy tokens
    wl: tuple[int, int, int] = (16, 1984, 64)         # WL: requests, prompt, output (long contexts, int8 KV)
    wl_contexts: int = 4                              # WL's KV budget: this many 2,048-token contexts in the dtype


FULL = Scale()
QUICK = Scale(wm_requests=24, wm_prompt=(32, 128), wm_output=(16, 96), ws_requests=16, ws_prefix=256,
              w1=(32, 64, 64), w5_batches=(1, 4, 16), w5_max_tokens=64, decode_tokens=48, rounds=1,
              w1_rounds=1, quality_sequences=16, wl=(8, 1984, 32))


@dataclass
class Run:
    label: str
    output_tokens: int
    seconds: float
    ttft: list[float]
    tpot: list[float]
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    def row(self, price_per_hour: float) -> dict:
        tps = self.tokens_per_second
        return {"label": self.label, "output_tokens": self.output_tokens, "seconds": round(self.seconds, 3),
                "tokens_per_second": round(tps, 2), "tokens_per_hour": round(tps * 3600),
                "dollars_per_mtok": round(price_per_hour / (tps * 3600) * 1e6, 4),
                "ttft_p50_s": round(statistics.median(self.ttft), 4),
                "tpot_p50_s": round(statistics.median(self.tpot), 5) if self.tpot else None, **self.extra}


# ---- workloads -------------------------------------------------------------------------------------------
def wm(vocab: int, scale: Scale = FULL, seed: int = 1) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    (p_lo, p_hi), (o_lo, o_hi) = scale.wm_prompt, scale.wm_output
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(p_lo, p_hi + 1))] for _ in range(scale.wm_requests)]
    return prompts, [rng.randrange(o_lo, o_hi + 1) for _ in prompts]


def ws(vocab: int, scale: Scale = FULL, seed: int = 2) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(scale.ws_prefix)]
    n = scale.ws_requests
    return [prefix + [rng.randrange(10, vocab) for _ in range(32)] for _ in range(n)], [32] * n


def w1(vocab: int, scale: Scale = FULL, seed: int = 3) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    n, prompt, output = scale.w1
    return [[rng.randrange(10, vocab) for _ in range(prompt)] for _ in range(n)], [output] * n


# ---- runners ---------------------------------------------------------------------------------------------
def wl(vocab: int, scale: Scale = FULL, seed: int = 6) -> tuple[list[list[int]], list[int]]:
    """WL: long contexts (1,984 prompt + 64 output tokens), all at once, for the int8 KV row."""
    n, prompt, output = scale.wl
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(prompt)] for _ in range(n)], [output] * n


def run_engine(eng: LLMEngine, label: str, prompts: list[list[int]], lengths: list[int] | None,
               concurrency: int | None = None, max_tokens: int = 96) -> Run:
    """Serve ``prompts`` (``concurrency`` in flight, all at once when None); ``lengths``: exact output tokens
    (EOS ignored), or None to stop at EOS / ``max_tokens``. Greedy."""
    eng.reset_prefix_cache()
    pending = list(range(len(prompts)))
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    limit = concurrency or len(prompts)
    started = time.perf_counter()

    def submit() -> None:
        while pending and len(submitted) - len(last_done) < limit:
            i = pending.pop(0)
            rid = f"{label}-{i}"
            params = (SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True) if lengths
                      else SamplingParams(max_tokens=max_tokens, temperature=0.0))
            eng.add_request(rid, prompts[i], params)
            submitted[rid] = time.perf_counter()

    last_done: set[str] = set()
    submit()
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                last_done.add(out.request_id)
        submit()
    seconds = time.perf_counter() - started
    ttft = [first[r] - submitted[r] for r in submitted]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in submitted if count[r] > 1]
    return Run(label, sum(count.values()), seconds, ttft, tpot)


def run_static(model_dir: Path, label: str, prompts: list[list[int]], lengths: list[int], dtype: torch.dtype,
               batch_size: int = MAX_BATCH) -> Run:
    """Static batching as transformers ``generate`` does it: batches of ``batch_size`` in arrival order,
    left-padded, each generating until its longest request is done; all requests arrive at the start."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(batch: list[list[int]], new: int, clock: Clock | None = None) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0, logits_processor=LogitsProcessorList([clock] if clock else []))

    generate([p[:16] for p in prompts[:2]], 2)                       # warm-up
    ttft, tpot = [], []
    started = time.perf_counter()
    for at in range(0, len(prompts), batch_size):
        batch, want = prompts[at:at + batch_size], lengths[at:at + batch_size]
        clock = Clock()
        generate(batch, max(want), clock)
        # the logits of step j are ready when the processor sees them: token j is out then
        for n in want:
            ttft.append(clock.times[0] - started)
            if n > 1:
                tpot.append((clock.times[n - 1] - clock.times[0]) / (n - 1))
    return Run(label, sum(lengths), time.perf_counter() - started, ttft, tpot)


def best_of(runs: list[Run]) -> Run:
    return max(runs, key=lambda r: r.tokens_per_second)


def paired_ratio(runs: list[Run], baseline: list[Run]) -> tuple[float, list[float]]:
    """The median over rounds of tokens/s of ``runs[i]`` over ``baseline[i]`` (run back to back in round i),
    and the rounds' ratios: a round the host's drift slowed moves one ratio, not the answer."""
    ratios = [a.tokens_per_second / b.tokens_per_second for a, b in zip(runs, baseline, strict=True)]
    return statistics.median(ratios), ratios


# ---- int8 quality -----------------------------------------------------------------------------------------
@torch.inference_mode()
def sequence_logits(eng: LLMEngine, seq: list[int]) -> torch.Tensor:
    """fp32 logits of every position of ``seq``, in one forward over a free part of the pool."""
    model, bs = eng.runner, eng.kv.block_size
    table = eng.kv.pool.allocate(-(-len(seq) // bs))
    try:
        return model.forward(build_batch([SeqChunk(seq, 0, table, True)], bs, model.device, model.compiled_prefill),
                             all_logits=True).float()
    finally:
        eng.kv.pool.release(table)


def fp32_and_int8(model_dir: Path) -> tuple[LLMEngine, LLMEngine]:
    """The unquantized engine and the int8 one, both computing in fp32: the pair the quality measures compare."""
    kw = dict(dtype="float32", kv_cache_bytes=128 << 20, load_tokenizer=False)
    return LLMEngine.from_pretrained(model_dir, **kw), LLMEngine.from_pretrained(model_dir, **kw, quantization="int8")


def greedy_agreement(ref: LLMEngine, q8: LLMEngine, prompts: list[list[int]], tokens: int,
                     near_tie: float) -> dict:
    """Greedy agreement of ``q8`` with ``ref`` over ``tokens`` answer tokens of each prompt: teacher-forced
    (q8's argmax after the reference's own tokens) and free-running (tokens before the first difference).
    A disagreement where the reference's top two logits are closer than ``near_tie`` is a near tie."""
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    agree = total = near_ties = identical = 0
    for prompt, ref_gen, q8_gen in zip(prompts, ref.generate(prompts, greedy), q8.generate(prompts, greedy)):
        seq = prompt + ref_gen.new_token_ids
        a, b = sequence_logits(ref, seq)[-tokens - 1:-1], sequence_logits(q8, seq)[-tokens - 1:-1]
        ref_tokens = torch.tensor(ref_gen.new_token_ids)
        same = b.argmax(-1) == ref_tokens
        agree += int(same.sum())
        total += len(ref_tokens)
        top2 = a.topk(2, dim=-1).values
        near_ties += int(((top2[:, 0] - top2[:, 1]) < near_tie)[~same].sum())
        for x, y in zip(ref_gen.new_token_ids, q8_gen.new_token_ids):
            if x != y:
                break
            identical += 1
    return {"agreement": agree / total, "tokens": total, "disagreements": total - agree,
            "disagreements_at_near_ties": near_ties,
            "agreement_outside_near_ties": (agree + near_ties) / total if total else None,
            "free_running_identical_fraction": identical / total}


def divergence(ref: LLMEngine, other: LLMEngine, vocab: int, sequences: int = 64) -> dict:
    """``other`` against ``ref`` on the same seeded prompts: KL(p_ref || p_other) and max |logit difference| of
    the next-token distribution over ``sequences`` x 64 positions (64 prompt tokens, then 64 of ``ref``'s greedy
    tokens, teacher-forced into both), and ``greedy_agreement`` over 8 x 128 tokens with the largest logit
    difference seen as its near-tie margin (under ``greedy``)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(10, vocab) for _ in range(64)] for _ in range(sequences + 8)]
    ref_out = ref.generate(prompts[:sequences], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    kls, max_diff = [], 0.0
    for prompt, out in zip(prompts[:sequences], ref_out):
        seq = prompt + out.new_token_ids
        a, b = sequence_logits(ref, seq)[-64:], sequence_logits(other, seq)[-64:]
        lp, lq = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kls.append((lp.exp() * (lp - lq)).sum(-1))
        max_diff = max(max_diff, float((a - b).abs().max()))
    kl = torch.cat(kls)
    return {"mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "max_abs_logit_diff": max_diff,
            "kl_positions": int(kl.numel()), "greedy": greedy_agreement(ref, other, prompts[sequences:], 128, max_diff)}


def int8_quality(model_dir: Path, vocab: int, sequences: int = 64) -> dict:
    """The int8 engine against the unquantized one (both fp32): KL(p || p_int8) and max |logit difference| of
    the next-token distribution over ``sequences`` x 64 positions (4,096 by default: 64 sequences of 64 prompt
    + 64 greedy tokens), and greedy agreement over 1,024 tokens (8 x 128, ``greedy_agreement``); a near tie
    is a position whose reference top two logits are closer than the largest logit difference seen."""
    ref, q8 = fp32_and_int8(model_dir)
    d = divergence(ref, q8, vocab, sequences)
    g = d["greedy"]
    return {"int8_mean_kl": d["mean_kl"], "int8_max_kl": d["max_kl"], "int8_max_abs_logit_diff": d["max_abs_logit_diff"],
            "int8_kl_positions": d["kl_positions"], "int8_greedy_agreement": g["agreement"],
            "int8_greedy_tokens": g["tokens"], "int8_greedy_disagreements": g["disagreements"],
            "int8_greedy_disagreements_at_near_ties": g["disagreements_at_near_ties"],
            "int8_greedy_agreement_outside_near_ties": g["agreement_outside_near_ties"],
            "int8_free_running_identical_fraction": g["free_running_identical_fraction"],
            "int8_weight_bytes": q8.runner.weight_bytes(), "unquantized_weight_bytes": ref.runner.weight_bytes(),
            "int8_weight_bytes_ratio": q8.runner.weight_bytes() / ref.runner.weight_bytes()}


def int8_copy_model_agreement(model_dir: Path, prompts: list[list[int]], tokens: int) -> dict:
    """Greedy agreement of int8 with fp32 on W5's copying model, whose next token is a confident choice (it
    copies), not one of the near ties of random weights; a near tie here is top two logits within 0.01."""
    return greedy_agreement(*fp32_and_int8(model_dir), prompts, tokens, 0.01)


def copied_fraction(model_dir: Path, prompts: list[list[int]]) -> float:
    """Share of the bigrams of greedy answers (96 tokens) that occur in their prompt: how much the model copies."""
    eng = engine(model_dir, kv_cache_bytes=64 << 20)
    hits = total = 0
    for prompt, out in zip(prompts, eng.generate(prompts, SamplingParams(max_tokens=96, temperature=0.0))):
        seen = set(zip(prompt, prompt[1:]))
        tokens = prompt[-1:] + out.new_token_ids
        pairs = list(zip(tokens, tokens[1:]))
        hits += sum(1 for pair in pairs if pair in seen)
        total += len(pairs)
    return hits / max(total, 1)


# ---- the benchmark ------------------------------------------------------------------------------------------
def engine(model_dir: Path, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", 512 << 20)
    kw.setdefault("load_tokenizer", False)
    return LLMEngine.from_pretrained(model_dir, **kw)


def decode_speed(engines: dict[str, LLMEngine], vocab: int, batch: int, rounds: int = 2,
                 tokens: int = 96) -> dict[str, float]:
    """Output tokens/s of each engine decoding ``batch`` requests of 64 prompt + ``tokens`` output tokens
    (alternating)."""
    rng = random.Random(batch)
    prompts = [[rng.randrange(10, vocab) for _ in range(64)] for _ in range(batch)]
    best = dict.fromkeys(engines, 0.0)
    for _ in range(rounds):
        for name, eng in engines.items():
            best[name] = max(best[name], run_engine(eng, name, prompts, [tokens] * batch).tokens_per_second)
    return best


def kv_tier_rows(price: float, work: Path, scale: Scale, log) -> list[dict]:
    """The KV cache's tiers on WT (``bench kvcache``'s workload and engines): the accelerator tier alone, + a host
    tier, + int8 KV on top when this build has it."""
    from . import kvcache

    log("rows 8-9: KV cache tiers on WT")
    requests = 32 if scale == FULL else 12
    args = argparse.Namespace(concurrency=2, host_mb=320, disk_mb=1024, threads=None)
    model = kvcache.create_random_checkpoint(work / "kvcache-model", **kvcache.MODEL, seed=5)
    bench = kvcache.Bench(args, model, work)
    wt = kvcache.Workload.make(requests)
    configs = [("hbm_only", "KV cache: accelerator tier only"), ("host_tier", "+ host-memory tier (KV offload)")]
    if kvcache.has_kv_cache_dtype():
        configs.append(("int8_kv", "+ int8 KV (host and disk tiers)"))
    runs: list[Run] = []
    for name, label in configs:
        eng = bench.config_engine(name, work / f"kvcache-disk-{name}")
        try:
            kvcache.serve(eng, wt.warmup, 1, f"{name}-warm")
            r = kvcache.serve(eng, wt.measured, args.concurrency, name)
        finally:
            eng.close()
        runs.append(Run(label, r["tokens"], r["seconds"], r["ttft"], [],
                        {"ttft_p95_s": round(kvcache.percentile(r["ttft"], 0.95), 4)}))
    out = [runs[0].row(price) | {"workload": "WT"}]
    for prev, run in zip(runs, runs[1:]):
        out.append(run.row(price) | {"workload": "WT", "vs_previous": round(run.tokens_per_second / prev.tokens_per_second, 3)})
    return out


def measure(price: float, model_dir: Path | None, work: Path, train_seconds: float, draft_seconds: float,
            log, scale: Scale = FULL) -> dict:
    result: dict = {"price_per_hour": price, "hardware": hardware(), "loadavg_start": os.getloadavg(),
                    "quick": scale != FULL, "scale": vars(scale)}
    if model_dir is None:
        from ..testing_models import create_random_checkpoint
        model_dir = create_random_checkpoint(work / "reference", **REFERENCE)
    vocab = REFERENCE["vocab_size"] if model_dir == work / "reference" else engine(model_dir).model_config.vocab_size

    # W5's models: a copying model and a smaller draft, built as induction circuits, or (--train-seconds)
    # trained here on the copying task; reused from --work-dir when there
    target_dir, draft_dir = work / "copy-target", work / "copy-draft"
    for directory, circuit, shape, seconds, seed in (
            (target_dir, copy_task.CIRCUIT_TARGET, copy_task.TARGET, train_seconds, 0),
            (draft_dir, copy_task.CIRCUIT_DRAFT, copy_task.DRAFT, draft_seconds, 1)):
        if not (directory / "copy_task.json").exists():
            if seconds > 0:
                log(f"training {directory.name} for up to {seconds:.0f} s")
                copy_task.train(directory, shape, seconds=seconds, seed=seed, log=log)
            else:
                copy_task.build(directory, circuit)
        result[f"w5_{directory.name.replace('-', '_')}"] = json.loads((directory / "copy_task.json").read_text())

    auto = engine(model_dir)
    dtype = auto.dtype
    result["auto_dtype"] = auto.dtype_choice.name
    rows: list[dict] = []

    log("rows 1-2: static batches vs continuous batching on WM")
    prompts, lengths = wm(vocab, scale)
    static = run_static(model_dir, "baseline: static batch (transformers generate)", prompts, lengths, dtype)
    cb_engine = engine(model_dir, enable_prefix_caching=False, max_num_seqs=MAX_BATCH, max_num_batched_tokens=4096)
    cb = run_engine(cb_engine, "+ continuous batching + paged KV", prompts, lengths)
    rows += [static.row(price) | {"workload": "WM"},
             cb.row(price) | {"workload": "WM", "vs_previous": round(cb.tokens_per_second / static.tokens_per_second, 3)}]

    log("rows 3-4: prefix caching and int8 on WS")
    prompts, lengths = ws(vocab, scale)
    no_pc = run_engine(cb_engine, "continuous batching, no prefix caching", prompts, lengths)
    pc_engine = engine(model_dir, max_num_seqs=MAX_BATCH, max_num_batched_tokens=4096)
    pc = run_engine(pc_engine, "+ prefix caching", prompts, lengths)
    q8_engine = engine(model_dir, max_num_seqs=MAX_BATCH, max_num_batched_tokens=4096, quantization="int8")
    q8 = run_engine(q8_engine, "+ int8", prompts, lengths)
    rows += [pc.row(price) | {"workload": "WS", "vs_previous": round(pc.tokens_per_second / no_pc.tokens_per_second, 3)},
             q8.row(price) | {"workload": "WS", "vs_previous": round(q8.tokens_per_second / pc.tokens_per_second, 3)}]
    result["ws_without_prefix_caching"] = no_pc.row(price)
    del cb_engine, pc_engine, q8_engine

    log("rows 5-7: prompt lookup on W5 at batch 1, 4, 16")
    w5 = copy_task.prompts(copy_task.W5, 32, seed=11)
    result["w5_copied_bigram_fraction"] = copied_fraction(target_dir, w5[:8])
    w5_engine = dict(quantization="int8", dtype=W5_DTYPE, max_num_seqs=64)
    plain = engine(target_dir, **w5_engine)
    ngram = engine(target_dir, **w5_engine, speculative=SpeculativeConfig("ngram", 4))
    drafted = engine(target_dir, **w5_engine, speculative=SpeculativeConfig("draft", 4, draft_model=str(draft_dir)))
    always = engine(target_dir, **w5_engine, speculative=SpeculativeConfig("ngram", 4, adaptive=False))
    sweep = []
    for batch in scale.w5_batches:
        requests = w5[:max(2 if scale != FULL else 4, batch)]
        runs = {}
        for name, eng in (("off", plain), ("rule", ngram), ("always", always)):
            before = eng.stats().spec_decode
            runs[name] = best_of([run_engine(eng, f"w5-{name}-{batch}", requests, None, concurrency=batch,
                                             max_tokens=scale.w5_max_tokens)
                                  for _ in range(scale.rounds if batch <= 4 else 1)])
            after = eng.stats().spec_decode
            if after is not None:
                steps = (after.num_steps_speculated - before.num_steps_speculated,
                         after.num_steps_declined - before.num_steps_declined)
                runs[name].extra = {"steps_speculated": steps[0], "steps_declined": steps[1],
                                    "acceptance_rate": ((after.num_accepted_tokens - before.num_accepted_tokens)
                                                        / max(1, after.num_draft_tokens - before.num_draft_tokens))}
        point = {"batch": batch, **{f"{name}_tokens_per_second": round(r.tokens_per_second, 2) for name, r in runs.items()},
                 "rule_speedup": round(runs["rule"].tokens_per_second / runs["off"].tokens_per_second, 3),
                 "always_speedup": round(runs["always"].tokens_per_second / runs["off"].tokens_per_second, 3),
                 "rule": runs["rule"].extra, "always": runs["always"].extra}
        sweep.append(point)
        log(f"  W5 batch {batch}: {point}")
        if batch in (1, 4, 16):
            rule = runs["rule"]
            rule.label = f"+ speculative decoding (ngram), batch {batch}"
            rows.append(rule.row(price) | {"workload": f"W5 batch {batch}",
                                           "vs_previous": point["rule_speedup"], "without": runs["off"].row(price)})
    result["speculation_sweep"] = sweep
    by_batch = {p["batch"]: p for p in sweep}
    result["ngram_speedup_batch1"] = by_batch[1]["rule_speedup"]
    result["ngram_speedup_batch4"] = by_batch[4]["rule_speedup"]
    result["ngram_speedup_batch16"] = by_batch[16]["rule_speedup"]
    result["ngram_acceptance_rate"] = by_batch[1]["rule"]["acceptance_rate"]
    few = w5[:2 if scale != FULL else 4]
    draft_runs = [run_engine(drafted, "w5-draft-1", few, None, 1, scale.w5_max_tokens) for _ in range(scale.rounds)]
    off_runs = [run_engine(plain, "w5-off-1", few, None, 1, scale.w5_max_tokens) for _ in range(scale.rounds)]
    result["draft_speedup_batch1"] = round(best_of(draft_runs).tokens_per_second / best_of(off_runs).tokens_per_second, 3)
    ds = drafted.stats().spec_decode
    result["draft_acceptance_rate"] = ds.num_accepted_tokens / max(1, ds.num_draft_tokens) if ds else None
    result["speculation_cost_model"] = {"ngram": vars(ngram.speculator.cost) if ngram.speculator.cost else None,
                                        "draft": vars(drafted.speculator.cost) if drafted.speculator.cost else None}
    del plain, ngram, drafted, always

    log("int8 on the reference model: decode speed, W1, quality")
    engines = {"float32": engine(model_dir, dtype="float32", kv_cache_bytes=128 << 20),
               "bfloat16": engine(model_dir, dtype="bfloat16", kv_cache_bytes=128 << 20),
               "int8/float32": engine(model_dir, dtype="float32", kv_cache_bytes=128 << 20, quantization="int8"),
               "int8/bfloat16": engine(model_dir, dtype="bfloat16", kv_cache_bytes=128 << 20, quantization="int8")}
    for batch in (1, 4):
        speeds = decode_speed(engines, vocab, batch, scale.rounds, scale.decode_tokens)
        plain_best = max(speeds["float32"], speeds["bfloat16"])
        q8_best = max(speeds["int8/float32"], speeds["int8/bfloat16"])
        result[f"int8_decode_batch{batch}_tokens_per_second"] = {k: round(v, 2) for k, v in speeds.items()}
        result[f"int8_speedup_batch{batch}"] = round(q8_best / plain_best, 3)
        log(f"  decode batch {batch}: {speeds}")
    del engines
    prompts, lengths = w1(vocab, scale)
    w1_engines = {"unquantized": engine(model_dir, max_num_batched_tokens=8192),
                  "int8": engine(model_dir, max_num_batched_tokens=8192, quantization="int8"),
                  "ngram": engine(model_dir, max_num_batched_tokens=8192, speculative=SpeculativeConfig("ngram", 4))}
    w1_runs: dict[str, list[Run]] = {name: [] for name in w1_engines}
    for i in range(scale.w1_rounds):
        order = list(w1_engines.items())
        for name, eng in order if i % 2 == 0 else order[::-1]:      # alternating: no engine always goes first
            w1_runs[name].append(run_engine(eng, f"w1-{name}", prompts, lengths))
    w1_best = {name: best_of(r).tokens_per_second for name, r in w1_runs.items()}
    result["w1_tokens_per_second"] = {k: round(v, 2) for k, v in w1_best.items()}
    # each round runs the three engines back to back: a ratio within a round sees the same host speed, and the
    # median of the rounds' ratios leaves out a round that the VM's drift (or a neighbour) slowed
    for lever in ("int8", "ngram"):
        ratio, ratios = paired_ratio(w1_runs[lever], w1_runs["unquantized"])
        result[f"{lever}_w1_round_ratios"] = [round(r, 3) for r in ratios]
        result[f"{lever}_w1_ratio"] = round(ratio, 3)
    sd = w1_engines["ngram"].stats().spec_decode
    result["ngram_w1_steps"] = {"speculated": sd.num_steps_speculated, "declined": sd.num_steps_declined} if sd else None
    del w1_engines
    rows += kv_tier_rows(price, work, scale, log)
    result.update(int8_quality(model_dir, vocab, scale.quality_sequences))

    log("row 11: int8 KV cache on WL (long contexts at a fixed KV budget), its quality and capacity")
    from . import kv_quality
    prompts, lengths = wl(vocab, scale)
    probe = engine(model_dir, kv_cache_bytes=1 << 20, dtype="float32")
    budget = scale.wl_contexts * -(-2048 // probe.kv.block_size) * probe.runner.kv_block_bytes(probe.kv.block_size)
    del probe
    # fp32 (as W5's rows): the compiled kernels read the int8 cache in place; bf16 and fp16 run the PyTorch path,
    # which dequantizes every gathered block (correct, not fast)
    wl_kw = dict(kv_cache_bytes=budget, max_num_seqs=MAX_BATCH, max_num_batched_tokens=2048, dtype="float32")
    full_kv = run_engine(engine(model_dir, **wl_kw), "paged KV in the model dtype", prompts, lengths)
    int8_kv = run_engine(engine(model_dir, **wl_kw, kv_cache_dtype="int8"), "+ int8 KV cache", prompts, lengths)
    rows += [int8_kv.row(price) | {"workload": f"WL, KV budget {budget >> 20} MiB",
                                   "vs_previous": round(int8_kv.tokens_per_second / full_kv.tokens_per_second, 3),
                                   "without": full_kv.row(price)}]
    result["int8_kv_wl_ratio"] = round(int8_kv.tokens_per_second / full_kv.tokens_per_second, 3)
    q = kv_quality.kv_quality(model_dir, vocab, scale.quality_sequences)
    result["int8_kv_reference"] = q
    result["int8_kv_mean_kl"], result["int8_kv_max_abs_logit_diff"] = q["mean_kl"], q["max_abs_logit_diff"]
    g = greedy_agreement(*(engine(target_dir, dtype="float32", kv_cache_bytes=128 << 20, kv_cache_dtype=kv)
                           for kv in ("auto", "int8")), w5[-8:], 128 if scale == FULL else 64, 0.01)
    result["int8_kv_w5"], result["int8_kv_greedy_agreement_w5"] = g, g["agreement"]
    cap = kv_quality.capacity(model_dir, vocab, "bfloat16", confirm=False)
    result["int8_kv_capacity_bfloat16"], result["concurrent_seqs_ratio_int8"] = cap, cap["ratio"]
    result["int8_copy_model_greedy"] = int8_copy_model_agreement(target_dir, w5[-8:], 128 if scale == FULL else 64)
    result["rows"] = rows
    result["loadavg_end"] = os.getloadavg()
    return result


def table(result: dict) -> str:
    lines = [f"price ${result['price_per_hour']:g}/h; {result['hardware']['cpu']} ({result['hardware']['isa']}), "
             f"{result['hardware']['cores']} cores, dtype auto = {result['auto_dtype']}; load average "
             f"{result['loadavg_start'][0]:.2f} -> {result['loadavg_end'][0]:.2f}",
             "| lever | workload | tokens/s | tokens/h | $/Mtok | TTFT p50 (s) | TPOT p50 (s) | x previous |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['label']} | {r['workload']} | {r['tokens_per_second']:.1f} | {r['tokens_per_hour']:,} | "
                     f"{r['dollars_per_mtok']:.3f} | {r['ttft_p50_s']:.3f} | {r['tpot_p50_s'] or 0:.4f} | "
                     f"{r.get('vs_previous', '')} |")
    keys = ("ngram_speedup_batch1", "ngram_speedup_batch4", "ngram_speedup_batch16", "ngram_acceptance_rate",
            "ngram_w1_ratio", "draft_speedup_batch1", "int8_speedup_batch1", "int8_speedup_batch4", "int8_w1_ratio",
            "int8_weight_bytes_ratio", "int8_greedy_agreement", "int8_greedy_agreement_outside_near_ties",
            "int8_mean_kl", "int8_max_abs_logit_diff", "int8_kv_wl_ratio", "int8_kv_mean_kl",
            "int8_kv_max_abs_logit_diff", "int8_kv_greedy_agreement_w5", "concurrent_seqs_ratio_int8")
    lines += [f"{k}: {result[k]:.4g}" for k in keys if isinstance(result.get(k), (int, float))]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    rows = result["rows"]
    names = [f"{r['label']}\n({r['workload']})" for r in rows]
    left.barh(range(len(rows)), [r["dollars_per_mtok"] for r in rows], color="tab:blue")
    left.set_yticks(range(len(rows)), names, fontsize=7)
    left.invert_yaxis()
    left.set_xscale("log")
    left.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel(f"\\$ per million output tokens at \\${result['price_per_hour']:g}/h (log scale)")
    left.set_title("cost per token, one lever at a time")
    sweep = result["speculation_sweep"]
    batches = [p["batch"] for p in sweep]
    for key, label in (("off_tokens_per_second", "no speculation"), ("always_tokens_per_second", "prompt lookup, always"),
                       ("rule_tokens_per_second", "prompt lookup, cost rule")):
        right.plot(batches, [p[key] for p in sweep], marker="o", label=label)
    right.set_xscale("log", base=2)
    right.set_xlabel("requests in flight (W5)")
    right.set_ylabel("output tokens/s")
    right.set_title("speculation and batch size")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenfleet bench levers", description=__doc__.splitlines()[0])
    p.add_argument("--price-per-hour", type=float, required=True, help="accelerator (here: host) $/h")
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="draw $/Mtok per lever and the speculation sweep (PNG)")
    p.add_argument("--model", default=None, help="reference checkpoint (default: bench engine's, generated)")
    p.add_argument("--work-dir", default=None,
                   help="where the trained W5 models go (reused when present; default: a temporary directory)")
    p.add_argument("--train-seconds", type=float, default=0.0,
                   help="train W5's copy model for this long instead of building its induction circuit (0: build)")
    p.add_argument("--draft-train-seconds", type=float, default=0.0, help="likewise for W5's draft model")
    p.add_argument("--quick", action="store_true",
                   help="about a quarter of the work (smaller workloads, one round): for a loaded host")
    args = p.parse_args(argv)
    log = lambda message: print(message, flush=True)      # noqa: E731
    with tempfile.TemporaryDirectory(prefix="tokenfleet-levers-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = measure(args.price_per_hour, Path(args.model) if args.model else None, work, args.train_seconds,
                         args.draft_train_seconds, log, QUICK if args.quick else FULL)
    print(table(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2, default=str))
    if args.plot:
        plot(result, args.plot)
    return 0
