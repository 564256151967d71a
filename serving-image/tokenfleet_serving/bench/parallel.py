"""``tokenfleet bench parallel``: one replica over several ranks (tensor parallelism), on one host.

Every configuration gets the same total cores: tp=1 is one process with all of them as threads, tp=N is N
rank processes with an equal share each. Reported:

* W1 (64 requests x 128 prompt x 128 output tokens, greedy, the ``bench engine`` reference model) output
  tokens/s at each tp, and the greedy agreement and largest |logit difference| of tp=2 against tp=1;
* weight bytes and KV blocks per rank at one per-rank KV budget (so blocks per replica);
* time in collectives (the batch broadcast, the all-reduces, the logits gather) per decode step of W1 at tp=2
  (and per step, prefill steps included);
* TTFT and TPOT p50 under Poisson arrivals at a moderate rate (the same rate for every tp);
* the largest Llama-3 family model whose bf16 weights and a KV reserve fit a stated per-rank memory budget
  at each tp (arithmetic, with the engine's own split rules).

Pipeline parallelism is not built (``--pipeline-parallel-size`` > 1 is refused), so no pp row.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ..engine import LLMEngine, SamplingParams
from ..engine.config import ModelConfig
from ..engine.distributed import ParallelConfig
from ..engine.engine import usable_cpus
from ..engine.loader import load_config
from ..engine.model import kv_heads_per_rank, split_error
from .engine import REFERENCE, hardware

W1 = dict(requests=64, prompt_len=128, output_len=128)

# The Llama-3 family's shapes (public config.json values), for what fits a per-rank memory budget.
LLAMA3_FAMILY = {
    "Llama-3.2-1B": dict(layers=16, hidden=2048, inter=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256, tied=True),
    "Llama-3.2-3B": dict(layers=28, hidden=3072, inter=8192, heads=24, kv_heads=8, head_dim=128, vocab=128256, tied=True),
    "Llama-3.1-8B": dict(layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, tied=False),
    "Llama-3.1-70B": dict(layers=80, hidden=8192, inter=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256, tied=False),
    "Llama-3.1-405B": dict(layers=126, hidden=16384, inter=53248, heads=128, kv_heads=8, head_dim=128, vocab=128256,
                           tied=False),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def w1_prompts(vocab: int, requests: int = W1["requests"], prompt_len: int = W1["prompt_len"], seed: int = 0
               ) -> list[list[int]]:
    """W1's prompts, as ``bench engine`` draws them."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(requests)]


def open_engine(model_dir: str | Path, tp: int, threads: int | None = None, timeout_s: float = 60.0,
                **engine_args) -> LLMEngine:
    """An fp32 engine of ``tp`` ranks on this host (``threads`` per rank; default: a share of the cores)."""
    parallel = ParallelConfig(tensor_parallel_size=tp, master_port=free_port(), timeout_s=timeout_s) if tp > 1 else None
    args = dict(dtype="float32", device="cpu", load_tokenizer=False, num_threads=threads, parallel=parallel)
    return LLMEngine.from_pretrained(model_dir, **{**args, **engine_args})


def probe_logits(engine: LLMEngine, prompts: list[list[int]]):
    """fp32 logits of every row of one prefill step over ``prompts`` (written to the pool's first blocks: call on
    an idle engine whose cache may be discarded)."""
    from ..engine.batch import SeqChunk, build_batch

    bs, chunks, block = engine.kv.block_size, [], 0
    for p in prompts:
        n = -(-len(p) // bs)
        chunks.append(SeqChunk(p, 0, list(range(block, block + n)), True))
        block += n
    engine.reset_prefix_cache()
    batch = build_batch(chunks, bs, engine.device, engine.runner.compiled_prefill)
    return engine.runner.forward(batch, all_logits=True)


def greedy(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float]:
    """Greedy outputs and the seconds they took (the prefix cache emptied first)."""
    engine.generate([p[:16] for p in prompts[:4]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.reset_prefix_cache()
    started = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    return [o.new_token_ids for o in outs], time.perf_counter() - started


def poisson_latency(engine: LLMEngine, vocab: int, rate: float, requests: int, prompt_len: int, output_len: int,
                    seed: int = 1) -> dict:
    """TTFT and TPOT p50 of requests arriving as a Poisson process at ``rate`` per second, stepped in-process."""
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    for i in range(requests):
        at += rng.expovariate(rate)
        arrivals.append((at, f"p{i}", [rng.randrange(vocab) for _ in range(prompt_len)]))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    start, pending = time.perf_counter(), list(arrivals)
    sent, first, last, tokens = {}, {}, {}, {}
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            when, rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, params)
            sent[rid] = start + when
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for out in engine.step():
            t = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = t
            last[out.request_id] = t
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
    ttft = [first[r] - sent[r] for r in sent]
    tpot = [(last[r] - first[r]) / (tokens[r] - 1) for r in sent if tokens[r] > 1]
    return {"rate_per_s": rate, "requests": requests, "ttft_p50_s": statistics.median(ttft),
            "tpot_p50_s": statistics.median(tpot)}


# ---- what fits a per-rank budget ---------------------------------------------------------
def family_config(shape: dict) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                       intermediate_size=shape["inter"], num_layers=shape["layers"], num_heads=shape["heads"],
                       num_kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], rms_norm_eps=1e-5,
                       rope_theta=500000.0, rope_scaling=None, max_position_embeddings=131072,
                       tie_word_embeddings=shape["tied"], qkv_bias=False, o_bias=False, mlp_bias=False,
                       sliding_window=None, torch_dtype="bfloat16", eos_token_ids=(), bos_token_id=None)


def rank_weight_bytes(c: ModelConfig, tp: int, dtype_bytes: int = 2) -> int:
    """Weight bytes one rank of ``tp`` holds, by the engine's split (model.py): heads, KV heads (or one replica),
    MLP features and vocabulary shards; norms whole."""
    hd, kvh = c.head_dim, kv_heads_per_rank(c, tp)
    q = c.num_heads // tp * hd
    per_layer = c.hidden_size * (q + 2 * kvh * hd) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size // tp
    vocab_rows = -(-c.vocab_size // tp)
    embed = vocab_rows * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    norms = (2 * c.num_layers + 1) * c.hidden_size
    return (per_layer * c.num_layers + embed + norms) * dtype_bytes


def rank_kv_bytes_per_token(c: ModelConfig, tp: int, dtype_bytes: int = 2) -> int:
    return 2 * c.num_layers * kv_heads_per_rank(c, tp) * c.head_dim * dtype_bytes


def largest_fitting(budget_bytes: int, kv_tokens: int, tp: int) -> dict:
    """The largest Llama-3 family model whose per-rank bf16 weights plus KV for ``kv_tokens`` fit the budget."""
    best = None
    for name, shape in LLAMA3_FAMILY.items():
        c = family_config(shape)
        if split_error(c, tp) is not None:
            continue
        need = rank_weight_bytes(c, tp) + kv_tokens * rank_kv_bytes_per_token(c, tp)
        if need <= budget_bytes:
            best = {"model": name, "per_rank_bytes": need}
    return best or {"model": None}


# ---- the benchmark -----------------------------------------------------------------------
def run(model_dir: Path, tps: list[int], cores: int, args) -> dict:
    config = load_config(model_dir)
    prompts = w1_prompts(config.vocab_size, args.requests, args.prompt_len, args.seed)
    probe = prompts[:4]
    kv_bytes = args.kv_cache_mb * 2**20
    result: dict = {"cores": cores, "kv_cache_bytes_per_rank": kv_bytes, "w1": dict(W1, requests=args.requests,
                    prompt_len=args.prompt_len, output_len=args.output_len), "by_tp": {}}
    outputs, logits = {}, {}
    rate = None
    for tp in tps:
        threads = max(1, cores // tp)
        print(f"tp={tp}: {tp} rank(s) x {threads} thread(s)", file=sys.stderr, flush=True)
        engine = open_engine(model_dir, tp, threads, kv_cache_bytes=kv_bytes, max_num_seqs=256,
                             max_num_batched_tokens=8192)
        try:
            logits[tp] = probe_logits(engine, probe)
            runs = []
            for _ in range(max(1, args.repeats)):
                group, runner = engine.group, engine.runner
                c0 = group.collective_seconds if group else 0.0
                s0, d0, dc0 = runner.steps, runner.decode_steps, runner.decode_collective_seconds
                out, seconds = greedy(engine, prompts, args.output_len)
                steps, decodes = runner.steps - s0, runner.decode_steps - d0
                runs.append((seconds, out, ((group.collective_seconds if group else 0.0) - c0) / max(steps, 1),
                             (runner.decode_collective_seconds - dc0) / max(decodes, 1)))
            seconds, out, coll, decode_coll = min(runs, key=lambda r: r[0])
            outputs[tp] = out
            tok_s = args.requests * args.output_len / seconds
            if rate is None:    # moderate: a third of what tp=1 sustains, the same for every tp
                rate = args.rate or tok_s / args.output_len / 3
            print(f"tp={tp}: W1 {tok_s:.1f} tok/s; latency at {rate:.3f} requests/s", file=sys.stderr, flush=True)
            lat = poisson_latency(engine, config.vocab_size, rate, args.latency_requests, args.prompt_len,
                                  args.output_len // 2)
            result["by_tp"][f"tp{tp}"] = {
                "tp": tp, "threads_per_rank": threads, "w1_tokens_per_second": tok_s,
                "w1_tokens_per_second_runs": [args.requests * args.output_len / r[0] for r in runs],
                "weight_bytes_per_rank": engine.runner.weight_bytes(), "kv_blocks_per_rank": engine.kv.pool.num_blocks,
                "kv_blocks_per_replica": engine.kv.pool.num_blocks,   # every rank holds a slice of every block
                "collective_seconds_per_step": coll, "collective_seconds_per_decode_step": decode_coll, **lat}
        finally:
            engine.close()
    by = result["by_tp"]
    result["w1_tokens_per_second"] = {k: v["w1_tokens_per_second"] for k, v in by.items()}
    if "tp2" in by:
        one, two = by["tp1"], by["tp2"]
        agree = sum(a == b for a, b in zip(outputs[1], outputs[2])) / len(prompts)
        result.update(
            tp2_w1_ratio=two["w1_tokens_per_second"] / one["w1_tokens_per_second"],
            weight_bytes_per_rank_ratio_tp2=two["weight_bytes_per_rank"] / one["weight_bytes_per_rank"],
            kv_blocks_per_replica_ratio_tp2=two["kv_blocks_per_replica"] / one["kv_blocks_per_replica"],
            allreduce_seconds_per_step_tp2=two["collective_seconds_per_decode_step"],
            greedy_agreement_tp2=agree,
            max_abs_logit_diff_tp2=float((logits[2] - logits[1]).abs().max()))
    budget = args.budget_gib * 2**30
    result["fits_per_rank_budget"] = {
        "budget_bytes": budget, "kv_reserve_tokens": args.kv_tokens, "dtype": "bfloat16",
        "largest_by_tp": {f"tp{tp}": largest_fitting(budget, args.kv_tokens, tp) for tp in (1, 2, 4, 8)}}
    return result


def plot(result: dict, path: str) -> None:
    from . import plot as pl

    by = result["by_tp"]
    names = list(by)
    fig, axes = pl.figure(3, "tokenfleet bench parallel: tensor parallelism on one host", columns=3, width=11.0)
    axes[0].bar(names, [by[n]["w1_tokens_per_second"] for n in names], color="#4c72b0")
    axes[0].set_title(f"W1 output tokens/s ({result['cores']} cores in all)", fontsize=9)
    axes[1].bar(names, [by[n]["weight_bytes_per_rank"] / 2**20 for n in names], color="#55a868")
    axes[1].set_title("weight MiB per rank", fontsize=9)
    axes[2].bar(names, [by[n]["kv_blocks_per_replica"] for n in names], color="#c44e52")
    axes[2].set_title("KV blocks per replica (one per-rank budget)", fontsize=9)
    pl.save(fig, path, result.get("hardware"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenfleet bench parallel", description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bench engine reference model)")
    ap.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes (1 first)")
    ap.add_argument("--cores", type=int, default=None, help="total cores for every configuration (default: usable)")
    ap.add_argument("--requests", type=int, default=W1["requests"])
    ap.add_argument("--prompt-len", type=int, default=W1["prompt_len"])
    ap.add_argument("--output-len", type=int, default=W1["output_len"])
    ap.add_argument("--repeats", type=int, default=2, help="W1 runs per configuration (the fastest counts)")
    ap.add_argument("--kv-cache-mb", type=int, default=256, help="KV budget per rank")
    ap.add_argument("--rate", type=float, default=None,
                    help="Poisson arrival rate for TTFT/TPOT (default: a third of tp=1's W1 request rate)")
    ap.add_argument("--latency-requests", type=int, default=24)
    ap.add_argument("--budget-gib", type=float, default=80.0, help="per-rank memory budget for the fit table")
    ap.add_argument("--kv-tokens", type=int, default=64 * 1024, help="KV reserve (tokens) in that budget")
    ap.add_argument("--seed", type=int, default=0)
    from .plot import add_argument as add_plot_argument
    add_plot_argument(ap, "W1 tokens/s, weight bytes per rank and KV blocks per replica by tp")
    args = ap.parse_args(argv)
    tps = [int(t) for t in args.tp.split(",")]
    if tps[0] != 1:
        ap.error("--tp must start with 1 (the baseline)")
    cores = args.cores or usable_cpus()
    tmp = None
    model_dir = Path(args.model) if args.model else None
    if model_dir is None:
        from ..testing_models import create_random_checkpoint
        tmp = tempfile.TemporaryDirectory(prefix="tokenfleet-bench-parallel-")
        model_dir = create_random_checkpoint(Path(tmp.name) / "reference", **REFERENCE, seed=args.seed)
    result = {"model": str(args.model) if args.model else "reference (random Llama, 8x512, fp32)",
              "hardware": hardware(), **run(model_dir, tps, cores, args)}
    result["hardware"]["loadavg_1m_end"] = os.getloadavg()[0]
    Path(args.json).write_text(json.dumps(result, indent=2))
    rows = [(name, f"{v['w1_tokens_per_second']:.1f}", v["weight_bytes_per_rank"], v["kv_blocks_per_replica"],
             f"{v['collective_seconds_per_decode_step'] * 1e3:.2f}", f"{v['ttft_p50_s'] * 1e3:.0f}",
             f"{v['tpot_p50_s'] * 1e3:.1f}") for name, v in result["by_tp"].items()]
    print(f"{'config':8} {'W1 tok/s':>9} {'weight B/rank':>14} {'KV blocks':>10} {'coll ms/decode':>15} "
          f"{'TTFT p50 ms':>12} {'TPOT p50 ms':>12}")
    for r in rows:
        print(f"{r[0]:8} {r[1]:>9} {r[2]:>14} {r[3]:>10} {r[4]:>15} {r[5]:>12} {r[6]:>12}")
    for key in ("tp2_w1_ratio", "weight_bytes_per_rank_ratio_tp2", "kv_blocks_per_replica_ratio_tp2",
                "allreduce_seconds_per_step_tp2", "greedy_agreement_tp2", "max_abs_logit_diff_tp2"):
        if key in result:
            print(f"{key}: {result[key]:.6g}")
    for tp, fit in result["fits_per_rank_budget"]["largest_by_tp"].items():
        print(f"largest Llama-3 model within {args.budget_gib:g} GiB per rank at {tp}: {fit['model']}")
    if args.plot:
        plot(result, args.plot)
    if tmp is not None:
        tmp.cleanup()
    return 0
