"""Memory: the KV pool stays inside its budget; process memory is flat across 10,000 requests."""
from __future__ import annotations

import gc
import multiprocessing
import random
from pathlib import Path

import pytest

from tokenfleet_serving.engine import LLMEngine, SamplingParams


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found")


@pytest.mark.parametrize("budget", [10_000, 1 << 20, 3 * (1 << 20) + 123])
def test_kv_pool_never_exceeds_its_budget(llama_dir, budget):
    eng = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=budget, block_size=4)
    pool_bytes = eng.runner.kv_pool.numel() * eng.runner.kv_pool.element_size()
    assert pool_bytes <= budget and eng.kv_cache_bytes == pool_bytes
    assert budget - pool_bytes < eng.runner.kv_block_bytes(4)          # and wastes less than one block
    assert eng.kv.pool.num_blocks == eng.runner.kv_pool.shape[3]


def serve_10000_requests(model_dir: str) -> dict:
    """Runs in a fresh process (a serving process has one model): measures RSS around 9,000 requests."""
    eng = LLMEngine.from_pretrained(model_dir, dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=2, temperature=0.8, top_k=50, seed=1, logprobs=1, stop=("zz",))

    def batch(n):
        outs = eng.generate([[rng.randrange(5, 512) for _ in range(rng.randrange(2, 12))] for _ in range(n)], params)
        assert all(o.finished for o in outs)

    batch(1000)                                   # warm-up: allocator pools, caches
    # and oneDNN's compiled primitives, one per padded row count (8, 16, ..., 256; model.Linear): a step
    # of n decodes uses row count n, so n requests decoding together touch each of them once
    for n in range(8, 257, 8):
        eng.generate([[5 + i % 500, 7] for i in range(n)], SamplingParams(max_tokens=2, ignore_eos=True))
    gc.collect()
    before = rss_bytes()
    for _ in range(9):
        batch(1000)
    gc.collect()
    stats = eng.stats()
    return {"growth": rss_bytes() - before, "live_requests": len(eng.requests),
            "block_tables": len(eng.kv.block_tables), "free": eng.kv.pool.num_free,
            "blocks": eng.kv.pool.num_blocks, "cached": len(eng.kv.pool.cached),
            "finished": stats.finished["length"] + stats.finished.get("stop", 0)}


@pytest.mark.slow
def test_process_memory_is_flat_across_10000_requests(llama_dir):
    # A fresh interpreter: oneDNN's primitive cache is process-wide, and the other tests' models would share it.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        r = pool.apply(serve_10000_requests, (str(llama_dir),))
    assert r["live_requests"] == 0 and r["block_tables"] == 0 and r["free"] == r["blocks"]
    assert r["cached"] <= r["blocks"]
    assert r["finished"] == 10_000 + sum(range(8, 257, 8))
    assert r["growth"] < 8 * 2**20, f"RSS grew by {r['growth'] / 2**20:.1f} MiB over 9,000 requests"


def test_a_budget_larger_than_the_ranks_memory_is_refused_naming_the_field(llama_dir):
    """Issue 48: kvCacheMemory 1Pi crashed three times with an error naming no field; now the start is refused
    before the allocation, naming the flag and the operator's field."""
    with pytest.raises(ValueError, match=r"--kv-cache-memory-bytes.*engine\.kvCacheMemory.*more than this rank"):
        LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=1 << 50, block_size=4)
