"""``tokenfleet bench structured``: what a JSON schema costs per output token, and what a grammar costs to compile.

Decode speed: B requests (B = 1 and 16) constrained by a nested JSON schema (an object with arrays, enums and
nested objects) against B free requests, on the reference random-weight model. The free run generates, for
each request, exactly as many tokens as its constrained twin did (EOS ignored), so both runs shrink their batch
at the same steps and differ only in the mask. Sampling is at temperature 1 with seeds in both. The runs
alternate (constrained, free) ``--rounds`` times; the median of each counts (a shared machine's load moves).
TPOT: (last token - first token) / (tokens - 1) per request, averaged.

Compile: a fresh compiler's first compile of the schema (cold), then the same spec again (cached: the cache
lookup plus the request's own matcher copy), the median of many.

Every constrained output is parsed and validated with ``jsonschema``: ``schema_valid_fraction``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..engine import LLMEngine, SamplingParams
from ..engine.engine import usable_cpus
from ..engine.structured import StructuredOutputSpec
from .engine import hardware, reference_checkpoint, report

SCHEMA = {
    "type": "object",
    "properties": {
        "service": {"type": "string", "maxLength": 24},
        "tier": {"type": "string", "enum": ["gold", "silver", "bronze"]},
        "accelerators": {"type": "array", "maxItems": 4,
                         "items": {"type": "string", "enum": ["h100", "a100", "l4", "cpu"]}},
        "replicas": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["eu-1", "us-2", "ap-3"]},
                           "ready": {"type": "boolean"},
                           "load": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["zone", "ready", "load"], "additionalProperties": False}},
        "slo": {"type": "object", "properties": {"ttft_ms": {"type": "integer", "minimum": 1, "maximum": 10000},
                                                 "strict": {"type": "boolean"}},
                "required": ["ttft_ms", "strict"], "additionalProperties": False},
    },
    "required": ["service", "tier", "accelerators", "replicas", "slo"],
    "additionalProperties": False,
}


class SamplerClock:
    """Seconds the engine spends in ``sample()`` (where the mask is filled and applied), and the steps: the
    difference between a constrained and a free run over the same steps is the mask's own cost, which a
    loaded host inflates no more than it inflates the step it is compared with."""

    def __init__(self) -> None:
        from ..engine import engine as engine_module

        self.module, self.inner = engine_module, engine_module.sample
        self.seconds, self.calls = 0.0, 0

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1
        engine_module.sample = timed

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], clock: SamplerClock
              ) -> tuple[list[float], int, float, list[str], list[int], float]:
    """(TPOT per request, output tokens, decode wall seconds, texts, output lengths, sampler seconds per step)."""
    clock.take()
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count = dict.fromkeys(ids, 0)
    text = dict.fromkeys(ids, "")
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                count[o.request_id] += len(o.new_token_ids)
            text[o.request_id] += o.text_delta
    tpots = [(last[r] - first[r]) / (count[r] - 1) for r in ids if count[r] > 1]
    wall = max(last.values()) - min(first.values())
    sampler_seconds, steps = clock.take()
    return (tpots, sum(count.values()), wall, [text[r] for r in ids], [count[r] for r in ids],
            sampler_seconds / max(steps, 1))


def measure_batch(engine: LLMEngine, vocab: int, batch: int, rounds: int, spec: StructuredOutputSpec,
                  max_tokens: int, valid: list[bool], clock: SamplerClock) -> dict:
    import jsonschema

    g = torch.Generator().manual_seed(batch)
    json_tpot, free_tpot, json_tps, free_tps, overhead = [], [], [], [], []
    for r in range(rounds):
        prompts = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(batch)]
        constrained = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 * r + i, structured=spec)
                       for i in range(batch)]
        tpots, tokens, wall, texts, lengths, json_sampler = run_batch(engine, prompts, constrained, clock)
        json_tpot.append(statistics.mean(tpots))
        json_tps.append(tokens / wall)
        for t in texts:
            try:
                jsonschema.validate(json.loads(t), SCHEMA)
                valid.append(True)
            except (ValueError, jsonschema.ValidationError):
                valid.append(False)
        free = [SamplingParams(max_tokens=n, temperature=1.0, seed=1000 * r + i, ignore_eos=True)
                for i, n in enumerate(lengths)]
        tpots, tokens, wall, _, _, free_sampler = run_batch(engine, prompts, free, clock)
        free_tpot.append(statistics.mean(tpots))
        overhead.append((json_sampler - free_sampler) / free_tpot[-1])
        free_tps.append(tokens / wall)
        print(f"batch {batch}, round {r + 1}/{rounds}: TPOT json {json_tpot[-1] * 1e3:.2f} ms, free "
              f"{free_tpot[-1] * 1e3:.2f} ms; sample() per step json {json_sampler * 1e3:.3f} ms, free "
              f"{free_sampler * 1e3:.3f} ms", flush=True)
    j, f = statistics.median(json_tpot), statistics.median(free_tpot)
    return {"json_schema_tpot_s": j, "free_tpot_s": f, "tpot_ratio": j / f,
            "json_schema_output_tok_s": statistics.median(json_tps), "free_output_tok_s": statistics.median(free_tps),
            "tpot_ratio_by_round": [a / b for a, b in zip(json_tpot, free_tpot)],
            # the mask's cost in sample() per step, as a fraction of a free step: 1 + this is the TPOT ratio the
            # mask alone accounts for, measured on the same steps (robust to a host whose load moves)
            "mask_overhead_fraction": statistics.median(overhead)}


def measure_compile(model_dir: Path, engine: LLMEngine, spec: StructuredOutputSpec, repeats: int) -> dict:
    from ..engine.structured.compiler import GrammarCompiler

    started = time.perf_counter()
    compiler = GrammarCompiler(str(model_dir / "tokenizer.json"), engine.model_config.vocab_size,
                               engine.eos_token_ids)
    tokenizer_seconds = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile(spec).new_matcher()
    cold = time.perf_counter() - started
    cached = []
    for _ in range(repeats):
        started = time.perf_counter()
        compiler.compile(StructuredOutputSpec.json_schema(SCHEMA)).new_matcher()
        cached.append(time.perf_counter() - started)
    compiler.close()
    return {"grammar_compile_seconds_cold": cold, "grammar_compile_seconds_cached": statistics.median(cached),
            "grammar_tokenizer_load_seconds": tokenizer_seconds}


def plot(result: dict, path: str) -> None:
    from . import plot as pl

    fig, (ax_tpot, ax_tps) = pl.figure(2, "JSON schema vs free generation (reference model)", columns=2, width=10)
    batches = ["1", "16"]
    width = 0.38
    for k, (key_json, key_free, ax, label) in enumerate([
            ("json_schema_tpot_s", "free_tpot_s", ax_tpot, "TPOT (ms)"),
            ("json_schema_output_tok_s", "free_output_tok_s", ax_tps, "output tokens/s")]):
        scale = 1e3 if k == 0 else 1.0
        free = [result[f"batch{b}"][key_free] * scale for b in batches]
        constrained = [result[f"batch{b}"][key_json] * scale for b in batches]
        xs = range(len(batches))
        ax.bar([x - width / 2 for x in xs], free, width, label="free")
        ax.bar([x + width / 2 for x in xs], constrained, width, label="json_schema")
        ax.set_xticks(list(xs), [f"batch {b}" for b in batches])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    ax_tpot.set_title(f"TPOT ratio {result['json_schema_tpot_ratio_batch1']:.3f} (b1), "
                      f"{result['json_schema_tpot_ratio_batch16']:.3f} (b16)", fontsize=9)
    ax_tps.set_title(f"compile cold {result['grammar_compile_seconds_cold'] * 1e3:.2f} ms, cached "
                     f"{result['grammar_compile_seconds_cached'] * 1e6:.0f} us", fontsize=9)
    pl.save(fig, path, result.get("hardware"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenfleet bench structured", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint directory (default: the random reference)")
    ap.add_argument("--json", type=Path, help="write results to this file")
    ap.add_argument("--rounds", type=int, default=3, help="constrained/free pairs per batch size; medians count")
    ap.add_argument("--max-tokens", type=int, default=768, help="room for the longest document the schema allows")
    ap.add_argument("--compile-repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    from .plot import add_argument as add_plot_argument
    add_plot_argument(ap, "TPOT and output tokens/s, constrained vs free, at batch 1 and 16")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or usable_cpus())
    model_dir, tmp = reference_checkpoint(args.model, args.seed)
    engine = LLMEngine.from_pretrained(model_dir, dtype="float32", device="cpu", kv_cache_bytes=1 << 30,
                                       num_threads=args.threads)
    spec = StructuredOutputSpec.json_schema(SCHEMA, strict=True)
    result: dict = {"model": str(args.model) if args.model else "reference (random Llama, 8x512, fp32)",
                    "hardware": hardware(), "schema": SCHEMA}
    result.update(measure_compile(Path(model_dir), engine, spec, args.compile_repeats))
    vocab = engine.model_config.vocab_size
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured=spec))           # warm-up
    valid: list[bool] = []
    clock = SamplerClock()
    for batch in (1, 16):
        result[f"batch{batch}"] = measure_batch(engine, vocab, batch, args.rounds, spec, args.max_tokens, valid, clock)
        result[f"json_schema_tpot_ratio_batch{batch}"] = result[f"batch{batch}"]["tpot_ratio"]
    result["schema_valid_fraction"] = sum(valid) / len(valid)
    result["constrained_outputs"] = len(valid)
    result["hardware"]["loadavg_1m_end"] = os.getloadavg()[0]
    rows = [("TPOT ratio, batch 1 (json_schema / free)", result["json_schema_tpot_ratio_batch1"]),
            ("TPOT ratio, batch 16", result["json_schema_tpot_ratio_batch16"]),
            *((f"batch {b}: TPOT ms json / free", f"{result[f'batch{b}']['json_schema_tpot_s'] * 1e3:.2f} / "
               f"{result[f'batch{b}']['free_tpot_s'] * 1e3:.2f}") for b in (1, 16)),
            *((f"batch {b}: output tok/s json / free", f"{result[f'batch{b}']['json_schema_output_tok_s']:.1f} / "
               f"{result[f'batch{b}']['free_output_tok_s']:.1f}") for b in (1, 16)),
            *((f"batch {b}: mask cost / free step", result[f"batch{b}"]["mask_overhead_fraction"]) for b in (1, 16)),
            ("grammar compile, cold (ms)", result["grammar_compile_seconds_cold"] * 1e3),
            ("grammar compile, cached (ms)", result["grammar_compile_seconds_cached"] * 1e3),
            ("schema_valid_fraction", result["schema_valid_fraction"])]
    report(result, rows, args.json, args.plot, plot, tmp, width=42, digits=4)
    return 0
