"""``tokenfleet serve --model DIR``: the OpenAI-compatible server process.

Exit codes: 0 after a clean drain (SIGTERM/SIGINT), 1 if the model failed to
load, 2 for bad arguments (an unknown flag, a bad value, a served model name
that is not a plain name, a draft model that does not share the model's
tokenizer), with the flag or file named (the flags: ``serve_args.py``).
Before exiting 1 or 2 it writes the reason as one line to the termination log
(``tokenfleet_serving/contract/termination.py``), and so it does when the engine
dies, so that the pod's last state says why.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading

from tokenfleet_serving.contract.termination import write_termination_message
from tokenfleet_serving.serve_args import ServeArgs, build_parser

log = logging.getLogger("tokenfleet.serve")

SPECULATIVE_FLAGS = {"method": "--speculative-method", "num_speculative_tokens": "--num-speculative-tokens",
                     "draft_model": "--speculative-draft-model", "prompt_lookup_min": "--prompt-lookup-min",
                     "prompt_lookup_max": "--prompt-lookup-max"}


def speculative_config(args: ServeArgs):
    """The engine's SpeculativeConfig from the flags (None when --speculative-method is absent). Raises
    ValueError naming the flag at fault, and CheckpointError naming the draft model's file when it does not
    share the target's tokenizer (checked here, before any weights load)."""
    from tokenfleet_serving.engine.speculative import SpeculativeConfig, SpeculativeConfigError

    given = {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens,
             "draft_model": args.speculative_draft_model, "prompt_lookup_min": args.prompt_lookup_min,
             "prompt_lookup_max": args.prompt_lookup_max}
    if given["method"] is None:
        extra = [SPECULATIVE_FLAGS[k] for k, v in given.items() if v is not None and k != "method"]
        if extra:
            raise ValueError(f"{', '.join(extra)} need --speculative-method")
        return None
    try:
        config = SpeculativeConfig(**{k: v for k, v in given.items() if v is not None})
    except SpeculativeConfigError as e:
        flag = SPECULATIVE_FLAGS.get(e.field, e.field)
        raise ValueError(f"{flag}: {e}") from e
    if config.draft_model is not None:
        from tokenfleet_serving.engine.draft_model import check_compatible

        check_compatible(args.model, config.draft_model)
    return config


def parallel_config(args: ServeArgs):
    """The engine's ParallelConfig from the flags; ValueError naming the flag at fault."""
    import dataclasses

    from tokenfleet_serving.engine.distributed import ParallelConfig
    from tokenfleet_serving.engine.rendezvous import key_from_environment

    if args.nnodes > 1 and not args.master_addr:
        raise ValueError("--master-addr is required when --nnodes > 1 (the leader's address)")
    if args.node_rank > 0 and not args.headless:
        raise ValueError(f"--node-rank {args.node_rank}: a member other than the leader runs with --headless")
    if args.headless and args.node_rank == 0:
        raise ValueError("--headless: node rank 0 is the leader, which serves the API")
    config = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size, args.nnodes, args.node_rank,
                            args.master_addr or "127.0.0.1", args.master_port, args.distributed_timeout_seconds)
    config.check()
    if config.nnodes > 1:
        key = key_from_environment(config.address, args.api_key)
        if key is None:
            raise ValueError("--nnodes > 1 needs the replica's rendezvous key on every host, so that only its own "
                             "ranks can join: set TOKENFLEET_RENDEZVOUS_KEY (or --api-key / TOKENFLEET_API_KEY, "
                             "which the operator sets) to the same secret on each")
        config = dataclasses.replace(config, key=key)
    return config


def lora_config(args: ServeArgs):
    """The engine's LoRAConfig from the flags; None when adapters are off."""
    from tokenfleet_serving.engine.lora_manager import LoRAConfig

    if not args.enable_lora:
        return None
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def config_from_args(args: ServeArgs):
    import os
    import socket

    from tokenfleet_serving.engine.engine import EngineConfig  # imports torch: not needed for --help

    from .app import ServerConfig
    from .warm_restart import WarmRestartConfig

    parallel = parallel_config(args)
    if parallel.world_size > 1 and (args.prefix_checkpoint_dir or os.environ.get("TOKENFLEET_PREFIX_CHECKPOINT_DIR")):
        raise ValueError("--prefix-checkpoint-dir (warm restart) is not implemented with --tensor-parallel-size > 1 "
                         "yet: each rank holds part of every KV block")
    from tokenfleet_serving.engine.kv_offload import KVOffloadConfig

    directory = args.prefix_checkpoint_dir or os.environ.get("TOKENFLEET_PREFIX_CHECKPOINT_DIR") or None
    warm = WarmRestartConfig(directory, args.prefix_checkpoint_name or socket.gethostname(),
                             args.prefix_checkpoint_interval, args.prefix_checkpoint_max_mb * 2**20,
                             args.model_revision) if directory else None
    from tokenfleet_serving.engine.kv_block_file import TIER_KEY_ENV, tier_key

    api_key = args.api_key or os.environ.get("TOKENFLEET_API_KEY") or None
    disk_path = args.kv_offload_disk_path or (warm.store if warm is not None else None)   # warm restart's store
    offload = KVOffloadConfig(args.kv_offload_host_mb * 2**20, disk_path, args.kv_offload_disk_mb * 2**20,
                              tier_key(os.environ.get(TIER_KEY_ENV) or api_key))    # none: this process's own
    if disk_path and not (os.environ.get(TIER_KEY_ENV) or api_key):
        log.warning("KV disk tier %s: no --api-key, $TOKENFLEET_API_KEY or $%s to key its files with, so this "
                    "process keys them with a random key of its own: after a restart it cannot use them "
                    "(warm restart starts cold)", disk_path, TIER_KEY_ENV)
    if offload.enabled and parallel.world_size > 1:
        raise ValueError("--kv-offload-host-mb / --kv-offload-disk-path with --tensor-parallel-size > 1 are not "
                         "implemented yet: each rank would need its own tier of its KV shard")
    engine = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                          kv_cache_bytes=args.kv_cache_bytes, memory_utilization=args.gpu_memory_utilization,
                          device_memory_bytes=args.accelerator_memory_bytes,
                          max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                          enable_prefix_caching=not args.no_prefix_caching, num_threads=args.num_threads,
                          quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, speculative=speculative_config(args),
                          load_format=args.load_format, parallel=parallel if parallel.world_size > 1 else None,
                          model_revision=args.model_revision, lora=lora_config(args),
                          served_model_names=args.served_model_name or (),
                          structured_output_timeout_s=args.structured_output_timeout,
                          structured_output_cache_size=args.structured_output_cache_size,
                          kv_offload=offload if offload.enabled else None)
    return ServerConfig(engine=engine, served_model_names=args.served_model_names,
                        api_key=api_key,
                        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                        max_tokens_limit=args.max_tokens_limit, max_queue=args.max_queue,
                        drain_timeout_s=args.drain_timeout, price_per_hour=args.price_per_hour,
                        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                        engine_stall_timeout_s=args.engine_stall_timeout, warm_restart=warm,
                        tool_call_parser=args.tool_call_parser, lora_modules=args.lora_modules or (),
                        lora_modules_file=args.lora_modules_file, lora_roots=args.lora_root or ())


async def serve(config, host: str, port: int, *, on_listening=None, server_holder: list | None = None,
                engine_factory=None) -> int:
    """Listen, load, serve until drained. Signals are handled when run on the main thread."""
    from aiohttp import web

    from .app import Server
    from .connection import GuardedAppRunner

    server = Server(config) if engine_factory is None else Server(config, engine_factory)
    if server_holder is not None:
        server_holder.append(server)
    runner = GuardedAppRunner(server.app, header_timeout_s=config.header_timeout_s, handler_cancellation=True,
                              access_log=None, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.begin_drain)
    bound = [s.getsockname()[1] for s in site._server.sockets] if site._server else [port]
    log.info("listening on %s:%d", host, bound[0])
    if on_listening is not None:
        on_listening(bound[0])
    rc = 0
    try:
        load = asyncio.ensure_future(server.load())
        stop = asyncio.ensure_future(server.stopped.wait())
        await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
        if load.done() and load.exception() is not None:
            rc = 1
            write_termination_message(f"tokenfleet serve: loading the model failed: {load.exception()}")
        else:
            lost = asyncio.ensure_future(_rank_lost(server))
            await asyncio.wait({stop, lost}, return_when=asyncio.FIRST_COMPLETED)
            if lost.done():
                rc = 1            # a rank of the replica is gone: the Slice restarts as one unit
            lost.cancel()
        if not load.done():
            load.cancel()
    finally:
        await runner.cleanup()
        server.close()
    return rc


async def _rank_lost(server, grace_s: float = 2.0) -> None:
    """Return once the engine died because a rank of its tensor-parallel group is gone (or a collective timed
    out), ``grace_s`` after /health started answering 503 for it."""
    from tokenfleet_serving.engine.distributed import RankFailure

    while True:
        await asyncio.sleep(0.5)
        loop_ = server.engine_loop
        if loop_ is not None and isinstance(loop_.error, RankFailure):
            await asyncio.sleep(grace_s)
            return


def read_ahead(model_dir: str) -> None:
    """Ask the kernel to start reading the weight files into the page cache (``posix_fadvise(WILLNEED)``:
    asynchronous readahead, no CPU of ours), so a cold disk is read while the interpreter imports torch."""
    import os
    from pathlib import Path

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = ServeArgs.from_cli_args(parser.parse_args(argv))
    if args.problem() is not None:
        parser.error(args.problem())
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.load_format == "mmap":        # before torch is imported: the disk works while Python does
        threading.Thread(target=read_ahead, args=(args.model,), name="read-ahead", daemon=True).start()
    try:
        config = config_from_args(args)
    except ValueError as e:          # a flag, or the draft model's files, the engine cannot take: exit 2
        parser.error(str(e))
    import prometheus_client

    prometheus_client.disable_created_metrics()    # like vLLM: no *_created series
    if args.headless:
        from .headless import serve_member

        return asyncio.run(serve_member(config.engine, args.host, args.port))
    return asyncio.run(serve(config, args.host, args.port))
