"""``tokenfleet bench kvcache``: the prefix cache's tiers on one replica, when the shared prompts outnumber
what the accelerator holds.

Workload (seeded, the same for every configuration): 16 shared prefixes of 1,024 tokens; each request is one
of them (drawn uniformly) plus a 16-token suffix of its own, 16 greedy output tokens, EOS ignored;
``--concurrency`` requests in flight in a closed loop (default 1, so that a TTFT is the request's own: the
lookup, the copy back or the prefill, and its first step; at 2, a hit that arrives during another request's
1,024-token prefill waits for it, and on a shared host the p95 then measures the neighbours). First every
prefix is served once (the warm-up, not counted), then ``--requests`` (48) requests are measured. TTFT runs
from a request's submission to its first token. The model is ``bench engine``'s reference model (a generated
Llama of 8 layers, hidden 512, 4 KV heads, fp32: 256 KiB of KV per 16-token block, so a prefix is 16 MiB), so
the run takes a few minutes on 2 cores.

Configurations, each a fresh engine of the same byte budget for its accelerator tier (the pool): 200 blocks
of 16 tokens, which hold 3 of the 16 prefixes plus the running requests' own blocks:

* ``hbm_only``: the accelerator tier alone (every prefix not among the last three used is recomputed);
* ``host_tier``: + a host-memory tier of ``--host-mb`` (320 MiB: every prefix);
* ``host_and_disk``: + a host tier a third that size (6 prefixes) and a disk tier (the rest, in a temporary
  directory on the local disk; ``--disk-dir`` to choose);
* ``int8_kv``: ``host_and_disk`` with ``--kv-cache-dtype int8`` (the same byte budget holds about twice the
  blocks), when this build has it, else reported as not available.

Per configuration: the prefix hit rate per tier (prompt tokens served by each tier over prompt tokens, in the
measured part), TTFT p50/p95, output tokens/s and $/Mtok at ``--price-per-hour``, and the bytes and seconds
each tier moved.

Warm restart: the ``host_and_disk`` replica writes its hottest blocks to the disk tier as it drains
(``flush_kv_to_disk``) and closes; a replacement engine that mounts the same directory, and a cold one
without it, each serve 30 requests of the workload: TTFT p95 over those first 30 requests, cold over warm
(``warm_restart_ttft_p95_ratio_cold_over_warm``).

Also the largest number of 2,048-token sequences a fixed budget (``--budget-mb``) holds, in the model's dtype
and in int8 (``concurrent_seqs_ratio_int8``), and the int8 KV quality measurements of
``tokenfleet_serving.bench.kv_quality`` where this build has that module.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ..contract.cost import cost_per_million_tokens
from ..engine import LLMEngine, SamplingParams
from ..engine.engine import EngineConfig
from ..engine.kv_offload import KVOffloadConfig
from ..testing_models import create_random_checkpoint
from .engine import REFERENCE, hardware

MODEL = dict(REFERENCE)
SMALL_MODEL = dict(REFERENCE, num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=344)
PREFIXES, PREFIX_TOKENS, SUFFIX_TOKENS, OUTPUT_TOKENS, BLOCK = 16, 1024, 16, 16, 16
POOL_BLOCKS = 200                   # 3 prefixes of 64 blocks, plus the running requests' own blocks
WARM_RESTART_REQUESTS = 30
CONFIGS = ("hbm_only", "host_tier", "host_and_disk", "int8_kv")
NOT_AVAILABLE = "not available in this build"


def has_kv_cache_dtype() -> bool:
    return any(f.name == "kv_cache_dtype" for f in dataclasses.fields(EngineConfig))


@dataclasses.dataclass
class Workload:
    prefixes: list[list[int]]
    warmup: list[list[int]]          # every prefix once
    measured: list[list[int]]

    @classmethod
    def make(cls, requests: int, seed: int = 11) -> Workload:
        rng = random.Random(seed)
        vocab = int(MODEL["vocab_size"])  # type: ignore[call-overload]
        prefixes = [[rng.randrange(10, vocab) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]

        def request(i: int) -> list[int]:
            return prefixes[i] + [rng.randrange(10, vocab) for _ in range(SUFFIX_TOKENS)]

        order = list(range(PREFIXES))
        rng.shuffle(order)
        warmup = [request(i) for i in order]
        measured = [request(rng.randrange(PREFIXES)) for _ in range(requests)]
        return cls(prefixes, warmup, measured)


def serve(eng: LLMEngine, prompts: list[list[int]], concurrency: int, label: str) -> dict[str, Any]:
    """Closed loop: ``concurrency`` requests in flight; TTFTs, output tokens and wall seconds."""
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    pending = list(range(len(prompts)))
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    done: set[str] = set()
    tokens = 0
    started = time.perf_counter()

    def submit() -> None:
        while pending and len(submitted) - len(done) < concurrency:
            i = pending.pop(0)
            rid = f"{label}-{i}-{time.monotonic_ns()}"
            eng.add_request(rid, prompts[i], params)
            submitted[rid] = time.perf_counter()

    submit()
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                tokens += len(o.new_token_ids)
            if o.finished:
                done.add(o.request_id)
        submit()
    seconds = time.perf_counter() - started
    return {"ttft": [first[r] - submitted[r] for r in submitted], "tokens": tokens, "seconds": seconds}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q * (len(ordered) - 1)))))
    return ordered[k]


def tier_counters(eng: LLMEngine) -> dict[str, dict[str, float]]:
    s = eng.stats()
    if s.kv_offload is None:
        return {"accelerator": {"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits}}
    return {t: dataclasses.asdict(c) for t, c in s.kv_offload.items()}


def hit_rates(before: dict, after: dict) -> dict[str, float]:
    queries = after["accelerator"]["queries"] - before["accelerator"]["queries"]
    out = {}
    for tier in ("accelerator", "host", "disk"):
        if tier in after:
            out[tier] = round((after[tier]["hits"] - before[tier]["hits"]) / max(queries, 1), 4)
    out["total"] = round(sum(out.values()), 4)
    return out


def moved(before: dict, after: dict) -> dict[str, dict[str, float]]:
    out = {}
    for tier in ("host", "disk"):
        if tier in after and after[tier].get("enabled", False):
            out[tier] = {k: round(after[tier][k] - before[tier][k], 4)
                         for k in ("store_bytes", "store_seconds", "load_bytes", "load_seconds")}
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, model: Path, work: Path):
        self.args, self.model, self.work = args, model, work
        probe = LLMEngine.from_pretrained(model, dtype="float32", kv_cache_bytes=1 << 20, block_size=BLOCK,
                                          load_tokenizer=False)
        self.block_bytes = probe.runner.kv_block_bytes(BLOCK)
        self.prefix_bytes = self.block_bytes * PREFIX_TOKENS // BLOCK

    def engine(self, host_bytes: int = 0, disk: Path | None = None, kv_cache_dtype: str | None = None) -> LLMEngine:
        offload = None
        if host_bytes or disk is not None:
            offload = KVOffloadConfig(host_bytes, str(disk) if disk is not None else None,
                                      self.args.disk_mb * 2**20)
        extra: dict[str, Any] = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}
        return LLMEngine.from_pretrained(self.model, dtype="float32", kv_cache_bytes=POOL_BLOCKS * self.block_bytes,
                                         block_size=BLOCK, max_num_seqs=self.args.concurrency, load_tokenizer=False,
                                         kv_offload=offload, num_threads=self.args.threads, **extra)

    def config_engine(self, name: str, disk: Path) -> LLMEngine:
        host = self.args.host_mb * 2**20
        if name == "hbm_only":
            return self.engine()
        if name == "host_tier":
            return self.engine(host)
        if name == "host_and_disk":
            return self.engine(host // 3, disk)
        return self.engine(host // 3, disk, kv_cache_dtype="int8")

    def run_config(self, name: str, work: Workload, price: float) -> dict[str, Any]:
        disk = self.work / f"disk-{name}"
        eng = self.config_engine(name, disk)
        try:
            serve(eng, work.warmup, 1, f"{name}-warm")
            before = tier_counters(eng)
            r = serve(eng, work.measured, self.args.concurrency, name)
            after = tier_counters(eng)
            tps = r["tokens"] / r["seconds"]
            result = {"ttft_p50_seconds": round(statistics.median(r["ttft"]), 4),
                      "ttft_p95_seconds": round(percentile(r["ttft"], 0.95), 4),
                      "output_tokens_per_second": round(tps, 2),
                      "dollars_per_mtok": round(cost_per_million_tokens(price, tps) or 0.0, 4),
                      "hit_rate": hit_rates(before, after), "moved": moved(before, after),
                      "accelerator_blocks": eng.kv.pool.num_blocks, "seconds": round(r["seconds"], 2)}
            if name == "host_and_disk":
                eng.flush_kv_to_disk(10**6)            # as a draining replica does: the store its successor mounts
                result["disk_blocks_after_drain"] = len(eng.cached_block_hashes_by_tier()["disk"])
        finally:
            eng.close()
        return result

    def warm_restart(self, work: Workload) -> dict[str, Any]:
        disk = self.work / "disk-host_and_disk"
        first = work.measured[:WARM_RESTART_REQUESTS]
        results = {}
        for label, path in (("cold", None), ("warm", disk)):
            eng = self.engine(self.args.host_mb * 2**20 // 3, path)
            try:
                start_blocks = len(eng.cached_block_hashes_by_tier()["disk"])
                before = tier_counters(eng)
                r = serve(eng, first, self.args.concurrency, f"restart-{label}")
                results[label] = {"ttft_p95_seconds": round(percentile(r["ttft"], 0.95), 4),
                                  "ttft_p50_seconds": round(statistics.median(r["ttft"]), 4),
                                  "disk_blocks_at_start": start_blocks,
                                  "hit_rate": hit_rates(before, tier_counters(eng))}
            finally:
                eng.close()
        results["requests"] = WARM_RESTART_REQUESTS
        return results

    def concurrent_seqs(self) -> dict[str, Any]:
        """2,048-token sequences a ``--budget-mb`` pool holds at once, per KV dtype."""
        out: dict[str, Any] = {"budget_mb": self.args.budget_mb, "sequence_tokens": 2048}
        per_seq = 2048 // BLOCK
        for dtype in ("auto", "int8"):
            if dtype == "int8" and not has_kv_cache_dtype():
                out[dtype] = None
                continue
            extra = {"kv_cache_dtype": dtype} if dtype != "auto" else {}
            eng = LLMEngine.from_pretrained(self.model, dtype="float32", kv_cache_bytes=self.args.budget_mb << 20,
                                            block_size=BLOCK, load_tokenizer=False, **extra)
            out[dtype] = eng.kv.pool.num_blocks // per_seq
            eng.close()
        return out


def kv_quality(work: Path) -> dict[str, Any] | None:
    """The int8 KV measurements of ``bench/kv_quality.py`` (``measure_int8_kv``: quality on the reference model
    and W5's copying model, capacity at a fixed budget), where this build has that module."""
    try:
        module = importlib.import_module("tokenfleet_serving.bench.kv_quality")
    except ModuleNotFoundError:
        return None
    fn = getattr(module, "measure_int8_kv", None)
    if fn is None:
        return None
    return fn(work=work / "kv-quality")


def measure(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    hw = {**hardware(), "loadavg_1m_start": os.getloadavg()[0]}
    model = create_random_checkpoint(work_dir / "model", **(SMALL_MODEL if args.small_model else MODEL), seed=5)
    bench = Bench(args, model, Path(args.disk_dir) if args.disk_dir else work_dir)
    work = Workload.make(args.requests)
    configs: dict[str, Any] = {}
    for name in CONFIGS:
        if name == "int8_kv" and not has_kv_cache_dtype():
            configs[name] = NOT_AVAILABLE
            continue
        configs[name] = bench.run_config(name, work, args.price_per_hour)
    restart = bench.warm_restart(work)
    seqs = bench.concurrent_seqs()
    quality = kv_quality(work_dir) if not args.skip_quality else None
    ran = {k: v for k, v in configs.items() if isinstance(v, dict)}
    hw["loadavg_1m_end"] = os.getloadavg()[0]
    hbm, host = ran["hbm_only"]["ttft_p95_seconds"], ran["host_tier"]["ttft_p95_seconds"]
    return {
        "ttft_p95_seconds": {k: v["ttft_p95_seconds"] if isinstance(v, dict) else v for k, v in configs.items()},
        "ttft_p50_seconds": {k: v["ttft_p50_seconds"] for k, v in ran.items()},
        "hit_rate": {k: v["hit_rate"] if isinstance(v, dict) else v for k, v in configs.items()},
        "output_tokens_per_second": {k: v["output_tokens_per_second"] for k, v in ran.items()},
        "dollars_per_mtok": {k: v["dollars_per_mtok"] for k, v in ran.items()},
        "price_per_hour": args.price_per_hour,
        "ttft_p95_ratio_hbm_only_over_host_tier": round(hbm / host, 3),
        "concurrent_seqs": seqs,
        "concurrent_seqs_ratio_int8": (quality.get("concurrent_seqs_ratio_int8") if quality
                                       and quality.get("concurrent_seqs_ratio_int8") is not None
                                       else round(seqs["int8"] / seqs["auto"], 3) if seqs.get("int8") else None),
        "int8_kv_greedy_agreement_w5": quality.get("int8_kv_greedy_agreement_w5") if quality else None,
        "int8_kv_mean_kl": quality.get("int8_kv_mean_kl") if quality else None,
        "kv_quality": quality if quality else NOT_AVAILABLE,
        "warm_restart": restart,
        "warm_restart_ttft_p95_ratio_cold_over_warm": round(restart["cold"]["ttft_p95_seconds"]
                                                            / restart["warm"]["ttft_p95_seconds"], 3),
        "configs": configs,
        "workload": {"prefixes": PREFIXES, "prefix_tokens": PREFIX_TOKENS, "suffix_tokens": SUFFIX_TOKENS,
                     "output_tokens": OUTPUT_TOKENS, "requests": args.requests, "concurrency": args.concurrency,
                     "block_size": BLOCK, "accelerator_blocks": POOL_BLOCKS,
                     "accelerator_prefixes": round(POOL_BLOCKS * BLOCK / PREFIX_TOKENS, 2),
                     "block_bytes": bench.block_bytes, "host_mb": args.host_mb, "disk_mb": args.disk_mb,
                     "model": SMALL_MODEL if args.small_model else MODEL},
        "hardware": hw,
    }


def table(result: dict[str, Any]) -> str:
    rows = [("config", "hit acc", "hit host", "hit disk", "TTFT p50", "TTFT p95", "tok/s", "$/Mtok")]
    for name, v in result["configs"].items():
        if not isinstance(v, dict):
            rows.append((name, v, "", "", "", "", "", ""))
            continue
        h = v["hit_rate"]
        rows.append((name, f"{h.get('accelerator', 0):.3f}", f"{h.get('host', 0):.3f}", f"{h.get('disk', 0):.3f}",
                     f"{v['ttft_p50_seconds']:.4f}", f"{v['ttft_p95_seconds']:.4f}",
                     f"{v['output_tokens_per_second']:.1f}", f"{v['dollars_per_mtok']:.3f}"))
    lines = [" | ".join(f"{c:>13}" for c in r) for r in rows]
    w = result["warm_restart"]
    lines.append(f"warm restart, first {w['requests']} requests: TTFT p95 cold {w['cold']['ttft_p95_seconds']:.4f} s, "
                 f"from the disk tier {w['warm']['ttft_p95_seconds']:.4f} s")
    for key in ("ttft_p95_ratio_hbm_only_over_host_tier", "warm_restart_ttft_p95_ratio_cold_over_warm",
                "concurrent_seqs_ratio_int8", "int8_kv_greedy_agreement_w5", "int8_kv_mean_kl"):
        lines.append(f"{key}: {result[key]}")
    lines.append(f"price ${result['price_per_hour']:g}/h")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    from . import plot as pl

    fig, (left, right) = pl.figure(2, "bench kvcache: 16 shared 1,024-token prefixes, the accelerator holds 3",
                                   columns=2, width=11)
    names = [k for k, v in result["configs"].items() if isinstance(v, dict)]
    x = range(len(names))
    p50 = [result["configs"][k]["ttft_p50_seconds"] for k in names]
    p95 = [result["configs"][k]["ttft_p95_seconds"] for k in names]
    left.bar([i - 0.2 for i in x], p50, width=0.4, label="p50", color="#39c")
    left.bar([i + 0.2 for i in x], p95, width=0.4, label="p95", color="#c73")
    left.set_xticks(list(x), names, fontsize=8)
    left.set_ylabel("TTFT (s)")
    left.legend(fontsize=8)
    w = result["warm_restart"]
    left.set_title(f"TTFT per configuration; warm restart p95 {w['cold']['ttft_p95_seconds']:.3f} s cold, "
                   f"{w['warm']['ttft_p95_seconds']:.3f} s warm", fontsize=8)
    bottom = [0.0] * len(names)
    for tier, color in (("accelerator", "#3a7"), ("host", "#39c"), ("disk", "#c93")):
        vals = [result["configs"][k]["hit_rate"].get(tier, 0.0) for k in names]
        right.bar(list(x), vals, bottom=bottom, label=tier, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    right.set_xticks(list(x), names, fontsize=8)
    right.set_ylabel("prompt tokens served per tier")
    right.set_ylim(0, 1)
    right.legend(fontsize=8)
    right.set_title("prefix hit rate by tier", fontsize=9)
    pl.save(fig, path, result.get("hardware"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenfleet bench kvcache", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the results here")
    from . import plot as pl

    pl.add_argument(p, "TTFT and hit rate per tier for each configuration")
    p.add_argument("--requests", type=int, default=48, help="measured requests per configuration")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight (1: each TTFT is the request's own prefix cost, not its queue's)")
    p.add_argument("--host-mb", type=int, default=320, help="host tier of host_tier (host_and_disk: a third)")
    p.add_argument("--disk-mb", type=int, default=1024, help="disk tier budget")
    p.add_argument("--disk-dir", help="where the disk tiers go (default: a temporary directory)")
    p.add_argument("--budget-mb", type=int, default=64, help="the fixed budget of the concurrency count")
    p.add_argument("--price-per-hour", type=float, default=1.0, help="$ per replica-hour, for $/Mtok")
    p.add_argument("--small-model", action="store_true",
                   help="a 2-layer model of hidden 128 instead of the reference model (for tests: the fields, not the figures)")
    p.add_argument("--skip-quality", action="store_true", help="leave out the int8 KV quality measurements")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args, Path(tmp))
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"hardware: {result['hardware']}")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
