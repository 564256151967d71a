"""Every error the router answers itself is OpenAI-shaped with the fitting status, from aiohttp's parser up
(issue 19, defect 3), and clients that stop sending are answered 408 and disconnected (defect 4). The
router here has no backends: all of this is answered before a request is routed."""
from __future__ import annotations

import json

import pytest

from harness.rawhttp import MALFORMED, closed_by_server, connect, exchange, read_reply
from harness.router import http, start_router

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    d = tmp_path_factory.mktemp("router-errors")
    (d / "router.json").write_text("{}")
    (d / "endpoints.json").write_text("[]")
    r = start_router(d / "router.json", "--header-timeout", "1", "--body-timeout", "3")
    yield r
    r.kill()


@pytest.mark.parametrize("name,data,status", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_requests_get_openai_errors(router, name, data, status):
    reply = exchange(router.port, data)
    assert reply.status == status, (reply.status, reply.body[:300])
    reply.error()


BODIES = [
    ("surrogate in the prompt", b'{"model": "m", "prompt": "\\ud800"}', "prompt"),
    ("surrogate in a chat message", b'{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}',
     "messages[0].content"),
    ("nested 5,000 deep", b"[" * 5000 + b"]" * 5000, None),
    ("integer of 5,000 digits", b'{"model": "m", "prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", None),
    ("not JSON", b"{nope", None),
]


@pytest.mark.parametrize("name,raw,param", BODIES, ids=[c[0] for c in BODIES])
def test_bodies_no_backend_could_take_are_400_at_the_router(router, name, raw, param):
    status, _, body = http("POST", f"{router.base_url}/v1/completions", raw)
    assert status == 400, body
    err = json.loads(body)["error"]
    assert err["code"] == 400 and err["param"] == param and err["type"] == "invalid_request_error"


def test_a_10_mb_chunked_body_gets_413(router):
    with connect(router.port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"x" * 2**20
        for _ in range(10):
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        s.sendall(b"0\r\n\r\n")
        reply = read_reply(s)
    assert reply.status == 413 and reply.error()["type"] == "request_too_large"


def test_a_head_that_stops_arriving_gets_408(router):
    with connect(router.port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert read_reply(s).status == 408
        assert closed_by_server(s)


def test_a_body_that_stops_arriving_gets_408(router):
    with connect(router.port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"mo")
        reply = read_reply(s)
        assert reply.status == 408 and "body" in reply.error()["message"]
        assert closed_by_server(s)


def test_a_body_that_cannot_be_decoded_is_400(router):
    body = b'{"model": "m", "prompt": "hi"}'
    reply = exchange(router.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert reply.status == 400 and "cannot be read" in reply.error()["message"]
