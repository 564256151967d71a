"""``tokenfleet serve --model DIR``: the OpenAI-compatible server process.

Exit codes: 0 after a clean drain (SIGTERM/SIGINT), 1 if the model failed to
load, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading

log = logging.getLogger("tokenfleet.serve")


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenfleet serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name clients send as 'model' (repeatable; default: the --model value)")
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
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(args: argparse.Namespace):
    import os

    from tokenfleet_serving.engine.engine import EngineConfig   # imports torch: not needed for --help

    from .app import ServerConfig

    engine = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                          kv_cache_bytes=args.kv_cache_mb * 2**20, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                          enable_prefix_caching=not args.no_prefix_caching, num_threads=args.num_threads)
    return ServerConfig(engine=engine, served_model_names=tuple(args.served_model_name or [args.model]),
                        api_key=args.api_key or os.environ.get("TOKENFLEET_API_KEY") or None,
                        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                        max_tokens_limit=args.max_tokens_limit, max_queue=args.max_queue,
                        drain_timeout_s=args.drain_timeout, price_per_hour=args.price_per_hour)


async def serve(config, host: str, port: int, *, on_listening=None, server_holder: list | None = None,
                engine_factory=None) -> int:
    """Listen, load, serve until drained. Signals are handled when run on the main thread."""
    from aiohttp import web

    from .app import Server

    server = Server(config) if engine_factory is None else Server(config, engine_factory)
    if server_holder is not None:
        server_holder.append(server)
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None, shutdown_timeout=5)
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
        else:
            await stop
        if not load.done():
            load.cancel()
    finally:
        await runner.cleanup()
        server.close()
    return rc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    import prometheus_client

    prometheus_client.disable_created_metrics()    # like vLLM: no *_created series
    return asyncio.run(serve(config, args.host, args.port))
