"""Issue 37: what a hostile client could make the router do, and what it does now. One real ``tokenfleet serve``
behind ``tokenfleet route`` (client keys, an SLO, session affinity).

- defect 3: requests refused for the client's fault (by the router or by the replica) are counted apart, in
  ``tokenfleet_router_client_errors_total``, and never as SLO misses: bad requests cannot scale the fleet up;
- defect 5: session ids over the stated length, or with bytes other than printable ASCII, are a 400 naming the
  header;
- defect 7: a ``\\xff`` byte in ``Authorization`` (the router's client check, the replica's key check) or in the
  session header is a 401 or a 400, never a 500;
- defect 8: a gzip or deflate body is decoded at the router as at the replica, with the same limit on the
  decoded bytes; an over-long chunked body without Content-Length is a 413 as soon as the limit is passed.
"""
from __future__ import annotations

import gzip
import json
import select
import time
import zlib

import pytest

from harness.rawhttp import connect, exchange, read_reply
from harness.router import MODEL_NAME, ROUTER_KEY, http, metric_samples, start_backend, start_router, wait_routable

pytestmark = pytest.mark.slow

CLIENT_KEY = "limits-client-key"
OK = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 2, "ignore_eos": True}
MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("limits")
    backend = start_backend(tiny_model, "--api-key", ROUTER_KEY, "--max-body-bytes", str(MAX_BODY))
    router = None
    try:
        (d / "keys").write_text(CLIENT_KEY + "\n")
        (d / "router.json").write_text(json.dumps({
            "service": "tiny", "namespace": "t", "models": [MODEL_NAME], "kvBlockSize": 16, "modelPath": str(tiny_model),
            "slo": {"timeToFirstTokenMs": 600000, "timePerOutputTokenMs": 60000},
            "sessionAffinity": {"enabled": True}}))
        (d / "endpoints.json").write_text(json.dumps([{"pod": "tiny-0-0", "slice": "tiny-0", "ip": "127.0.0.1",
                                                       "port": backend.port, "ready": True}]))
        router = start_router(d / "router.json", "--backend-api-key", ROUTER_KEY, "--client-keys", str(d / "keys"),
                              "--max-body-bytes", str(MAX_BODY))
        wait_routable(router, 1)
        yield {"router": router, "backend": backend}
    finally:
        if router is not None:
            router.kill()
        backend.kill()


def post(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    """A raw POST, header values as latin-1 bytes (so ``\\xff`` goes on the wire as the byte 0xff)."""
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Connection: close", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in headers.items())]
    if "Transfer-Encoding" not in headers:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


CLIENT = {"Authorization": f"Bearer {CLIENT_KEY}"}


def slo_and_client_errors(base_url: str) -> tuple[float, float, dict[str, float]]:
    m = metric_samples(base_url)
    errors = {k.split("code=")[1].rstrip("}"): v for k, v in m.items()
              if k.startswith("tokenfleet_router_client_errors_total{")}
    return (m["tokenfleet_router_slo_requests_total{result=met}"],
            m["tokenfleet_router_slo_requests_total{result=missed}"], errors)


def test_client_errors_are_counted_apart_and_never_as_slo_misses(fleet):
    """Defect 3: 200 refused requests gave "met +0, missed +200" and scaled the fleet up."""
    router = fleet["router"]
    met0, missed0, errors0 = slo_and_client_errors(router.base_url)
    bad = [
        (json.dumps(OK | {"frobnicate": 1}).encode(), CLIENT, 400),                    # the replica refuses it
        (json.dumps(OK | {"frobnicate": 1, "stream": True}).encode(), CLIENT, 400),
        (json.dumps(OK | {"continuation": {}}).encode(), CLIENT, 400),                  # the router refuses it
        (json.dumps(OK | {"model": "no-such-model"}).encode(), CLIENT, 404),
        (b"{not json", CLIENT, 400),
        (json.dumps(OK).encode(), {}, 401),
        (json.dumps(OK).encode(), CLIENT | {"X-Session-Id": "s" * 300}, 400),
        (json.dumps(OK | {"prompt": "x" * (MAX_BODY + 10)}).encode(), CLIENT, 413),
    ]
    for body, headers, status in bad * 5:
        reply = exchange(router.port, post("/v1/completions", body, headers))
        assert reply.status == status, (status, reply.status, reply.body[:200])
    status, _, _ = http("POST", f"{router.base_url}/v1/completions", OK, CLIENT)
    assert status == 200
    met, missed, errors = slo_and_client_errors(router.base_url)
    assert (met - met0, missed - missed0) == (1, 0)
    assert {code: n - errors0.get(code, 0) for code, n in errors.items()} == {"400": 25, "404": 5, "401": 5, "413": 5}


def test_a_session_id_too_long_or_not_printable_ascii_is_a_400_naming_the_header(fleet):
    """Defects 5 and 7: the session table cannot be filled with long keys, and odd bytes are no 500."""
    router = fleet["router"]
    body = json.dumps(OK).encode()
    for value in ("s" * 257, "caf\xe9", "\xff", "\xff" * 300):
        reply = exchange(router.port, post("/v1/completions", body, CLIENT | {"X-Session-Id": value}))
        assert reply.status == 400, (value[:10], reply.status, reply.body[:200])
        err = reply.error()
        assert err["param"] == "x-session-id" and "x-session-id" in err["message"], err
    # a control character is refused by the HTTP parser already: a 400 too
    reply = exchange(router.port, post("/v1/completions", body, CLIENT | {"X-Session-Id": "a\x7fb"}))
    assert reply.status == 400 and reply.error()
    reply = exchange(router.port, post("/v1/completions", body, CLIENT | {"X-Session-Id": "s" * 256}))
    assert reply.status == 200


@pytest.mark.parametrize("where", ["router", "replica"])
def test_a_non_ascii_authorization_header_is_a_401_not_a_500(fleet, where):
    """Defect 7: ``Authorization: Bearer \\xff`` raised UnicodeEncodeError in the key check."""
    port = fleet[where if where == "router" else "backend"].port
    for value in ("Bearer \xff", "\xff\xfe", "Bearer caf\xe9"):
        reply = exchange(port, post("/v1/completions", json.dumps(OK).encode(), {"Authorization": value}))
        assert reply.status == 401, (value, reply.status, reply.body[:200])
        reply.error()


def test_other_non_ascii_headers_pass_harmlessly(fleet):
    reply = exchange(fleet["router"].port, post("/v1/completions", json.dumps(OK).encode(),
                                                CLIENT | {"X-Trace": "a\xffb", "User-Agent": "\xe9t\xe9"}))
    assert reply.status == 200, reply.body[:200]


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_body_is_decoded_at_the_router_as_at_the_replica(fleet, encoding):
    """Defect 8: the router answered 400 to bodies the replica accepts (it sent the decoded body on with the
    client's Content-Encoding)."""
    compress = gzip.compress if encoding == "gzip" else zlib.compress
    body = compress(json.dumps(OK).encode())
    for who, headers in (("router", CLIENT), ("backend", {"Authorization": f"Bearer {ROUTER_KEY}"})):
        reply = exchange(fleet[who].port, post("/v1/completions", body, headers | {"Content-Encoding": encoding}))
        assert reply.status == 200, (who, reply.status, reply.body[:200])
        assert json.loads(reply.body)["usage"]["completion_tokens"] == 2


def test_the_body_limit_is_on_the_decoded_bytes_in_both_places(fleet):
    """A 600 KB gzip bomb that decodes to 32 MB: 413 at the router and at the replica, alike."""
    bomb = gzip.compress(json.dumps(OK | {"prompt": "a" * (32 * 2**20)}).encode())
    assert len(bomb) < MAX_BODY
    for who, headers in (("router", CLIENT), ("backend", {"Authorization": f"Bearer {ROUTER_KEY}"})):
        reply = exchange(fleet[who].port, post("/v1/completions", bomb, headers | {"Content-Encoding": "gzip"}))
        assert reply.status == 413, (who, reply.status, reply.body[:200])
        assert reply.error()["type"] == "request_too_large"


@pytest.mark.parametrize("who", ["router", "backend"])
def test_a_chunked_body_past_the_limit_is_413_as_soon_as_the_limit_is_passed(fleet, who):
    """Defect 8: a chunked body without Content-Length, sent slowly in small chunks, is refused once the limit
    has arrived, not after the body timeout (30 s here)."""
    headers = CLIENT if who == "router" else {"Authorization": f"Bearer {ROUTER_KEY}"}
    head = post("/v1/completions", b"", headers | {"Transfer-Encoding": "chunked"})
    piece = b"%x\r\n%s\r\n" % (4096, b"x" * 4096)
    t0 = time.monotonic()
    with connect(fleet[who].port, timeout=60) as s:
        s.sendall(head)
        sent = 0
        try:
            while sent < 8 * MAX_BODY and not select.select([s], [], [], 0)[0]:   # until an answer is there
                s.sendall(piece * 16)             # 64 KB, then a pause: about 1 MB/s
                sent += 16 * 4096
                time.sleep(0.05)
        except OSError:                           # refused and closed: the answer is waiting
            pass
        reply = read_reply(s)
    took = time.monotonic() - t0
    assert reply.status == 413, (reply.status, reply.body[:200])
    assert sent <= MAX_BODY + 4 * 16 * 4096, f"answered only after {sent} bytes were sent"
    assert took < 10, f"the 413 came after {took:.1f} s"
