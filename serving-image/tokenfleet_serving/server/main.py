"""``tokenfleet serve --model DIR``: the OpenAI-compatible server process.

Exit codes: 0 after a clean drain (SIGTERM/SIGINT), 1 if the model failed to
load, 2 for bad arguments (an unknown flag, a bad value, a served model name
that is not a plain name, a draft model that does not share the model's
tokenizer), with the flag or file named. Before exiting 1 or 2 it writes the
reason as one line to the termination log
(``tokenfleet_serving/contract/termination.py``), and so it does when the engine
dies, so that the pod's last state says why.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import sys
import threading

from tokenfleet_serving.contract.levers import MAX_SPECULATIVE_TOKENS, QuantizationError, parse_quantization
from tokenfleet_serving.contract.termination import ArgumentParser, write_termination_message

log = logging.getLogger("tokenfleet.serve")

# What `--served-model-name` accepts: 1-128 characters, no whitespace, not starting with '-' (so a
# name can never be taken for a flag). The operator's CRD validates servedModelNames with the same rule.
SERVED_MODEL_NAME = re.compile(r"[^\s-][^\s]{0,127}")


def positive_int(text: str) -> int:
    """argparse type: an int of at least 1 (also used by ``tokenfleet bench engine``)."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_float(text: str) -> float:
    v = float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def _positive_float(text: str) -> float:
    v = float(text)
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return v


def served_model_name(text: str) -> str:
    """argparse type: a model name clients send as 'model'."""
    if not SERVED_MODEL_NAME.fullmatch(text) or not text.isprintable():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a valid model name: 1-128 characters, no whitespace, not starting with '-'")
    return text


def _quantization(text: str) -> str:
    try:
        return parse_quantization(text, "--quantization")
    except QuantizationError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--quantization: ").removeprefix("--quantization ")) from e


def _speculative_tokens(text: str) -> int:
    v = int(text)
    if not 1 <= v <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_SPECULATIVE_TOKENS}], got {v}")
    return v


SPECULATIVE_FLAGS = {"method": "--speculative-method", "num_speculative_tokens": "--num-speculative-tokens",
                     "draft_model": "--speculative-draft-model", "prompt_lookup_min": "--prompt-lookup-min",
                     "prompt_lookup_max": "--prompt-lookup-max"}


def speculative_config(args: argparse.Namespace):
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


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="tokenfleet serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--served-model-name", action="append", default=None, type=served_model_name,
                   help="name clients send as 'model' (repeatable; default: the --model value); 1-128 characters, "
                        "no whitespace, not starting with '-'")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and /cache "
                   "(default: $TOKENFLEET_API_KEY if set)")
    p.add_argument("--max-body-bytes", type=positive_int, default=4 * 2**20)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=None, help="default: context - 1")
    p.add_argument("--max-tokens-limit", type=positive_int, default=None, help="largest max_tokens accepted")
    p.add_argument("--max-queue", type=positive_int, default=256,
                   help="waiting requests beyond this get 429 with Retry-After")
    p.add_argument("--drain-timeout", type=_non_negative_float, default=25.0,
                   help="seconds SIGTERM waits for in-flight requests before aborting them")
    p.add_argument("--header-timeout", type=_positive_float, default=10.0,
                   help="seconds a client has, from connecting or from the first byte of a request, to send the "
                        "request line and headers; then 408 and the connection is closed")
    p.add_argument("--body-timeout", type=_positive_float, default=30.0,
                   help="seconds a client has to send the whole request body after its headers; then 408")
    p.add_argument("--engine-stall-timeout", type=_positive_float, default=120.0,
                   help="an engine step running longer than this is a stuck engine: in-flight requests get 503 "
                        "and /health fails, so the pod is restarted")
    p.add_argument("--price-per-hour", type=_non_negative_float, default=None,
                   help="accelerator $/h, for the tokenfleet:cost_per_million_tokens_usd gauge")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-mb", type=positive_int, default=512)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--max-model-len", type=positive_int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--num-threads", type=positive_int, default=None, help="CPU threads for torch")
    p.add_argument("--quantization", type=_quantization, default="none",
                   help="weight quantization: none, or int8 (weight-only, per output channel, quantized at load)")
    p.add_argument("--speculative-method", choices=("ngram", "draft"), default=None,
                   help="speculative decoding: ngram (prompt lookup) or draft (--speculative-draft-model)")
    p.add_argument("--num-speculative-tokens", type=_speculative_tokens, default=None,
                   help="draft tokens verified per step, 1-16 (default 4)")
    p.add_argument("--speculative-draft-model", default=None,
                   help="checkpoint directory of the draft model (method draft; the target's tokenizer)")
    p.add_argument("--prompt-lookup-min", type=positive_int, default=None, help="smallest n-gram matched (ngram)")
    p.add_argument("--prompt-lookup-max", type=positive_int, default=None, help="largest n-gram matched (ngram)")
    p.add_argument("--load-format", choices=("mmap", "read"), default="mmap",
                   help="mmap: the weight files are read ahead from the process start (while torch is imported) and "
                        "the weights are views of the memory-mapped files until the model packs them (no copy of "
                        "their own); read: each tensor is read into memory first (the former way)")
    warm = p.add_argument_group("warm restart (prefix-cache checkpoints; docs/recovery.md)")
    warm.add_argument("--prefix-checkpoint-dir", default=None,
                      help="directory to save the hottest prefix-cache blocks to (periodically and on drain) and "
                           "load them from at start (default: $TOKENFLEET_PREFIX_CHECKPOINT_DIR; unset: off)")
    warm.add_argument("--prefix-checkpoint-name", default=None,
                      help="this replica's file name in that directory (default: the host name); a replacement "
                           "given the same name starts from its predecessor's blocks")
    warm.add_argument("--prefix-checkpoint-interval", type=_positive_float, default=60.0,
                      help="seconds between saves (a save is skipped when the hottest blocks did not change)")
    warm.add_argument("--prefix-checkpoint-max-mb", type=positive_int, default=256,
                      help="most megabytes of KV blocks a checkpoint holds, hottest first")
    warm.add_argument("--model-revision", default=None,
                      help="the model's revision, which a checkpoint must match to be loaded (default: a "
                           "fingerprint of the weight files)")
    lora = p.add_argument_group("LoRA adapters (vLLM's flags; docs/engine.md)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters of this model")
    lora.add_argument("--lora-modules", nargs="+", default=None, type=_lora_module, metavar="NAME=PATH",
                      help="adapters to load at start (PEFT directories); more come with /v1/load_lora_adapter")
    lora.add_argument("--max-loras", type=positive_int, default=4, help="distinct adapters in one batch")
    lora.add_argument("--max-lora-rank", type=positive_int, default=16, help="largest adapter rank accepted")
    lora.add_argument("--max-cpu-loras", type=positive_int, default=None,
                      help="adapters kept loaded (default: --max-loras); others are read again on use")
    par = p.add_argument_group("parallelism (one replica over several accelerators or hosts; docs/engine.md)")
    par.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                     help="ranks the model's weights and KV cache are split over; on one host this process starts "
                          "the other ranks itself, one process per local accelerator (CPU: per share of the cores)")
    par.add_argument("--pipeline-parallel-size", type=positive_int, default=1,
                     help="pipeline stages: not implemented yet, a value above 1 is refused")
    par.add_argument("--nnodes", type=positive_int, default=1, help="hosts in the replica")
    par.add_argument("--node-rank", type=int, default=0, help="this host's index in the replica, 0 = the leader")
    par.add_argument("--master-addr", default=None,
                     help="the leader's address (a DNS name), required when --nnodes > 1")
    par.add_argument("--master-port", type=int, default=29500, help="rendezvous port on the leader")
    par.add_argument("--headless", action="store_true",
                     help="serve no OpenAI API, only /health and /metrics on --port, and run this host's ranks "
                          "(every --node-rank > 0)")
    par.add_argument("--distributed-timeout-seconds", type=_positive_float, default=60.0,
                     help="bound for joining the replica and for every collective; a rank that cannot reach the "
                          "leader, or whose peer is gone, exits non-zero within it naming the rank and address")
    p.add_argument("--log-level", default="info")
    return p


def parallel_config(args: argparse.Namespace):
    """The engine's ParallelConfig from the flags; ValueError naming the flag at fault."""
    from tokenfleet_serving.engine.distributed import ParallelConfig

    if args.nnodes > 1 and not args.master_addr:
        raise ValueError("--master-addr is required when --nnodes > 1 (the leader's address)")
    if args.node_rank > 0 and not args.headless:
        raise ValueError(f"--node-rank {args.node_rank}: a member other than the leader runs with --headless")
    if args.headless and args.node_rank == 0:
        raise ValueError("--headless: node rank 0 is the leader, which serves the API")
    config = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size, args.nnodes, args.node_rank,
                            args.master_addr or "127.0.0.1", args.master_port, args.distributed_timeout_seconds)
    config.check()
    return config


def _lora_module(text: str) -> tuple[str, str]:
    """argparse type: NAME=PATH of a LoRA adapter."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return served_model_name(name), path


def lora_config(args: argparse.Namespace):
    from tokenfleet_serving.engine.lora_manager import LoRAConfig

    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if not args.enable_lora:
        return None
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


class _Refused(Exception):
    pass


def argument_error(argv: list[str]) -> str | None:
    """The one-line error ``tokenfleet serve`` would exit 2 with for ``argv``, or None when it takes them.
    Imports no torch, writes nothing: for validating a pod's arguments before the pod runs."""
    parser = build_parser()

    def refuse(message: str):
        raise _Refused(f"{parser.prog}: error: {message}")

    parser.error = refuse  # type: ignore[method-assign]
    try:
        parser.parse_args(argv)
    except _Refused as exc:
        return str(exc)
    return None


def config_from_args(args: argparse.Namespace):
    import os
    import socket

    from tokenfleet_serving.engine.engine import EngineConfig  # imports torch: not needed for --help

    from .app import ServerConfig
    from .warm_restart import WarmRestartConfig

    parallel = parallel_config(args)
    if parallel.world_size > 1 and (args.prefix_checkpoint_dir or os.environ.get("TOKENFLEET_PREFIX_CHECKPOINT_DIR")):
        raise ValueError("--prefix-checkpoint-dir (warm restart) is not implemented with --tensor-parallel-size > 1 "
                         "yet: each rank holds part of every KV block")
    engine = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                          kv_cache_bytes=args.kv_cache_mb * 2**20, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                          enable_prefix_caching=not args.no_prefix_caching, num_threads=args.num_threads,
                          quantization=args.quantization, speculative=speculative_config(args),
                          load_format=args.load_format, parallel=parallel if parallel.world_size > 1 else None,
                          model_revision=args.model_revision, lora=lora_config(args),
                          served_model_names=tuple(args.served_model_name or ()))
    directory = args.prefix_checkpoint_dir or os.environ.get("TOKENFLEET_PREFIX_CHECKPOINT_DIR") or None
    warm = WarmRestartConfig(directory, args.prefix_checkpoint_name or socket.gethostname(),
                             args.prefix_checkpoint_interval, args.prefix_checkpoint_max_mb * 2**20,
                             args.model_revision) if directory else None
    return ServerConfig(engine=engine, served_model_names=tuple(args.served_model_name or [args.model]),
                        api_key=args.api_key or os.environ.get("TOKENFLEET_API_KEY") or None,
                        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                        max_tokens_limit=args.max_tokens_limit, max_queue=args.max_queue,
                        drain_timeout_s=args.drain_timeout, price_per_hour=args.price_per_hour,
                        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                        engine_stall_timeout_s=args.engine_stall_timeout, warm_restart=warm,
                        lora_modules=tuple(args.lora_modules or ()))


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
    args = parser.parse_args(argv)
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
