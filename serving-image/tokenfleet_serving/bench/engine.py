"""``tokenfleet bench engine``: engine throughput vs transformers, and prefix-cache TTFT.

W1 (throughput): N requests x P prompt tokens x G output tokens, greedy, EOS
ignored; transformers' ``generate`` with one static batch vs this engine;
both against a roofline of (counted model FLOPs) / (measured fp32 matmul
FLOP/s).
W3 (prefix cache): a shared prefix + a few new tokens; time to first token
on a cache hit vs cold (the median of several each), and the cold prefill's fraction of
the roofline (attention FLOPs counted).
Dtypes: W1 again in every dtype the host runs (``w1_by_dtype``), and the dtype that ``auto`` chose
(``auto_dtype``) with its probe's numbers, so the choice can be checked against the full workload.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..engine import LLMEngine, SamplingParams, cpu_features
from ..engine.config import ModelConfig
from ..engine.dtype_choice import NAMES, cpu_candidates
from ..engine.engine import usable_cpus
from ..engine.loader import load_config
from ..serve_args import positive_int

REFERENCE = dict(architecture="llama", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4,
                 intermediate_size=1376, vocab_size=8192, dtype="float32")


# ---- FLOP accounting ---------------------------------------------------------
def linear_flops_per_token(c: ModelConfig) -> int:
    """Matmul FLOPs of one token through all layers (q, k, v, o, gate, up, down), no lm_head."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return 2 * per_layer * c.num_layers


def lm_head_flops(c: ModelConfig) -> int:
    return 2 * c.hidden_size * c.vocab_size


def attention_flops(c: ModelConfig, num_keys: int) -> int:
    """QK^T and PV for one query token attending ``num_keys`` keys, all layers."""
    return 4 * num_keys * c.num_heads * c.head_dim * c.num_layers


def sequence_flops(c: ModelConfig, prompt_len: int, output_len: int, cached: int = 0) -> int:
    """Model FLOPs needed to prefill ``prompt_len`` tokens (``cached`` of them from cache) and generate
    ``output_len``: every computed token pays the linears and causal attention of every layer, except that
    in the last layer a prompt token before the last needs only its key and value projections (nothing
    reads its output there, and the engine skips the rest); one lm_head row per generated token."""
    computed = prompt_len + output_len - 1 - cached
    kv_only = max(prompt_len - 1 - cached, 0)                  # prompt tokens whose last-layer output is unused
    layer = linear_flops_per_token(c) // c.num_layers
    kv_projection = 2 * c.hidden_size * 2 * c.num_kv_heads * c.head_dim
    attention = (sum(attention_flops(c, k) for k in range(cached + 1, prompt_len + output_len))
                 - sum(attention_flops(c, k) // c.num_layers for k in range(cached + 1, cached + 1 + kv_only)))
    return (computed * linear_flops_per_token(c) - kv_only * (layer - kv_projection) + attention
            + output_len * lm_head_flops(c))


def reference_checkpoint(model: Path | None, seed: int) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """``model``, or else the random reference model written to a temporary directory (the caller cleans it up)."""
    if model is not None:
        return model, None
    from ..testing_models import create_random_checkpoint
    tmp = tempfile.TemporaryDirectory(prefix="tokenfleet-bench-")
    return create_random_checkpoint(Path(tmp.name) / "reference", **REFERENCE, seed=seed), tmp


# ---- hardware ----------------------------------------------------------------
def measure_matmul_flops(n: int = 2048, seconds: float = 2.0) -> dict[str, float]:
    """Best sustained fp32 FLOP/s of an n x n x n matmul on this machine, right now, per implementation:
    ``torch.matmul`` and, where the engine has it, its own packed GEMM (which on some CPUs beats the BLAS
    torch ships). They alternate, so both see the same moments of a shared machine; the roofline takes the
    faster, so no implementation the engine could use is faster than the roofline assumes."""
    from ..engine import cpu_kernels

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    runs = {"torch_matmul": lambda: torch.matmul(a, b, out=out)}
    lib = cpu_kernels.load()
    if cpu_kernels.gemm_packs(lib, b):
        panels = cpu_kernels.pack_weight(lib, b)                 # a @ b^T: same FLOPs, the engine's layout
        runs["tokenfleet_gemm"] = lambda: cpu_kernels.linear(lib, a, panels)
    best = dict.fromkeys(runs, 0.0)
    for run in runs.values():
        run()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            best[name] = max(best[name], 2 * n ** 3 / (time.perf_counter() - t))
    return best


def hardware() -> dict:
    return {**cpu_features.describe(), "cores": usable_cpus(), "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "loadavg_1m": os.getloadavg()[0]}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---- workloads ---------------------------------------------------------------
def run_hf(model_dir: Path, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:4, :16], attention_mask=torch.ones_like(ids[:4, :16]), max_new_tokens=4, **kw)
        t, cpu = time.perf_counter(), cpu_seconds()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, **kw)
        elapsed = time.perf_counter() - t
    return elapsed, (cpu_seconds() - cpu) / elapsed, out[:, ids.shape[1]:].tolist()


def run_engine_w1(engine: LLMEngine, prompts: list[list[int]], output_len: int
                  ) -> tuple[float, float, list[list[int]], int]:
    """One timed W1 run. The prefix cache is emptied first: a repeat must compute every prompt token
    again, as transformers does, rather than reuse the blocks of the previous run (or of the warm-up)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate([p[:16] for p in prompts[:4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    if not engine.reset_prefix_cache():
        raise RuntimeError("W1 needs an idle engine to empty its prefix cache")
    hits = engine.stats().prefix_cache_hits
    t, cpu = time.perf_counter(), cpu_seconds()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    cached = engine.stats().prefix_cache_hits - hits      # 0 unless preemption re-hit a request's own blocks
    return elapsed, (cpu_seconds() - cpu) / elapsed, [o.new_token_ids for o in outs], cached


def ttft(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    t = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                elapsed = time.perf_counter() - t
                while engine.has_unfinished():
                    engine.step()
                return elapsed, out.num_cached_tokens


def run_w3(engine: LLMEngine, vocab: int, prefix_len: int, new_len: int, hits: int, colds: int,
           rng: random.Random) -> dict:
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]
    ttft(engine, "w3-warmup", tokens(prefix_len + new_len))            # allocator and kernel warm-up
    prefix = tokens(prefix_len)
    ttft(engine, "w3-seed", prefix + tokens(new_len))                  # fills the cache with the prefix
    # colds and hits alternate, so that both sample the same moments of a shared machine (between runs the
    # hit moved with the memory bandwidth much more than the compute-bound cold prefill did)
    cold_times, hit_times, cached = [], [], []
    for i in range(max(colds, hits)):
        if i < colds:
            cold_times.append(ttft(engine, f"w3-cold-{i}", tokens(prefix_len + new_len))[0])
        if i < hits:
            t, c = ttft(engine, f"w3-hit-{i}", prefix + tokens(new_len))
            hit_times.append(t)
            cached.append(c)
    cold, hit = statistics.median(cold_times), statistics.median(hit_times)
    return {"ttft_cold_s": cold, "ttft_hit_s": hit, "ttft_reduction": 1.0 - hit / cold,
            "w3_cached_tokens": min(cached), "ttft_cold_s_runs": cold_times, "ttft_hit_s_runs": hit_times}


def dtype_results(model_dir: Path, prompts: list[list[int]], args, engine_args: dict, out_tokens: int,
                  float32_tok_s: float) -> dict:
    """W1 in every dtype asked for (float32's from the main run), and what ``auto`` chose on this host."""
    by_dtype = {"float32": float32_tok_s}
    candidates = {NAMES[d] for d in cpu_candidates()}
    for name in [d.strip() for d in args.dtypes.split(",") if d.strip() and d.strip() != "float32"]:
        eng = LLMEngine.from_pretrained(model_dir, **{**engine_args, "dtype": name})
        # the auto candidates get the same best-of repeats as float32; the others one run
        runs = max(1, args.repeats) if name in candidates else 1
        by_dtype[eng.dtype_choice.name] = max(out_tokens / run_engine_w1(eng, prompts, args.output_len)[0]
                                              for _ in range(runs))
        del eng
    auto = LLMEngine.from_pretrained(model_dir, **{**engine_args, "dtype": "auto"})
    choice = auto.dtype_choice
    del auto
    measured = {name: by_dtype[name] for name in candidates if name in by_dtype}
    return {"w1_by_dtype": by_dtype, "auto_dtype": choice.name, "auto_dtype_how": choice.how,
            "auto_probe_tokens_per_second": choice.probe_tokens_per_second,
            "auto_is_fastest_candidate": (choice.name == max(measured, key=lambda n: measured[n])
                                          if len(measured) == len(candidates) else None)}


def plot(result: dict, path: str | Path) -> None:
    """W1 output tokens/s side by side, and W3's time to first token, cold and from the prefix cache."""
    from . import plot as pl

    fig, (w1, w3) = pl.figure(2, "tokenfleet bench engine", columns=2, width=11, panel_height=4.2)
    bars = [("transformers", result.get("hf_output_tok_s")), ("engine", result.get("engine_output_tok_s")),
            ("engine,\nPyTorch path", result.get("engine_pytorch_path_output_tok_s")),
            *((f"engine,\n{name}", speed) for name, speed in (result.get("w1_by_dtype") or {}).items()
              if name != "float32"),                       # the engine bar is float32
            ("roofline", result.get("roofline_output_tok_s"))]
    bars = [(name, value) for name, value in bars if value is not None]
    shown = w1.bar([n for n, _ in bars], [v for _, v in bars], color=["0.6"] + ["C0"] * (len(bars) - 2) + ["0.85"])
    w1.bar_label(shown, fmt="%.0f", fontsize=7)
    w1.set_ylabel("output tokens/s")
    w1.set_title("W1: offline batch (greedy, fp32 unless named)", fontsize=9)
    w1.tick_params(axis="x", labelsize=7)
    ttft = [("cold prefill", result.get("ttft_cold_s")), ("prefix-cache hit", result.get("ttft_hit_s"))]
    ttft = [(n, v * 1000) for n, v in ttft if v is not None]
    shown = w3.bar([n for n, _ in ttft], [v for _, v in ttft], color=["0.6", "C2"])
    w3.bar_label(shown, fmt="%.0f ms", fontsize=8)
    w3.set_ylabel("time to first token (ms)")
    w3.set_title("W3: a long shared prefix, cold and cached", fontsize=9)
    pl.save(fig, path, result.get("hardware"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenfleet bench engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="HF checkpoint dir (default: create the reference model)")
    ap.add_argument("--json", type=Path, help="write results to this file")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--new-len", type=int, default=32)
    ap.add_argument("--hits", type=positive_int, default=5, help="W3 cache hits; the median counts")
    ap.add_argument("--colds", type=positive_int, default=5, help="cold W3 prefills; the median counts")
    ap.add_argument("--skip-hf", action="store_true", help="do not run the transformers baseline")
    ap.add_argument("--skip-pytorch-path", action="store_true",
                    help="do not also run W1 on the engine's pure PyTorch path (no compiled CPU kernels)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="W1 runs of each system, alternating engine and transformers; the best of each counts "
                         "(a shared machine's load changes between runs)")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16",
                    help="comma-separated dtypes to run W1 in for w1_by_dtype (float32 always runs)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    from .plot import add_argument as add_plot_argument
    add_plot_argument(ap, "W1 throughput side by side (transformers, the engine, each dtype, the roofline) and W3's TTFT")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or usable_cpus())
    model_dir, tmp = reference_checkpoint(args.model, args.seed)
    config = load_config(model_dir)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    result: dict = {"model": str(args.model) if args.model else "reference (random Llama, 8x512, fp32)",
                    "hardware": hardware()}

    def measure_roofline(when: str) -> None:
        """matmul_gflops{when} (the fastest implementation) and matmul_gflops{when}_by_impl."""
        by_impl = measure_matmul_flops()
        result[f"matmul_gflops{when}"] = max(by_impl.values()) / 1e9
        result[f"matmul_gflops{when}_by_impl"] = {k: v / 1e9 for k, v in by_impl.items()}

    measure_roofline("")
    flops_w1 = args.requests * sequence_flops(config, args.prompt_len, args.output_len)
    out_tokens = args.requests * args.output_len
    engine_args = dict(dtype="float32", device="cpu", max_num_batched_tokens=max(8192, args.prefix_len + args.new_len),
                       max_num_seqs=max(256, args.requests), kv_cache_bytes=1 << 30, num_threads=args.threads,
                       load_tokenizer=False)
    engine = LLMEngine.from_pretrained(model_dir, **engine_args)
    engine_runs, hf_runs = [], []
    for _ in range(max(1, args.repeats)):
        engine_runs.append(run_engine_w1(engine, prompts, args.output_len))
        if not args.skip_hf:
            hf_runs.append(run_hf(model_dir, prompts, args.output_len))
    t_engine, engine_cores, engine_out, _ = min(engine_runs, key=lambda r: r[0])
    result.update(engine_output_tok_s=out_tokens / t_engine,
                  engine_w1_cached_prompt_tokens=max(r[3] for r in engine_runs), w1_model_gflop=flops_w1 / 1e9,
                  engine_cpu_cores_used=engine_cores,
                  engine_output_tok_s_runs=[out_tokens / r[0] for r in engine_runs])
    if hf_runs:
        t_hf, hf_cores, hf_out = min(hf_runs, key=lambda r: r[0])
        result.update(hf_output_tok_s=out_tokens / t_hf, ratio_vs_hf=t_hf / t_engine, hf_cpu_cores_used=hf_cores,
                      hf_output_tok_s_runs=[out_tokens / r[0] for r in hf_runs],
                      greedy_match_hf=sum(a == b for a, b in zip(engine_out, hf_out)) / len(prompts))

    if engine.runner.kernels is not None and not args.skip_pytorch_path:
        # the same engine without the compiled CPU kernels, so their effect shows side by side
        plain = LLMEngine.from_pretrained(model_dir, **engine_args, cpu_kernels=False)
        t_plain = run_engine_w1(plain, prompts, args.output_len)[0]
        del plain
        result.update(engine_pytorch_path_output_tok_s=out_tokens / t_plain, kernels_speedup=t_plain / t_engine)

    result.update(dtype_results(model_dir, prompts, args, engine_args, out_tokens, result["engine_output_tok_s"]))

    measure_roofline("_mid")                # again right before W3's timings, next to the cold prefill it divides
    w3 = run_w3(engine, config.vocab_size, args.prefix_len, args.new_len, args.hits, args.colds, rng)
    cold_flops = sequence_flops(config, args.prefix_len + args.new_len, 1)
    w3["w3_cold_model_gflop"] = cold_flops / 1e9
    result["hardware"]["loadavg_1m_end"] = os.getloadavg()[0]
    measure_roofline("_end")
    # The roofline uses the fastest of the start, middle and end measurements: on a shared machine a slow
    # measurement would flatter every fraction.
    matmul = max(result[f"matmul_gflops{when}"] for when in ("", "_mid", "_end")) * 1e9
    result["roofline_matmul_gflops"] = matmul / 1e9
    roofline = out_tokens / (flops_w1 / matmul)
    result["roofline_output_tok_s"] = roofline
    result["roofline_fraction"] = result["engine_output_tok_s"] / roofline
    if "hf_output_tok_s" in result:
        result["hf_roofline_fraction"] = result["hf_output_tok_s"] / roofline
    w3["prefill_roofline_fraction"] = (cold_flops / matmul) / w3["ttft_cold_s"]
    result.update(w3)

    rows = [("matmul GFLOP/s (fp32, measured)", result["matmul_gflops"]),
            ("W1 transformers output tok/s", result.get("hf_output_tok_s")),
            ("W1 engine output tok/s", result["engine_output_tok_s"]),
            ("W1 engine, PyTorch path only, tok/s", result.get("engine_pytorch_path_output_tok_s")),
            ("W1 ratio vs transformers", result.get("ratio_vs_hf")),
            ("W1 roofline output tok/s", roofline), ("W1 roofline fraction", result["roofline_fraction"]),
            *((f"W1 engine output tok/s, {name}", speed) for name, speed in result["w1_by_dtype"].items()),
            ("dtype auto chose", f"{result['auto_dtype']} ({result['auto_dtype_how']})"),
            ("W3 TTFT cold (s)", w3["ttft_cold_s"]), ("W3 TTFT hit (s)", w3["ttft_hit_s"]),
            ("W3 TTFT reduction", w3["ttft_reduction"]),
            ("W3 prefill roofline fraction", w3["prefill_roofline_fraction"]),
            ("matmul GFLOP/s at the end", result["matmul_gflops_end"]),
            ("CPU cores used: engine / transformers",
             None if args.skip_hf else f"{engine_cores:.2f} / {hf_cores:.2f}")]
    report(result, rows, args.json, args.plot, plot, tmp)
    return 0


def report(result: dict, rows: list, json_path: Path | None, plot_path: str | None, draw,
           tmp: tempfile.TemporaryDirectory | None, width: int = 38, digits: int = 3) -> None:
    """Print the table, write the JSON and the picture (when asked), drop the temporary reference model."""
    print(f"hardware: {result['hardware']}")
    for name, value in rows:
        shown = "-" if value is None else value if isinstance(value, str) else f"{value:,.{digits}f}"
        print(f"  {name:<{width}} {shown}")
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    if plot_path:
        draw(result, plot_path)
        print(f"wrote {plot_path}")
    if tmp is not None:
        tmp.cleanup()
