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


# ---- the KV budget of a CPU rank without a memory limit (issue 48, item 1) ------------------------------------
def test_a_cpu_rank_without_a_memory_limit_takes_a_bounded_kv_budget_never_a_share_of_the_host(monkeypatch):
    import os

    import torch

    from tokenfleet_serving.contract.kv_budget import CPU_KV_BYTES_WITHOUT_LIMIT, GIB, HEADROOM_BYTES
    from tokenfleet_serving.engine import worker

    cpu, block = torch.device("cpu"), 1 << 16
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(worker, "cgroup_memory_limit", lambda: None)          # a pod with no memory limit
    # an accelerator-typed service (--accelerator-memory-bytes of an H100) on a node that only pretends to have it
    for stated in (None, 80 * GIB):
        assert worker.utilization_budget(cpu, 0.9, stated, 0, block) == \
            min(CPU_KV_BYTES_WITHOUT_LIMIT, int(0.9 * host) - HEADROOM_BYTES)
    assert CPU_KV_BYTES_WITHOUT_LIMIT == 4 * GIB
    # with a limit, the utilization rule holds: a fraction of the limit, less weights and headroom
    monkeypatch.setattr(worker, "cgroup_memory_limit", lambda: 12 * GIB)
    assert worker.utilization_budget(cpu, 0.9, 80 * GIB, GIB, block) == int(0.9 * 12 * GIB) - GIB - HEADROOM_BYTES


def test_the_memory_limit_is_the_smallest_of_the_group_and_the_groups_above_it(tmp_path):
    from tokenfleet_serving.engine.worker import cgroup_memory_limit

    def write(path, text):
        path.mkdir(parents=True, exist_ok=True)
        (path / ("memory.limit_in_bytes" if "memory" in path.parts else "memory.max")).write_text(text)

    membership = tmp_path / "cgroup"
    # cgroup v1: a pod's group with no limit of its own, nested in the runner's, which has one
    write(tmp_path / "memory", "9223372036854771712")
    write(tmp_path / "memory" / "runner", str(3 << 30))
    write(tmp_path / "memory" / "runner" / "pod", "9223372036854771712")
    membership.write_text("5:cpu:/\n4:memory:/runner/pod\n")
    assert cgroup_memory_limit(str(tmp_path), str(membership)) == 3 << 30
    write(tmp_path / "memory" / "runner" / "pod", str(1 << 30))
    assert cgroup_memory_limit(str(tmp_path), str(membership)) == 1 << 30
    # cgroup v2
    write(tmp_path / "a", str(2 << 30))
    write(tmp_path / "a" / "b", "max")
    membership.write_text("0::/a/b\n")
    assert cgroup_memory_limit(str(tmp_path), str(membership)) == 2 << 30
    membership.write_text("0::/\n")
    assert cgroup_memory_limit(str(tmp_path), str(membership)) is None
