"""A stand-in for a ClusterIP Service in front of router processes: what kube-proxy does for the router pods.

Each new client connection goes, round robin, to one of the endpoints that were ready at the last look, and
its bytes are relayed both ways until either side closes; an endpoint that dies mid-connection cuts the
client's connection (as a SIGKILLed pod's connections are cut). The endpoints are followed as the endpoints
controller follows pods: every ``poll_s`` seconds each endpoint's ``GET /ready`` is asked, and only a 200
keeps it in the rotation, so a pod that turns unready (draining) or stops answering (killed) is left out from
the next look on, and a new one joins once it is ready. Between two looks the old list holds, which is the
window in which a stopping pod still gets new connections.

``routes`` records, for every accepted connection, the client's local port and the endpoint it went to, so a
test can count which streams were on which router.
"""
from __future__ import annotations

import asyncio
import itertools
import threading


async def _ready(port: int) -> bool:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
    except (OSError, TimeoutError):
        return False
    try:
        writer.write(b"GET /ready HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
        line = await asyncio.wait_for(reader.readline(), 1.0)
        return line.split(b" ")[1:2] == [b"200"]
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except OSError:
        pass
    finally:
        if writer.can_write_eof():
            try:
                writer.write_eof()
            except OSError:
                pass


class ServiceProxy:
    def __init__(self, poll_s: float = 0.5):
        self.poll_s = poll_s
        self.endpoints: dict[str, int] = {}         # name -> port
        self.ready: list[str] = []                  # as of the last look
        self.routes: dict[int, str] = {}            # client's local port -> endpoint name
        self.refused = 0                            # connections to an endpoint that did not answer
        self._rr = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        started = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main(started)), daemon=True)
        self._thread.start()
        assert started.wait(10), "service proxy did not start"

    def add(self, name: str, port: int) -> None:
        self.endpoints = {**self.endpoints, name: port}

    def remove(self, name: str) -> None:
        self.endpoints = {k: v for k, v in self.endpoints.items() if k != name}

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self, started: threading.Event) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        poller = asyncio.ensure_future(self._follow())
        started.set()
        await self._stop.wait()
        poller.cancel()
        server.close()

    async def _follow(self) -> None:
        while True:
            endpoints = dict(self.endpoints)
            answers = await asyncio.gather(*(_ready(p) for p in endpoints.values()))
            self.ready = [name for name, ok in zip(endpoints, answers) if ok]
            await asyncio.sleep(self.poll_s)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        ready = list(self.ready)
        if not ready:
            client_w.close()
            return
        name = ready[next(self._rr) % len(ready)]
        self.routes[client_w.get_extra_info("peername")[1]] = name
        try:
            upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.endpoints.get(name, 1))
        except OSError:
            self.refused += 1
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, upstream_w), _pipe(upstream_r, client_w))
        upstream_w.close()
        client_w.close()
