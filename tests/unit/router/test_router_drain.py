"""A stopping router serves what still reaches it and waits for its open requests (``router/drain.py``); the
end-to-end runs are in tests/e2e/router/test_router_ha.py."""
from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from tokenfleet_serving.router.drain import OpenRequests


class Clock:
    """Time that moves only when the drain sleeps; ``at`` runs a callback once the time reaches it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.at: list[tuple[float, object]] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        for when, callback in [a for a in self.at if a[0] <= self.now]:
            self.at.remove((when, callback))
            callback()
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(coro)


def test_a_request_that_arrives_while_draining_is_served_and_closes_its_connection():
    draining = False
    tracked = OpenRequests(lambda: draining)

    async def handler(_request):
        return web.json_response({"served": True})

    before = run(tracked.track(make_mocked_request("POST", "/v1/completions"), handler))
    assert before.status == 200 and before.keep_alive is not False
    draining = True
    during = run(tracked.track(make_mocked_request("POST", "/v1/completions"), handler))
    assert during.status == 200 and during.keep_alive is False        # the next request goes elsewhere
    assert tracked.count == 0


def test_only_api_requests_count_as_open():
    tracked = OpenRequests(lambda: False)
    seen = []

    async def handler(_request):
        seen.append(tracked.count)
        return web.json_response({})

    for path in ("/ready", "/health", "/metrics", "/v1/chat/completions"):
        run(tracked.track(make_mocked_request("GET", path), handler))
    assert seen == [0, 0, 0, 1] and tracked.count == 0


def test_the_drain_waits_the_minimum_then_for_the_last_open_request():
    async def scenario() -> tuple[float, int]:
        tracked, clock = OpenRequests(lambda: True), Clock()
        release = asyncio.Event()

        async def stream(_request):
            await release.wait()
            return web.json_response({})

        request = asyncio.ensure_future(tracked.track(make_mocked_request("POST", "/v1/completions"), stream))
        await asyncio.sleep(0)
        assert tracked.count == 1
        clock.at.append((9.0, release.set))      # the stream ends at t = 9 s, after the 5 s minimum
        left = await tracked.wait_until_done(5, 60, clock, clock.sleep)
        await request
        return clock.now, left

    ended, left = run(scenario())
    assert left == 0 and 9 <= ended < 9.2


def test_with_nothing_open_the_drain_still_waits_the_minimum_and_a_stuck_request_ends_at_the_timeout():
    def drain(min_s: float, timeout_s: float, open_requests: int) -> tuple[float, int]:
        tracked, clock = OpenRequests(lambda: True), Clock()
        tracked.count = open_requests
        left = run(tracked.wait_until_done(min_s, timeout_s, clock, clock.sleep))
        return clock.now, left

    ended, left = drain(5, 60, 0)
    assert left == 0 and 5 <= ended < 5.1
    ended, left = drain(5, 20, 1)
    assert left == 1 and 20 <= ended < 20.1
    ended, left = drain(30, 10, 0)          # the minimum never outlasts the timeout
    assert left == 0 and 10 <= ended < 10.1
