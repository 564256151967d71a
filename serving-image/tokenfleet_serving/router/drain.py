"""How a router pod stops without losing a request (SIGTERM; ``main.run``).

A router pod told to stop (a rolling update, a scale-down, a node drain) is still in its Service's endpoints
for a moment: the endpoints controller and every node's proxy learn of the stop at the same time as the pod,
so new connections can reach it for a second or two. Refusing them would lose them, so the drain:

1. turns ``/ready`` to 503 at once (the router's ``draining``), which takes the pod out of the endpoints;
2. keeps serving every request that reaches it, and answers each with ``Connection: close`` so that the
   client's next request opens a connection through the Service, to another router pod;
3. ends once at least ``min_s`` seconds have passed (``--drain-min-seconds``, the time the Service needs to
   stop sending) and no request is open (every stream finished), or at ``timeout_s`` (``--drain-timeout``,
   ``routing.drainSeconds``) whatever is still open.

``OpenRequests`` counts the requests in the handlers (``/v1/*``, held and streamed ones included, from their
first byte of headers to their last byte of answer); probes and ``/metrics`` do not count.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

# How often the drain looks at the count of open requests.
DRAIN_POLL_SECONDS = 0.05


class OpenRequests:
    """The requests a router is answering now, and whether it is draining (then each answer closes its
    connection)."""

    def __init__(self, draining: Callable[[], bool]):
        self.count = 0
        self._draining = draining

    @web.middleware
    async def track(self, request: web.Request, handler):
        if not request.path.startswith("/v1/"):
            return await handler(request)
        self.count += 1
        try:
            response = await handler(request)
        finally:
            self.count -= 1
        if self._draining():
            response.force_close()       # the next request goes through the Service, to a router that stays
        return response

    async def wait_until_done(self, min_s: float, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                              sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> int:
        """Wait at least ``min_s`` (capped by ``timeout_s``) and then until no request is open, up to
        ``timeout_s`` from now; the count still open at the end (0 after a clean drain)."""
        start = clock()
        floor, deadline = start + min(min_s, timeout_s), start + timeout_s
        while clock() < deadline and (clock() < floor or self.count > 0):
            await sleep(DRAIN_POLL_SECONDS)
        return self.count
