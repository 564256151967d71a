"""What the server answers before any handler runs, and clients that stop sending (issue 19, defects 3, 4).

Every answer is an OpenAI-shaped JSON error with the fitting status; a client that stops in the middle of
its head or its body is answered with 408 and disconnected after the configured timeout. The timeouts are
driven by the test: its client stops sending and never resumes, so only their firing is awaited (with a
generous bound), never a race against the host's speed.
"""
from __future__ import annotations

import threading
import time

import pytest

from harness.rawhttp import MALFORMED, closed_by_server, connect, exchange, read_reply
from harness.server import MODEL_NAME, ThreadServer, http, server_config

HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 1.0, 3.0
BOUND_S = 30          # a timeout must have fired by then


@pytest.fixture(scope="module")
def srv(tiny_model):
    s = ThreadServer(server_config(tiny_model, api_key=None, max_body_bytes=4 * 2**20,
                                   header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S))
    yield s
    s.stop()


def _post(body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


@pytest.mark.parametrize("name,data,status", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_requests_get_openai_errors(srv, name, data, status):
    reply = exchange(srv.port, data)
    assert reply.status == status, (reply.status, reply.body[:300])
    assert reply.headers["content-type"].startswith("application/json")
    reply.error()


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
def test_a_10_mb_body_gets_413_not_a_reset(srv, chunked):
    body = b"x" * (10 * 2**20)
    with connect(srv.port) as s:
        if chunked:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(0, len(body), 2**20):
                piece = body[i:i + 2**20]
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            s.sendall(b"0\r\n\r\n")
        else:
            s.sendall(_post(body))
        reply = read_reply(s)
    assert reply.status == 413, reply.body[:200]
    assert reply.error()["type"] == "request_too_large"


def test_a_head_that_stops_arriving_gets_408_and_is_closed(srv):
    with connect(srv.port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")   # and nothing more
        t0 = time.monotonic()
        reply = read_reply(s)
        assert reply.status == 408 and "headers" in reply.error()["message"]
        assert closed_by_server(s) and time.monotonic() - t0 < BOUND_S


def test_a_connection_that_sends_nothing_gets_408_and_is_closed(srv):
    with connect(srv.port) as s:
        reply = read_reply(s)
        assert reply.status == 408
        assert closed_by_server(s)


def test_a_body_that_stops_arriving_gets_408_and_is_closed(srv):
    with connect(srv.port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")                       # 10 of 100 bytes
        reply = read_reply(s)
        assert reply.status == 408 and "body" in reply.error()["message"]
        assert closed_by_server(s)


def test_an_idle_keep_alive_connection_is_not_a_slow_head(srv):
    """The header timeout counts from a request's first byte, not from the last response."""
    with connect(srv.port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_reply(s).status == 200
        time.sleep(HEADER_TIMEOUT_S * 2.5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_reply(s).status == 200


def test_a_stalled_body_does_not_hold_the_drain(tiny_model):
    """A request whose body stops arriving is answered 408 after the body timeout, so SIGTERM's drain is not
    held until its (much longer) drain timeout."""
    srv = ThreadServer(server_config(tiny_model, api_key=None, body_timeout_s=BODY_TIMEOUT_S,
                                     drain_timeout_s=120))
    try:
        with connect(srv.port, timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\": ")
            assert http("GET", f"{srv.base_url}/ready")[0] == 200
            from harness.support import wait_until
            wait_until(lambda: srv.call(lambda: srv.server.active) == 1, what="the slow request in flight")
            t0 = time.monotonic()
            srv.loop.call_soon_threadsafe(srv.server.begin_drain)
            reply = read_reply(s)
            assert reply.status == 408
        srv.thread.join(60)
        assert not srv.thread.is_alive() and srv.rc == 0
        assert time.monotonic() - t0 < 60, "the drain waited for the stalled body"
    finally:
        srv.stop()


def test_valid_requests_are_served_alongside(srv):
    stop = threading.Event()

    def slow_clients() -> None:
        socks = [connect(srv.port) for _ in range(20)]
        for s in socks:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
        stop.wait(60)
        for s in socks:
            s.close()

    t = threading.Thread(target=slow_clients)
    t.start()
    try:
        status, _, _ = http("POST", f"{srv.base_url}/v1/completions",
                            {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2})
        assert status == 200
    finally:
        stop.set()
        t.join(60)


def test_a_body_that_cannot_be_decoded_is_400(srv):
    """Content-Encoding: gzip on a plain body: aiohttp's decoder fails while the handler reads it."""
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    reply = exchange(srv.port, _post(body, b"Content-Encoding: gzip\r\n"))
    assert reply.status == 400 and "cannot be read" in reply.error()["message"]


def test_an_unread_body_that_cannot_be_decoded_is_no_server_error(srv, caplog):
    """An answer given before the body is read (here an unknown route's 404; a drain's 503 and a wrong key's
    401 are the same) leaves aiohttp to read the body away, which fails on a false ``Content-Encoding``:
    the client keeps its answer and the log gets one info line, not an unhandled exception."""
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    request = _post(body, b"Content-Encoding: gzip\r\n").replace(b"/v1/completions", b"/v1/nothing-here")
    with caplog.at_level("INFO"):
        reply = exchange(srv.port, request)
        assert reply.status == 404 and reply.error()["code"] == 404
        from harness.support import wait_until
        wait_until(lambda: any("cannot be decoded" in r.getMessage() for r in caplog.records),
                   what="the read-away of the body to end")
    loud = [r for r in caplog.records if r.levelno >= 40]
    assert not loud, [r.getMessage() for r in loud]
