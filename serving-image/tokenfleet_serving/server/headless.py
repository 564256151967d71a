"""``tokenfleet serve --headless``: a member host of a multi-host replica (``--node-rank`` > 0).

It serves no OpenAI API. It starts this host's ranks of the replica (``engine/worker.py``, one process per
local accelerator, each with its share of the CPU cores), which join the leader's group, and answers
``/health`` (200 while every local rank runs, 503 once one has exited) and ``/metrics`` on ``--port``.
When a rank exits non-zero (it could not reach the leader, a peer is gone, a collective timed out, its
checkpoint differs) the member stops the others and exits 1, shortly after /health turned 503; the rank
already left its reason (naming its rank and the address) in the termination log. When the leader releases
the ranks (a clean shutdown) it exits 0.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger("tokenfleet.serve")


async def serve_member(engine_config, host: str, port: int, grace_s: float = 2.0) -> int:
    import torch

    from tokenfleet_serving.engine.engine import usable_cpus
    from tokenfleet_serving.engine.worker import rank_threads, spawn_local_ranks, stop_ranks

    parallel = engine_config.parallel
    assert parallel is not None and parallel.node_rank > 0
    cuda = engine_config.device == "cuda" or (engine_config.device == "auto" and torch.cuda.is_available())
    threads = engine_config.num_threads or rank_threads(parallel, usable_cpus())
    ranks = spawn_local_ranks(parallel, engine_config.model, engine_config.model_revision,
                              range(parallel.local_ranks), threads, "cuda" if cuda else "cpu")
    first = parallel.global_rank(0)
    registry = CollectorRegistry()
    running = Gauge("tokenfleet:member_ranks_running", "this member host's ranks of the replica still running",
                    registry=registry)
    running.set(len(ranks))

    def exited() -> list[tuple[int, int]]:
        return [(first + i, p.returncode) for i, p in enumerate(ranks) if p.poll() is not None]

    async def health(request: web.Request) -> web.Response:
        gone = exited()
        body = {"node_rank": parallel.node_rank, "ranks": [first + i for i in range(len(ranks))],
                "leader": parallel.address}
        if gone:
            return web.json_response({**body, "status": "rank exited", "exited": dict(gone)}, status=503)
        return web.json_response({**body, "status": "ok"})

    async def metrics(request: web.Request) -> web.Response:
        running.set(len(ranks) - len(exited()))
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("member %d of %d: ranks %d..%d joining %s; /health on %s:%d", parallel.node_rank, parallel.nnodes,
             first, first + len(ranks) - 1, parallel.address, host, port)
    stop = asyncio.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    rc = 0
    try:
        while not stop.is_set():
            gone = exited()
            if any(code != 0 for _, code in gone):
                log.error("rank(s) exited: %s; stopping this member", dict(gone))
                rc = 1
                await asyncio.sleep(grace_s)          # /health answers 503 meanwhile
                break
            if len(gone) == len(ranks):               # every rank released by the leader
                break
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass
    finally:
        for p in ranks:
            if p.poll() is None:
                p.terminate()
        await asyncio.to_thread(stop_ranks, ranks, 5.0)
        await runner.cleanup()
    return rc
