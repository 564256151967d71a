"""TCP forwarding between network namespaces: how a real node's network meets the plane's loopback.

The real node (kubelet, containerd and its pods) lives in a network namespace the plane creates, so that
pods get ordinary private addresses that Services and EndpointSlices accept, and nothing changes in the
host's own network. The control plane listens on the host's loopback only. This process joins the two
without routes or interfaces between them: each rule listens in one namespace and, per connection,
connects in another. A socket keeps the namespace it was created in, so one thread switches namespace
(``setns``) only for the instant it creates a socket.

Rules: ``[NETNS@]HOST:PORT=[NETNS@]HOST:PORT`` (listen = connect), NETNS a path such as
``/run/netns/tf-node``; without one, the namespace this process started in. For example
``/run/netns/tf-node@10.96.0.1:443=127.0.0.1:6443`` gives the node's pods the ``kubernetes`` Service
address, served by the API server on the host's loopback.

Run as ``python -m tokenfleet_dev.localcluster.netns_forward RULE...``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("netns-forward")
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Endpoint:
    netns: str | None
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.netns + '@' if self.netns else ''}{self.host}:{self.port}"


@dataclass(frozen=True)
class Rule:
    listen: Endpoint
    connect: Endpoint


def parse_endpoint(text: str) -> Endpoint:
    netns, _, addr = text.rpartition("@")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r}: expected [NETNS@]HOST:PORT")
    return Endpoint(netns or None, host.strip("[]"), int(port))


def parse_rule(text: str) -> Rule:
    listen, sep, connect = text.partition("=")
    if not sep:
        raise ValueError(f"{text!r}: expected LISTEN=CONNECT")
    return Rule(parse_endpoint(listen), parse_endpoint(connect))


_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(path: str | None) -> Iterator[None]:
    """Within the block, sockets this thread creates belong to the namespace at ``path``."""
    if path is None:
        yield
        return
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _serve_rule(rule: Rule) -> asyncio.AbstractServer:
    with in_netns(rule.listen.netns):
        listener = socket.socket(_family(rule.listen.host), socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((rule.listen.host, rule.listen.port))
    listener.listen(128)
    listener.setblocking(False)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with in_netns(rule.connect.netns):
            upstream = socket.socket(_family(rule.connect.host), socket.SOCK_STREAM)
        upstream.setblocking(False)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(
                upstream, (rule.connect.host, rule.connect.port)), timeout=10)
        except (TimeoutError, OSError) as e:
            log.warning("%s: cannot connect to %s: %s", rule.listen, rule.connect, e)
            upstream.close()
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(sock=upstream)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, sock=listener)
    log.info("forwarding %s -> %s", rule.listen, rule.connect)
    return server


async def serve(rules: list[Rule], ready_file: Path | None = None) -> None:
    servers = [await _serve_rule(r) for r in rules]
    if ready_file is not None:
        ready_file.touch()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rules", nargs="+", type=parse_rule, metavar="[NETNS@]HOST:PORT=[NETNS@]HOST:PORT")
    ap.add_argument("--ready-file", type=Path, help="touched once every rule listens")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(args.rules, args.ready_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
