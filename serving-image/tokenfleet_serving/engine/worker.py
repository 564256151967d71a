"""A rank of a tensor-parallel replica other than rank 0: joins the group, loads its shard, runs forward passes.

``python -m tokenfleet_serving.engine.worker --model DIR --rank R --tensor-parallel-size N ...`` (started by
``LLMEngine`` for the leader host's other local ranks, and by ``tokenfleet serve --headless`` for every
rank of a member host). What to build (dtype, quantization, KV budget, block size) comes from rank 0 at
join (``RankSetup``), so every rank builds the same model; the checkpoint is this rank's own ``--model``,
which must be the same checkpoint as rank 0's (checked at join). The key it proves at the rendezvous
(``rendezvous.py``) comes from the server that started it, on its stdin (``--rendezvous-key-from-stdin``);
started by hand, it derives the key from the environment as a multi-host server does.

Exit codes: 0 when rank 0 released it; 1 when the group broke (a rank gone, a collective timed out, the join
failed or the checkpoints differ), with the reason as one line in the termination log.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..contract.kv_budget import HEADROOM_BYTES, bounded_without_limit, budget_from_memory
from .config import ModelConfig
from .distributed import ParallelConfig, ProcessGroup, RankFailure, check_identities, checkpoint_identity, join
from .loader import load_checkpoint
from .model_runner import ModelRunner
from .rendezvous import key_from_environment
from .tokenizer import Tokenizer
from .wire import wire_type

log = logging.getLogger("tokenfleet.worker")


@wire_type
@dataclass(frozen=True)
class RankSetup:
    """What rank 0 decided, which every rank builds alike."""
    dtype: torch.dtype
    quantization: str
    use_kernels: bool
    max_model_len: int | None
    kv_cache_bytes: int
    block_size: int
    load_format: str = "mmap"
    kv_cache_dtype: str = "auto"
    memory_utilization: float | None = None   # size the KV budget from the device's memory (kv_budget.py)
    device_memory_bytes: int | None = None    # that memory as the operator knows it (None: read the device)


@dataclass
class LoadedRank:
    runner: ModelRunner
    config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    num_blocks: int
    kv_cache_bytes: int


def load_rank(setup: RankSetup, model_dir: str, device: torch.device, group: ProcessGroup | None = None,
              with_tokenizer: bool = False, marks: dict | None = None) -> LoadedRank:
    """Load this rank's share of the checkpoint and allocate its part of the KV cache."""
    # int8 quantizes from the checkpoint's full precision (fp32 holds bf16 and fp16 exactly)
    load_dtype = torch.float32 if setup.quantization == "int8" else setup.dtype
    ckpt = load_checkpoint(model_dir, dtype=load_dtype, with_tokenizer=with_tokenizer, load_format=setup.load_format)
    if marks is not None:
        marks["weights_loaded"] = time.monotonic()
    max_len = min(setup.max_model_len or ckpt.config.max_model_len, ckpt.config.max_model_len)
    runner = ModelRunner(ckpt.config, ckpt.weights, setup.dtype, device, max_len, use_kernels=setup.use_kernels,
                         quantization=setup.quantization, group=group, kv_cache_dtype=setup.kv_cache_dtype)
    config, tokenizer = ckpt.config, ckpt.tokenizer
    del ckpt
    if setup.block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {setup.block_size}")
    block_bytes = runner.kv_block_bytes(setup.block_size)
    budget = setup.kv_cache_bytes
    if setup.memory_utilization is not None:
        budget = utilization_budget(device, setup.memory_utilization, setup.device_memory_bytes,
                                    runner.weight_bytes(), block_bytes)
    else:
        _check_fits(budget, device, setup.device_memory_bytes)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_bytes={budget} is smaller than one KV block ({block_bytes} bytes)")
    pool_bytes = runner.allocate_kv_cache(num_blocks, setup.block_size)
    return LoadedRank(runner, config, tokenizer, max_len, num_blocks, pool_bytes)


def _check_fits(budget: int, device: torch.device, stated: int | None) -> None:
    """An explicit KV budget more than the rank's memory holds is refused naming the flag and the operator's
    field, before an allocation that could only fail (or, on CPU, get the process killed)."""
    memory = usable_memory_bytes(device, stated)
    if budget > memory:
        raise ValueError(
            f"--kv-cache-memory-bytes / --kv-cache-mb (engine.kvCacheMemory / kvCacheMb) of {budget >> 20} MiB is "
            f"more than this rank's {memory >> 20} MiB of {'accelerator memory' if device.type != 'cpu' else 'memory'}"
            "; lower it, or size the cache with --gpu-memory-utilization (engine.acceleratorMemoryUtilization)")


def utilization_budget(device: torch.device, utilization: float, stated: int | None, weight_bytes: int,
                       block_bytes: int) -> int:
    """The KV budget of ``--gpu-memory-utilization``: that fraction of the usable memory less the weights and the
    headroom. A CPU rank with no memory limit shares a host whose size is no measure of its share (other
    replicas, other pods): it takes at most CPU_KV_BYTES_WITHOUT_LIMIT, never a fraction of the whole host."""
    memory = usable_memory_bytes(device, stated)
    budget = budget_from_memory(memory, utilization, weight_bytes)
    capped = bounded_without_limit(budget) if device.type == "cpu" and cgroup_memory_limit() is None else budget
    if capped < budget:
        log.info("KV cache budget %d MiB: the most a CPU rank without a memory limit takes (%.2f of the host's %d MiB "
                 "would be %d MiB); set resources.limits.memory, or --kv-cache-memory-bytes "
                 "(engine.kvCacheMemory), for more", capped >> 20, utilization, memory >> 20, budget >> 20)
        return capped
    log.info("KV cache budget %d MiB: %.2f of %d MiB, less %d MiB of weights and %d MiB of headroom",
             budget >> 20, utilization, memory >> 20, weight_bytes >> 20, HEADROOM_BYTES >> 20)
    if budget < block_bytes:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} (engine.acceleratorMemoryUtilization) leaves no "
            f"room for the KV cache: {utilization} x {memory >> 20} MiB of "
            f"{'accelerator memory' if device.type != 'cpu' else 'memory limit'} less {weight_bytes >> 20} "
            f"MiB of weights and {HEADROOM_BYTES >> 20} MiB of headroom is {budget >> 20} MiB; raise it, the memory "
            "(resources.limits.memory on CPU), or set --kv-cache-memory-bytes")
    return budget


def usable_memory_bytes(device: torch.device, stated: int | None) -> int:
    """The memory ``--gpu-memory-utilization`` takes its fraction of: the stated accelerator memory
    (``--accelerator-memory-bytes``), else the device's. A rank that runs on the CPU never counts on more than
    the container's memory limit (or the host's memory): an accelerator pod scheduled onto a node that only
    pretends to have the device (KWOK, the local pod runner) would otherwise size its KV cache from 80 GiB."""
    measured = device_memory_bytes(device)
    if stated is None:
        return measured
    if device.type == "cpu" and stated > measured:
        log.info("--accelerator-memory-bytes %d MiB is more than this CPU rank may use; sizing from its %d MiB",
                 stated >> 20, measured >> 20)
        return measured
    return stated


def device_memory_bytes(device: torch.device) -> int:
    """The memory a rank may use: an accelerator's total memory, or on CPU the container's memory limit (cgroup
    v2 ``memory.max``, v1 ``memory.limit_in_bytes``), else the host's."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    limit = cgroup_memory_limit()
    if limit is not None:
        return limit
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_memory_limit(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> int | None:
    """This process's cgroup memory limit in bytes, or None without one: the smallest limit of its group and the
    groups above it that this process can see (a group nested in a limited one, as the local pod runner nests a
    pod's, is held to its parent's limit too)."""
    try:
        lines = Path(membership).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, name = Path(root), "memory.max"
        elif "memory" in controllers.split(","):
            base, name = Path(root) / controllers, "memory.limit_in_bytes"
        else:
            continue
        group = base / path.lstrip("/")
        for folder in (group, *group.parents):
            limits += _limit_in(folder / name)
            if folder == base:
                break
    return min(limits) if limits else None


def _limit_in(file: Path) -> list[int]:
    """The limit a cgroup memory file holds ([] for none, or where it cannot be read)."""
    try:
        text = file.read_text().strip()
    except OSError:
        return []
    if text == "max" or not text.isdigit() or int(text) >= 1 << 60:     # v1 writes a huge number for "no limit"
        return []
    return [int(text)]


def rank_threads(parallel: ParallelConfig, usable: int) -> int:
    """Torch threads of one local CPU rank: its share of the cores this process may use."""
    return max(1, usable // parallel.local_ranks)


def spawn_local_ranks(parallel: ParallelConfig, model_dir: str, revision: str | None, local_indexes: range,
                      threads: int, device_type: str) -> list[subprocess.Popen]:
    """Start this host's ranks ``local_indexes`` as worker processes."""
    procs = []
    for i in local_indexes:
        cmd = [sys.executable, "-m", "tokenfleet_serving.engine.worker", "--model", model_dir,
               "--rank", str(parallel.global_rank(i)), "--local-index", str(i),
               "--tensor-parallel-size", str(parallel.tensor_parallel_size), "--nnodes", str(parallel.nnodes),
               "--node-rank", str(parallel.node_rank), "--master-addr", parallel.master_addr,
               "--master-port", str(parallel.master_port), "--distributed-timeout-seconds", str(parallel.timeout_s),
               "--threads", str(threads), "--device", device_type, "--rendezvous-key-from-stdin"]
        if revision:
            cmd += ["--model-revision", revision]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        assert proc.stdin is not None and parallel.key is not None
        with proc.stdin:                # the key on a pipe: not in the command line or the environment
            proc.stdin.write(parallel.key.hex().encode() + b"\n")
        procs.append(proc)
    return procs


def stop_ranks(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """Wait for the worker processes to exit (rank 0 released them), killing those that do not."""
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(args: argparse.Namespace) -> int:
    from tokenfleet_serving.contract.termination import write_termination_message

    parallel = ParallelConfig(args.tensor_parallel_size, 1, args.nnodes, args.node_rank, args.master_addr,
                              args.master_port, args.distributed_timeout_seconds)
    key = (bytes.fromhex(sys.stdin.readline().strip()) if args.rendezvous_key_from_stdin
           else key_from_environment(parallel.address))
    parallel = dataclasses.replace(parallel, key=key)
    device = torch.device("cuda", args.local_index) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    group = None
    try:
        identity = checkpoint_identity(args.model, args.model_revision)
        group = join(parallel, args.rank, device)
        check_identities(group, identity, args.model)
        setup = group.broadcast()
        loaded = load_rank(setup, args.model, device, group)
        group.barrier()
        log.info("rank %d ready: %d KV blocks, %d weight bytes", args.rank, loaded.num_blocks,
                 loaded.runner.weight_bytes())
        loaded.runner.follow()
        return 0
    except RankFailure as e:
        log.error("%s", e)
        write_termination_message(f"tokenfleet worker: {e}")
        return 1
    except Exception as e:  # noqa: BLE001 - any other failure also breaks the replica: say why, exit 1
        log.exception("rank %d failed", args.rank)
        write_termination_message(f"tokenfleet worker rank {args.rank}: {type(e).__name__}: {e}")
        return 1
    finally:
        if group is not None:
            group.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenfleet_serving.engine.worker", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--model-revision", default=None)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local-index", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--distributed-timeout-seconds", type=float, default=60.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rendezvous-key-from-stdin", action="store_true",
                   help="read the replica's rendezvous key (hex) from the first line of stdin (how the server gives "
                        "it to its own ranks); default: derived from $TOKENFLEET_RENDEZVOUS_KEY or $TOKENFLEET_API_KEY")
    p.add_argument("--log-level", default=os.environ.get("TOKENFLEET_LOG_LEVEL", "warning"))
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
