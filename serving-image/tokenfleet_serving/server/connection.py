"""The HTTP connection layer under the server and the router: read timeouts and OpenAI-shaped errors
for what aiohttp answers before any handler runs.

aiohttp parses the request line and headers itself and, on a malformed
request, answers with a plain-text 400 of its own. Here:

- every such answer is an OpenAI error body with the fitting status: a request
  line over ``MAX_LINE_BYTES`` is 414, a header over ``MAX_FIELD_BYTES`` or more
  than ``MAX_HEADERS`` headers is 431, anything else malformed (a bad method, a
  bad ``Content-Length``, bad chunked framing) is 400; a handler that fails
  outside the application's middleware gets a 500 body;
- a client that connects, or starts a request on an idle connection, but does
  not finish the request line and headers within ``header_timeout_s`` gets a
  408 and the connection is closed (the body has its own timeout, applied by
  the application where it reads it); an idle keep-alive connection is closed
  after ``KEEPALIVE_TIMEOUT_S`` (aiohttp's own default is an hour).

The deadline is armed when a connection opens and when bytes arrive on an
idle connection (aiohttp's idle waiter, ``RequestHandler._waiter``, is pending
exactly while it waits for the next request's head), and it is cancelled when
aiohttp has parsed a complete head (``RequestHandler._request_count`` grows).
Tests pin this behaviour against the installed aiohttp
(``tests/e2e/server/test_connection_limits.py``).
"""
from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from tokenfleet_serving.openai.errors import ApiError, error_body

log = logging.getLogger("tokenfleet.http")

MAX_LINE_BYTES = 8190          # request line (method, path, version)
MAX_FIELD_BYTES = 8192         # one header, name and value
MAX_HEADERS = 128
KEEPALIVE_TIMEOUT_S = 75.0     # longer than aiohttp's client pool keeps idle connections (15 s)
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0


def classify(status: int, exc: BaseException | None, message: str | None) -> tuple[int, str]:
    """The status and message to send for an error aiohttp raised while parsing or handling a request."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else None
        if str(limit) == str(MAX_LINE_BYTES):
            return 414, f"request line exceeds {MAX_LINE_BYTES} bytes"
        return 431, f"a request header exceeds {MAX_FIELD_BYTES} bytes"
    if isinstance(exc, BadHttpMessage):
        text = exc.message if isinstance(exc.message, str) else str(exc)
        if "Too many headers" in text:
            return 431, f"more than {MAX_HEADERS} request headers"
        return 400, f"malformed HTTP request: {text.splitlines()[0] if text else type(exc).__name__}"
    if status >= 500:
        return status, HTTPStatus(status).phrase.lower() if status in HTTPStatus._value2member_map_ else "server error"
    return status, message or HTTPStatus(status).phrase


def raw_error_response(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection, for writing straight to a transport."""
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


async def read_body(request: web.BaseRequest, *, max_bytes: int, timeout_s: float) -> bytes:
    """The whole request body, decoded (``Content-Encoding`` gzip, deflate: aiohttp decodes as it parses), or an
    ApiError: 413 as soon as more than ``max_bytes`` have arrived (declared by ``Content-Length``, or counted
    as a chunked or compressed body arrives: the limit is on the decoded bytes), 408 when it has not arrived
    within ``timeout_s``, 400 when it cannot be decoded (a bad ``Content-Encoding``, broken chunked framing).

    The body is read here rather than with ``request.read()``, which keeps a second copy on the request for as
    long as the request lives (a router holding requests for a replica would hold each body twice)."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise ApiError(413, f"request body exceeds {max_bytes} bytes")
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_bounded(request, max_bytes)
    except TimeoutError:
        raise ApiError(408, f"request body not received within {timeout_s:g} s", close_connection=True) from None
    except web.RequestPayloadError as exc:
        raise ApiError(400, f"request body cannot be read: {exc}", close_connection=True) from None


async def _read_bounded(request: web.BaseRequest, max_bytes: int) -> bytes:
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > max_bytes:
            raise ApiError(413, f"request body exceeds {max_bytes} bytes")
    return bytes(body)


async def send_and_close(request: web.BaseRequest, response: web.StreamResponse) -> web.StreamResponse:
    """Send ``response`` now and close the connection without reading the rest of the body (aiohttp
    would otherwise linger up to 10 s draining it): for a client whose body stopped arriving."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.protocol is not None:
        request.protocol.force_close()
    return response


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection handler, with a header read timeout and OpenAI-shaped low-level errors."""

    def __init__(self, *args: Any, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.header_deadline: asyncio.TimerHandle | None = None

    def _awaiting_head(self) -> bool:
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def _arm(self) -> None:
        self.header_deadline = self._loop.call_later(self.header_timeout_s, self._header_timed_out)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()                       # the first request's head is due within the timeout of connecting

    def data_received(self, data: bytes) -> None:
        starts_head = bool(data) and self._awaiting_head()
        heads_before = self._request_count
        super().data_received(data)
        if self._request_count > heads_before:     # a head is complete: its request is under way
            if self.header_deadline is not None:
                self.header_deadline.cancel()
                self.header_deadline = None
        elif starts_head and self.header_deadline is None:
            self._arm()                   # a new request's first bytes on an idle connection

    def _header_timed_out(self) -> None:
        self.header_deadline = None
        if self.transport is not None and not self._force_close:
            log.info("closing a connection whose request head did not arrive within %g s", self.header_timeout_s)
            self.transport.write(raw_error_response(
                408, f"request line and headers not received within {self.header_timeout_s:g} s"))
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None
        super().connection_lost(exc)

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        """aiohttp reads away the unread rest of a body after the response (its lingering close); a body
        that cannot be decoded (a false ``Content-Encoding``, broken chunked framing) fails that read, and
        aiohttp logs it as an unhandled exception although the client has its answer and the connection is
        closed next. That case is a client's fault: one info line. Everything else is logged as aiohttp does."""
        exc = kwargs.get("exc_info")
        if isinstance(exc, web.RequestPayloadError):
            log.info("closing a connection whose unread request body cannot be decoded: %s",
                     str(exc).replace("\n", " ").strip())
            return
        super().log_exception(*args, **kwargs)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        status, text = classify(status, exc, message)
        if isinstance(exc, ConnectionError):       # the client went away mid-request: nobody to answer
            log.debug("client disconnected during %s %s", getattr(request, "method", "?"), getattr(request, "path", "?"))
        elif status >= 500:
            self.log_exception("error handling %s %s", getattr(request, "method", "?"),
                               getattr(request, "path", "?"), exc_info=exc)
        else:
            log.debug("refused a malformed request (%d): %s", status, text)
        if request.writer.output_size > 0:   # a response has started: nothing more can be said
            raise ConnectionError("response already started; cannot send an error response")
        resp = web.json_response(error_body(status, text), status=status)
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    """``web.Server`` that builds :class:`GuardedRequestHandler` connections."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, header_timeout_s=self.header_timeout_s, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections have the header timeout, the size limits above and
    OpenAI-shaped low-level errors."""

    def __init__(self, app: web.Application, *, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, **kwargs: Any):
        kwargs.setdefault("max_line_size", MAX_LINE_BYTES)
        kwargs.setdefault("max_field_size", MAX_FIELD_BYTES)
        kwargs.setdefault("max_headers", MAX_HEADERS)
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_TIMEOUT_S)
        super().__init__(app, **kwargs)
        self.header_timeout_s = header_timeout_s

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()       # runs the application's startup and freezes it
        return GuardedServer(base.request_handler, request_factory=base.request_factory,
                             handler_cancellation=base.handler_cancellation, loop=asyncio.get_running_loop(),
                             header_timeout_s=self.header_timeout_s,
                             **{k: v for k, v in self._kwargs.items() if k != "handler_cancellation"})
