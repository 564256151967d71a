"""A loopback HTTP proxy in front of one real backend that breaks streams on the test's command.

The router polls and calls the proxy as if it were the backend. Every request passes through to the real
server, except that the test can plan, for the next streamed request of a kind (a fresh request, or a
continuation the router sends after a migration), one fault:

- ``cut``: relay ``after`` events, then close the connection to the router mid-stream (what a SIGKILLed
  replica's connection looks like) and abort the request at the backend;
- ``error``: relay ``after`` events, then send the error event a draining or dying server sends
  (``{"error": {..., "code": 503}}`` and ``[DONE]``);
- ``hold``: relay ``after`` events, then relay nothing more until the backend's connection breaks (the test
  kills the backend process), then close the connection to the router;
- ``refuse``: answer the request with ``status`` and an OpenAI error body instead of passing it on;
- ``linger``: relay the whole stream, ``[DONE]`` included, then leave the response open instead of ending it
  (a backend slow to close its response), until the router hangs up or 60 s pass.

A continuation is a request with ``continuation`` (the bundled engine) or a token-id ``prompt`` (vLLM).

Faults are driven by the events of the stream, never by time.
"""
from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

import aiohttp
from aiohttp import web

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class Fault:
    kind: str                   # cut | error | hold | refuse | linger
    after: int = 0              # events relayed first
    on: str = "fresh"           # fresh | continuation
    status: int = 400           # refuse


class FaultProxy:
    def __init__(self, backend_url: str):
        self.backend_url = backend_url
        self.faults: list[Fault] = []
        self.streams_seen = {"fresh": 0, "continuation": 0}
        self.applied: list[Fault] = []
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        ready = threading.Event()
        self.port = 0

        def run() -> None:
            asyncio.run(self._main(ready))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(30), "fault proxy did not start"
        self.base_url = f"http://127.0.0.1:{self.port}"

    def plan(self, kind: str, after: int = 0, on: str = "fresh", status: int = 400) -> None:
        with self.lock:
            self.faults.append(Fault(kind, after, on, status))

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()

    def close(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)

    def _take(self, on: str) -> Fault | None:
        with self.lock:
            self.streams_seen[on] += 1
            for i, f in enumerate(self.faults):
                if f.on == on:
                    self.applied.append(f)
                    return self.faults.pop(i)
        return None

    async def _main(self, ready: threading.Event) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await self.session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        fault = None
        if request.method == "POST" and body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and parsed.get("stream"):
                # the bundled engine's continuation carries "continuation"; a vLLM one is a token-id prompt
                continued = "continuation" in parsed or isinstance(parsed.get("prompt"), list)
                fault = self._take("continuation" if continued else "fresh")
        if fault is not None and fault.kind == "refuse":
            return web.json_response({"error": {"message": "the fault proxy refuses this continuation",
                                                "type": "invalid_request_error", "param": None,
                                                "code": fault.status}}, status=fault.status)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        try:
            upstream = await self.session.request(request.method, self.backend_url + request.path_qs, data=body,
                                                  headers=headers)
        except aiohttp.ClientError:
            return web.Response(status=502, text="backend unreachable")
        response = web.StreamResponse(status=upstream.status)
        for k, v in upstream.headers.items():
            if k.lower() not in HOP:
                response.headers[k] = v
        await response.prepare(request)
        sent, buffer = 0, b""
        try:
            async for chunk in upstream.content.iter_any():
                if fault is None or fault.kind == "linger":
                    await response.write(chunk)
                    continue
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if sent == fault.after:
                        return await self._fault(request, response, upstream, fault)
                    await response.write(event + b"\n\n")
                    sent += 1
        except aiohttp.ClientError:       # the backend died: so does the connection to the router
            request.transport.close()
            return response
        finally:
            upstream.close()
        if fault is not None and fault.kind == "linger":
            try:
                await asyncio.wait_for(self._stop.wait(), 60)
            except TimeoutError:
                pass
        await response.write_eof()
        return response

    async def _fault(self, request, response, upstream, fault: Fault) -> web.StreamResponse:
        if fault.kind == "error":
            event = {"error": {"message": "aborted: the server is shutting down", "type": "service_unavailable",
                               "param": None, "code": 503}}
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
            await response.write_eof()
            return response
        if fault.kind == "hold":
            try:
                async for _ in upstream.content.iter_any():
                    pass
            except aiohttp.ClientError:
                pass
        request.transport.close()         # cut: the router sees the stream end without its last chunk
        return response
