"""Raw HTTP/1.1 over a socket, for requests no HTTP client library would send (malformed heads, slow or
partial bodies) and for reading whatever the server answers before it closes."""
from __future__ import annotations

import json
import socket
from dataclasses import dataclass


@dataclass
class RawReply:
    status: int | None          # None: the connection closed (or reset) without a response
    headers: dict[str, str]
    body: bytes
    closed: bool                # the server closed the connection after this response

    def error(self) -> dict:
        """The OpenAI error object of a JSON error body (fails the test if it is not one)."""
        doc = json.loads(self.body)
        assert set(doc) == {"error"}, doc
        err = doc["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
        assert err["code"] == self.status and (err["param"] is None or isinstance(err["param"], str)), err
        return err


def connect(port: int, timeout: float = 30.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def decode_chunked(data: bytes) -> bytes:
    """The payload of a chunked transfer-encoded body (as far as it arrived)."""
    out, pos = b"", 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return out
        size = int(data[pos:end].split(b";")[0] or b"0", 16)
        if size == 0:
            return out
        out += data[end + 2:end + 2 + size]
        pos = end + 2 + size + 2


def read_reply(sock: socket.socket, *, until_close: bool = False) -> RawReply:
    """One response: head, then a Content-Length body, a chunked body, or everything until close."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, TimeoutError, OSError):
        pass
    if b"\r\n\r\n" not in data:
        return RawReply(None, {}, data, True)
    head, _, body = data.partition(b"\r\n\r\n")
    while head.startswith(b"HTTP/1.1 100") or head.startswith(b"HTTP/1.0 100"):   # interim: the answer follows
        data = body
        try:
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    return RawReply(None, {}, data, True)
                data += chunk
        except OSError:
            return RawReply(None, {}, data, True)
        head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", "-1"))
    chunked = headers.get("transfer-encoding", "").lower() == "chunked"
    closed = False
    try:
        while True:
            if not until_close and length >= 0 and len(body) >= length:
                break
            if not until_close and chunked and (body == b"0\r\n\r\n" or body.endswith(b"\r\n0\r\n\r\n")):
                break
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            body += chunk
    except (ConnectionResetError, OSError):
        closed = True
    if length >= 0:
        body = body[:length]
    elif chunked:
        body = decode_chunked(body)
    return RawReply(status, headers, body, closed or headers.get("connection", "").lower() == "close")


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed its side (recv returns EOF or the connection resets)."""
    try:
        return sock.recv(65536) == b""
    except (ConnectionResetError, OSError):
        return True


def exchange(port: int, data: bytes, timeout: float = 30.0) -> RawReply:
    with connect(port, timeout) as s:
        try:
            s.sendall(data)
        except OSError:
            pass
        return read_reply(s)


# Requests aiohttp's parser refuses before any handler runs, and the status each must get (as an OpenAI error).
MALFORMED: list[tuple[str, bytes, int]] = [
    ("bad method", b"G@T /health HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("TLS on the HTTP port", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40, 400),
    ("header over 8 KiB", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8300 + b"\r\n\r\n", 431),
    ("header name over 8 KiB", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X" * 8300 + b": 1\r\n\r\n", 431),
    ("200 headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(200))
     + b"\r\n", 431),
    ("request line over 8 KiB", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    ("Content-Length not a number", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    ("negative Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400),
    ("two Content-Lengths", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
     b"Content-Length: 3\r\n\r\n{}", 400),
    ("Content-Length and chunked", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400),
    ("bad chunk size", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n", 400),
    ("control character in a header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),
    ("bad HTTP version", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 400),
    ("blank lines and no request line", b"\r\n\r\n\r\n", 408),
    ("unknown route", b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    ("method not allowed on a route", b"PUT /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
    ("unknown method", b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 400),
]

