"""``tokenfleet route --config /etc/tokenfleet/router.json``: the cache- and load-aware router.

Exit codes: 0 after SIGTERM/SIGINT (``/ready`` turns 503; requests that still
arrive are served for at least --drain-min-seconds, and open ones finish, up to
--drain-timeout: ``router/drain.py``), 2 for bad arguments, a bad router.json or unreadable client
keys; the reason also goes, as one line, to the termination log
(``tokenfleet_serving/contract/termination.py``).

Keys: ``--client-keys PATH`` (default ``$TOKENFLEET_CLIENT_KEYS``) are the keys
clients must send (``router/auth.py``; without it the router lets every client
in); ``--backend-api-key`` (default ``$TOKENFLEET_API_KEY``) is the router's own
key for the replicas, which clients never see.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from tokenfleet_serving.contract.termination import CONFIGURATION_EXIT_CODE, ArgumentParser, write_termination_message

log = logging.getLogger("tokenfleet.router")

# Seconds a stopping router keeps taking new requests: the endpoints controller and the nodes' proxies need
# about this long to stop sending it any after its readiness turns 503.
DRAIN_MIN_SECONDS = 5.0


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _non_negative_float(text: str) -> float:
    v = float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="tokenfleet route", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="router.json (written by the operator into the router ConfigMap)")
    p.add_argument("--endpoints", default=None,
                   help="endpoints.json, re-read when it changes (default: endpoints.json next to --config)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--model", default=None,
                   help="model directory to load the tokenizer from (default: modelPath in router.json)")
    p.add_argument("--target-model", nargs=2, action="append", default=[], metavar=("TARGET", "DIR"),
                   help="route mode: the model directory of a target, to load its tokenizer and chat template from "
                        "(repeat per target; a target without one is scored by characters / 4)")
    p.add_argument("--poll-interval", type=_positive_float, default=0.5,
                   help="seconds between polls of each backend's /metrics and /cache/blocks")
    p.add_argument("--backend-api-key", default=None,
                   help="the router's key for the replicas (their --api-key), sent on every request and poll in "
                        "place of the client's credentials (default: $TOKENFLEET_API_KEY)")
    p.add_argument("--client-keys", default=None,
                   help="file, or directory of files (a mounted Secret), with the API keys clients must send, one "
                        "per line; re-read when it changes (default: $TOKENFLEET_CLIENT_KEYS; none: no client auth)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20 + 4096)
    p.add_argument("--header-timeout", type=_positive_float, default=10.0,
                   help="seconds a client has to send a request line and headers; then 408 and close")
    p.add_argument("--body-timeout", type=_positive_float, default=30.0,
                   help="seconds a client has to send the whole body after its headers; then 408 and close")
    p.add_argument("--max-held-bytes", type=int, default=64 * 2**20,
                   help="body bytes of all requests held while no replica is ready, together; past it 503 with "
                        "Retry-After (tokenfleet_router_hold_refusals_total{reason=\"bytes\"})")
    p.add_argument("--max-sessions", type=int, default=50_000,
                   help="session keys remembered for session affinity; past it the least recently used is forgotten")
    p.add_argument("--stall-timeout", type=_positive_float, default=15.0,
                   help="seconds a backend may send nothing while its polls fail or time out; then it is taken as "
                        "frozen: what waits on it goes to another backend, its streams are continued elsewhere")
    p.add_argument("--backend-runtime", choices=("tokenfleet", "vllm"), default="tokenfleet",
                   help="the engine the replicas run: tokenfleet (the bundled engine: cached blocks polled from "
                        "/cache/blocks, migration by continuation) or vllm (prefix affinity from the router's own "
                        "record of routed blocks, migration by a token-id continuation prompt); docs/routing.md")
    p.add_argument("--drain-timeout", type=_positive_float, default=25.0,
                   help="seconds a stopping router has to finish its open requests (routing.drainSeconds)")
    p.add_argument("--drain-min-seconds", type=_non_negative_float, default=DRAIN_MIN_SECONDS,
                   help="seconds a stopping router keeps serving new requests while its Service takes it out of "
                        "its endpoints (capped by --drain-timeout)")
    p.add_argument("--log-level", default="info")
    return p


def load_tokenizer(model_dir: str | None):
    """The prompt tokenizer, or None (with a warning) when there is none: routing then ignores prefixes."""
    from tokenfleet_serving.engine.config import CheckpointError
    from tokenfleet_serving.engine.tokenizer import load_tokenizer as load

    if not model_dir:
        log.warning("no model directory (modelPath in router.json or --model): prefix-aware routing sees "
                    "only token-id prompts")
        return None
    try:
        return load(model_dir)
    except CheckpointError as exc:
        log.warning("cannot load the tokenizer (%s): prefix-aware routing sees only token-id prompts", exc)
        return None


async def run(router, host: str, port: int, drain_timeout_s: float, *, on_listening=None,
              stop: asyncio.Event | None = None, header_timeout_s: float = 10.0, drain_min_s: float = 0.0) -> int:
    from aiohttp import web

    from tokenfleet_serving.server.connection import GuardedAppRunner

    runner = GuardedAppRunner(router.app, header_timeout_s=header_timeout_s, handler_cancellation=True,
                              access_log=None, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else port
    log.info("routing on %s:%d (policy %s)", host, bound, router.config.policy)
    stop = stop or asyncio.Event()
    if threading.current_thread() is threading.main_thread():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if on_listening is not None:
        on_listening(bound)
    try:
        await stop.wait()
        log.info("stopping: /ready is 503; serving for %.0f s more at least, until no request is open "
                 "(at most %.0f s)", min(drain_min_s, drain_timeout_s), drain_timeout_s)
        await router.drain(drain_timeout_s, drain_min_s)
    finally:
        await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tokenfleet_serving.contract.router_files import ConfigError, load_router_config
    from tokenfleet_serving.router.app import Router
    from tokenfleet_serving.router.auth import ClientKeys, KeyFileError

    try:
        config = load_router_config(args.config)
        keys_path = args.client_keys or os.environ.get("TOKENFLEET_CLIENT_KEYS") or None
        client_keys = ClientKeys(keys_path) if keys_path else None
        if config.prefix_source == "kvEvents" and args.backend_runtime != "vllm":
            raise ConfigError(f"{args.config}: prefixSource kvEvents reads vLLM's KV events, and --backend-runtime "
                              f"is {args.backend_runtime} (whose replicas report their blocks on /cache/blocks)")
    except (ConfigError, KeyFileError) as exc:
        print(f"tokenfleet route: {exc}", file=sys.stderr)
        write_termination_message(f"tokenfleet route: {exc}")
        return CONFIGURATION_EXIT_CODE
    if client_keys is None:
        log.warning("no client keys (--client-keys or $TOKENFLEET_CLIENT_KEYS): every client is let in")
    else:
        log.info("clients must send one of %d keys from %s", len(client_keys), client_keys.path)
    backend_key = args.backend_api_key or os.environ.get("TOKENFLEET_API_KEY") or None
    if backend_key is None:
        log.warning("no backend key (--backend-api-key or $TOKENFLEET_API_KEY): replicas must accept requests "
                    "without one, and their /cache/blocks is closed to the router")
    endpoints = args.endpoints or str(Path(args.config).with_name("endpoints.json"))
    tokenizer = load_tokenizer(args.model or config.model_path) if config.route is None else None
    target_tokenizers = {name: load_tokenizer(path) for name, path in args.target_model}
    router = Router(config, endpoints, tokenizer, poll_interval_s=args.poll_interval, backend_api_key=backend_key,
                    max_body_bytes=args.max_body_bytes, client_keys=client_keys, body_timeout_s=args.body_timeout,
                    max_held_bytes=args.max_held_bytes, max_sessions=args.max_sessions,
                    stall_timeout_s=args.stall_timeout, backend_runtime=args.backend_runtime,
                    target_tokenizers=target_tokenizers)
    return asyncio.run(run(router, args.host, args.port, args.drain_timeout, header_timeout_s=args.header_timeout,
                           drain_min_s=args.drain_min_seconds))


if __name__ == "__main__":
    sys.exit(main())
