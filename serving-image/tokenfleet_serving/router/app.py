"""The router's HTTP side: an OpenAI-compatible reverse proxy.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are routed one by
one (``policy.choose``) and relayed byte for byte, so Server-Sent Events
stream through as the backend writes them. ``GET /v1/models`` merges the
lists of one backend per tier. A backend that cannot be reached, or answers
503 (draining, loading), is skipped and the request goes to the next choice,
at most ``MAX_ATTEMPTS`` backends in all; with none left the client gets 503
with ``Retry-After`` and an OpenAI error body.

Every response carries ``x-tokenfleet-backend`` (the pod that served it) and
``x-tokenfleet-route-reason``.

Trust: with client keys (``auth.py``) every ``/v1/*`` request must carry one,
else 401. The client's ``Authorization`` header never reaches a backend: the
router sends its own backend key instead (the replicas' ``--api-key``), which
clients never see. Every error the router itself answers is an OpenAI error
body, down to what aiohttp refuses before a handler runs (``server/connection.py``).

Limits (docs/routing.md, "Limits"): a held request counts its body's bytes against ``--max-held-bytes``
(503 with ``Retry-After`` past it); a session id longer than ``MAX_SESSION_KEY_CHARS`` or with bytes that
are not printable ASCII is a 400 naming the header; a backend that sends nothing and answers no poll for
``--stall-timeout`` seconds (a frozen process) is given up: a request waiting for its answer goes to another
backend, a stream it was relaying is continued elsewhere (``migration.py``).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenfleet_serving.contract.router_files import ConfigError, RouterConfig, ScaleFromZero, load_endpoints
from tokenfleet_serving.engine.tokenizer import Tokenizer
from tokenfleet_serving.openai.errors import ApiError, error_body
from tokenfleet_serving.openai.protocol import parse_json_body
from tokenfleet_serving.openai.sse import DONE_EVENT, SseEvents, error_event, event_json, is_done, sse_event
from tokenfleet_serving.router.auth import ClientKeys
from tokenfleet_serving.router.backend_runtime import RUNTIME, TOKENFLEET, VLLM
from tokenfleet_serving.router.drain import OpenRequests
from tokenfleet_serving.router.kv_events import Subscriptions
from tokenfleet_serving.router.metrics import RouterMetrics
from tokenfleet_serving.router.migration import (
    BACKEND_ERROR,
    DISCONNECTED,
    MIGRATION_WAIT_S,
    NO_BACKEND,
    STALLED,
    TARGET_ERROR,
    StreamState,
    failure_message,
    incomplete_tail,
    migratable_error,
    vllm_continuation,
    vllm_unmigratable,
)
from tokenfleet_serving.router.observe import (
    Timing,
    ask_for_usage,
    carries_output,
    completion_tokens,
    is_client_error,
    is_usage_only,
    meets_slo,
)
from tokenfleet_serving.router.policy import SESSION, PolicyParams, RouteRequest, choose, choose_tier
from tokenfleet_serving.router.prefix import block_hashes
from tokenfleet_serving.router.prompt import prompt_info
from tokenfleet_serving.router.route_mode import DETAIL_HEADER, REASON_HEADER, TARGET_HEADER, RouteMode
from tokenfleet_serving.router.state import MAX_SESSION_KEY_CHARS, MAX_SESSIONS, BackendState, Fleet, poll_forever
from tokenfleet_serving.server.connection import DEFAULT_BODY_TIMEOUT_S, read_body, send_and_close

log = logging.getLogger("tokenfleet.router")

MAX_ATTEMPTS = 3
TARGETS_FILE = "targets.json"   # route mode: the targets' status, next to endpoints.json (route_files.py)
MAX_HELD_REQUESTS = 1024        # requests held at once while no replica is ready (noReplicaHoldSeconds)
MAX_HELD_BYTES = 64 * 2**20     # their bodies' bytes, together (--max-held-bytes)
STALL_TIMEOUT_S = 15.0          # a backend silent this long, polls included, is frozen (--stall-timeout)
MAX_OBSERVED_BODY = 16 * 2**20      # a non-streamed response is parsed for its usage up to this size
RETRY_AFTER_S = "1"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Request headers not passed on: hop-by-hop ones, and the client's credentials (the router sends its own).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding",
                        "authorization", "cookie",
                        "content-encoding"})     # the router sends the body decoded (read_body decodes it)
RELAYED_RESPONSE_HEADERS = ("Content-Type", "Content-Length", "Content-Encoding", "Retry-After", "Cache-Control",
                            "X-Request-Id")


def arrived_before_the_break(content: aiohttp.StreamReader) -> bytes:
    """The bytes a response had delivered when its connection broke, not yet read. aiohttp's readers raise the
    connection's error before they return them (``StreamReader.readany``); they were sent, though, and a
    stream continued elsewhere must continue after them."""
    error = content.exception()
    content._exception = None       # for this one read: aiohttp has no public way to it
    try:
        return content.read_nowait()
    except (RuntimeError, aiohttp.ClientError):
        return b""
    finally:
        content._exception = error


class BackendStalledError(Exception):
    """The backend sent nothing and answered no poll for the stall timeout."""


@dataclass
class _Request:
    """One request as the router holds it: the body once, as the bytes sent to a backend (``body``, the parsed
    JSON, is dropped once the route is chosen), and what it takes to send it again: to the next backend, or as a
    stream's continuation."""

    path: str
    raw: bytes
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    hashes: tuple[str, ...] = ()
    tier: str = ""
    session_key: str | None = None
    sequence: int = 0
    fallback: bool = False
    adapter: str | None = None          # the LoRA adapter the request names (policy.py)
    prompt_ids: list[int] | None = None  # the prompt as this router tokenized it (a vLLM stream's continuation
                                         # uses it when the replica did not report the prompt's ids)
    route_target: str | None = None     # route mode: the target chosen (route_mode.py)
    route_reason: str = ""              # route mode: why (a label)
    route_detail: str = ""              # ... in words
    tried: dict[str, str] = field(default_factory=dict)   # backends that failed it: pod name -> its IP then

    def excluded(self, fleet: Fleet) -> set[str]:
        """The failed backends still at the address they failed at (a replacement pod of the same name, at
        a new address, may take the request)."""
        return {name for name, ip in self.tried.items()
                if (b := fleet.backends.get(name)) is not None and b.endpoint.ip == ip}

    def fail(self, backend: BackendState) -> None:
        self.tried[backend.name] = backend.endpoint.ip


def error_response(status: int, message: str, *, retry_after: bool = False, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    headers = dict(headers or {})
    if retry_after:
        headers["Retry-After"] = RETRY_AFTER_S
    return web.json_response(error_body(status, message, param), status=status, headers=headers)


class Router:
    def __init__(self, config: RouterConfig, endpoints_path: str | Path, tokenizer: Tokenizer | None, *,
                 poll_interval_s: float = 0.5, endpoints_interval_s: float = 1.0,
                 backend_api_key: str | None = None, max_body_bytes: int = 4 * 2**20 + 4096,
                 client_keys: ClientKeys | None = None, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 max_held_bytes: int = MAX_HELD_BYTES, stall_timeout_s: float = STALL_TIMEOUT_S,
                 max_sessions: int = MAX_SESSIONS, backend_runtime: str = TOKENFLEET,
                 target_tokenizers: dict[str, Tokenizer | None] | None = None):
        self.config = config
        self.runtime = RUNTIME[backend_runtime]
        self.client_keys = client_keys
        self.body_timeout_s = body_timeout_s
        self.endpoints_path = Path(endpoints_path)
        self.endpoints_interval_s = endpoints_interval_s
        self.tokenizer = tokenizer
        self.backend_api_key = backend_api_key
        self.params = PolicyParams(config.policy, config.load_factor, config.kv_usage_threshold, config.load_slack)
        self.fleet = Fleet(config, interval_s=poll_interval_s, max_sessions=max_sessions, runtime=self.runtime)
        self.metrics = RouterMetrics(self.fleet, tokenizer is not None)
        # route mode (a TokenRoute's router): its targets are other services' routers
        self.route = None if config.route is None else RouteMode(
            config.route, config.models[0] if config.models else None,
            {t.name: (target_tokenizers or {}).get(t.name) for t in config.route.targets},
            self.endpoints_path.with_name(TARGETS_FILE), self.metrics.registry)
        self.pending = 0                      # requests held while no replica is ready (scale from zero)
        self.held_bytes = 0                   # their bodies' bytes
        self.max_held_bytes = max_held_bytes
        self.stall_timeout_s = stall_timeout_s
        self.metrics.held_bytes = lambda: self.held_bytes
        self.last_request_at = self.fleet.clock()
        self.metrics.pending = lambda: self.pending
        self.metrics.idle_s = lambda: self.fleet.clock() - self.last_request_at
        self.sequence = itertools.count()
        self.draining = False
        self.open_requests = OpenRequests(lambda: self.draining)     # what a drain waits for (drain.py)
        self._endpoints_text: bytes | None = None
        self._endpoints_problem: str | None = None
        self._tasks: list[asyncio.Task] = []
        self.kv_events: Subscriptions | None = None   # one per replica, with prefixSource kvEvents
        self.session: aiohttp.ClientSession | None = None
        self.max_body_bytes = max_body_bytes
        self.app = self._build_app(max_body_bytes)

    def _build_app(self, max_body_bytes: int) -> web.Application:
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self.open_requests.track, self._errors, self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_handler)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    # ---- lifecycle -----------------------------------------------------------------------------
    async def _start(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
            connector=aiohttp.TCPConnector(limit=0),
        )
        if self.fleet.uses_kv_events:
            self.kv_events = Subscriptions(self.config.kv_events_port,
                                           replay_port=self.config.kv_events_replay_port)
        self.reload_endpoints()
        if self.route is not None:
            self.route.reload_targets()
        self._tasks = [asyncio.ensure_future(self._watch_endpoints()),
                       asyncio.ensure_future(poll_forever(self.session, self.fleet, self.backend_api_key))]

    async def _stop(self, _app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.kv_events is not None:
            await self.kv_events.close()
        if self.session is not None:
            await self.session.close()

    def reload_endpoints(self) -> None:
        """Re-read endpoints.json if its bytes changed; a bad file keeps the last good list."""
        try:
            text = self.endpoints_path.read_bytes()
        except OSError as exc:
            self._problem(f"{self.endpoints_path}: cannot read ({exc.strerror or exc})")
            return
        if text == self._endpoints_text:
            return
        try:
            endpoints = load_endpoints(self.endpoints_path)
        except ConfigError as exc:
            self._problem(str(exc))
            return
        self._endpoints_text = text
        self._endpoints_problem = None
        self.fleet.set_endpoints(endpoints)
        if self.kv_events is not None:
            self.kv_events.sync((b.name, b.endpoint.ip, b.events) for b in self.fleet.backends.values()
                                if b.events is not None)
        log.info("endpoints: %s", ", ".join(f"{e.pod}={e.ip}:{e.port}{'' if e.ready else ' (not ready)'}"
                                            for e in endpoints) or "none")

    def _problem(self, message: str) -> None:
        if message != self._endpoints_problem:
            log.error("%s (keeping the last good endpoint list)", message)
        self._endpoints_problem = message

    async def _watch_endpoints(self) -> None:
        while True:
            await asyncio.sleep(self.endpoints_interval_s)
            self.reload_endpoints()
            if self.route is not None:
                self.route.reload_targets()
            if self.client_keys is not None:
                self.client_keys.reload()

    # ---- middleware and probes -----------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            response = await handler(request)
        except ApiError as exc:
            response = error_response(exc.status, exc.message, param=exc.param, headers=exc.headers)
            if exc.close_connection:     # the body stopped arriving or cannot be decoded: answer, close at once
                response = await send_and_close(request, response)
            elif exc.status == 413:
                response.force_close()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = {404: f"no route {request.method} {request.path}", 405: f"method {request.method} not allowed "
                       f"on {request.path}", 413: f"request body exceeds {self.max_body_bytes} bytes"}
            response = web.json_response(error_body(exc.status, message.get(exc.status, exc.reason)),
                                         status=exc.status)
            if exc.status == 413:
                response.force_close()
        except (asyncio.CancelledError, ConnectionResetError):   # cancelled, or the client went away
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            response = error_response(500, "the router failed; see its log")
        if request.path.startswith("/v1/"):
            self.metrics.responses.labels(code=str(response.status)).inc()
            if request.path in GENERATION_PATHS and is_client_error(response.status):
                self.metrics.client_errors.labels(code=str(response.status)).inc()
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.client_keys is not None and request.path.startswith("/v1/"):
            if not self.client_keys.allows(request.headers.get("Authorization")):   # any bytes: 401, never 500
                raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                               headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        routable = self.fleet.routable()
        if self.route is not None:      # a route is ready with a target to send to, not with a classifier alone
            routable = [b for b in routable if b.endpoint.tier in self.route.by_name]
        if self.draining:
            reason = "draining"
        elif not self.fleet.endpoints_loaded:
            reason = self._endpoints_problem or f"{self.endpoints_path} not read yet"
        elif not routable and self._hold_limits() is None:
            reason = f"no ready backend among {len(self.fleet.backends)} listed"
        else:       # a router that may hold requests takes them while no replica is ready
            return web.json_response({"ready": True, "backends": len(routable)})
        return web.json_response({"ready": False, "reason": reason}, status=503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- proxying ----------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion", "/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", "/v1/chat/completions")

    def _no_backend(self, tier: str) -> web.Response:
        self.metrics.requests.labels(backend="none", reason="no-backend", tier=tier).inc()
        return error_response(503, "no ready backend for this service; retry shortly", retry_after=True)

    def _backend_headers(self, request: web.Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if self.route is not None and not self.backend_api_key and "Authorization" in request.headers:
            # a route's targets are routers that check the client's own key
            headers["Authorization"] = request.headers["Authorization"]
        if self.backend_api_key:
            headers["Authorization"] = f"Bearer {self.backend_api_key}"
        if self.route is not None:      # no override header on, one hop more (route_mode.py)
            self.route.forward_headers(headers, request.headers)
        return headers

    def _hold_limits(self) -> ScaleFromZero | None:
        """How many requests may wait for a replica, and how long: scale from zero's limits, else
        ``noReplicaHoldSeconds`` (every replica failed or restarting at once); None: answer 503 at once."""
        if self.config.scale_from_zero is not None:
            return self.config.scale_from_zero
        if self.config.no_replica_hold_s > 0:
            return ScaleFromZero(MAX_HELD_REQUESTS, self.config.no_replica_hold_s)
        return None

    async def _hold(self, ctx: _Request) -> bool:
        """No replica is ready (or none took the request): wait, bounded in count, bytes and time, until one is.
        The request waits with its body once, as bytes (``ctx.raw``)."""
        hold = self._hold_limits()
        size = len(ctx.raw)
        if hold is None or not self._may_hold(size):
            return False
        self.pending += 1
        self.held_bytes += size
        try:
            deadline = self.fleet.clock() + hold.timeout_s
            while self.fleet.clock() < deadline:
                excluded = ctx.excluded(self.fleet)
                if any(b.name not in excluded for b in self.fleet.routable()):
                    return True
                await asyncio.sleep(0.1)
            return False
        finally:
            self.pending -= 1
            self.held_bytes -= size

    def _may_hold(self, size: int) -> bool:
        """Whether one more request of ``size`` body bytes may be held (counted when not: 503)."""
        hold = self._hold_limits()
        if hold is None or not self.fleet.endpoints_loaded:
            return False
        if self.pending >= hold.max_pending:
            self.metrics.hold_refusals.labels(reason="count").inc()
            return False
        if self.held_bytes + size > self.max_held_bytes:
            self.metrics.hold_refusals.labels(reason="bytes").inc()
            return False
        return True

    async def _generate(self, request: web.Request, kind: str, path: str) -> web.StreamResponse:
        session = self._session_id(request)
        reserved = 0
        if not self.fleet.routable():
            # it will be held: a declared body's bytes count from now on, so that no more bodies are read at
            # once than may be held; one that could not be held is answered before its body is read (a miss:
            # the fleet has no room for it)
            if not self._may_hold(request.content_length or 0):
                timing = Timing(self.fleet.clock(), stream=False)
                timing.finished = timing.arrived
                self.metrics.observe(timing, False, False)
                return self._no_backend(self.config.tiers[-1].name)
            reserved = request.content_length or 0
        self.held_bytes += reserved
        try:
            raw = await read_body(request, max_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s)
        finally:
            self.held_bytes -= reserved
        # what the server would refuse as a body, the router refuses alike
        ctx = _Request(path, raw, parse_json_body(raw), session_key=session)
        del raw
        timing = Timing(self.fleet.clock(), stream=isinstance(ctx.body, dict) and ctx.body.get("stream") is True)
        self.last_request_at = timing.arrived
        try:
            if not self.fleet.routable():
                if not self._may_hold(len(ctx.raw)):
                    return self._no_backend(self.config.tiers[-1].name)
                ctx.body = None          # while it waits, the body is held once, as bytes
                timing.held = await self._hold(ctx)
                ctx.body = parse_json_body(ctx.raw)
            return await self._route(request, kind, ctx, timing)
        except ApiError as exc:
            timing.client_error = is_client_error(exc.status)
            raise
        finally:
            timing.finished = timing.finished or self.fleet.clock()
            if not timing.client_error:      # a request refused as the client's fault is no service miss
                self.metrics.observe(timing, meets_slo(self.config.slo, timing), timing.held)

    def _session_id(self, request: web.Request) -> str | None:
        """The session id (``sessionAffinity.header``) when affinity is on; a 400 naming the header when it is
        longer than MAX_SESSION_KEY_CHARS or has bytes other than printable ASCII (space to tilde)."""
        affinity = self.config.session_affinity
        if not affinity.enabled:
            return None
        value = request.headers.get(affinity.header)
        if value is None:
            return None
        if not value or len(value) > MAX_SESSION_KEY_CHARS or not all(" " <= c <= "~" for c in value):
            raise ApiError(400, f"the {affinity.header} header must be 1 to {MAX_SESSION_KEY_CHARS} printable ASCII "
                                f"characters (got {len(value.encode('utf-8', 'surrogateescape'))} bytes"
                                f"{'' if value.isascii() else ', not all ASCII'})", affinity.header)
        return value

    async def _route(self, request: web.Request, kind: str, ctx: _Request, timing: Timing) -> web.StreamResponse:
        client_wants_usage = True
        stream: StreamState | None = None
        body = ctx.body
        if isinstance(body, dict) and "continuation" in body:
            raise ApiError(400, "'continuation' is set by the router only (stream migration); send the request "
                                "without it", "continuation")
        changed = False
        if timing.stream and isinstance(body, dict):
            client_wants_usage = ask_for_usage(body)
            # token ids let the router continue the stream elsewhere if its backend fails (migration.py)
            stream = StreamState(client_wants_token_ids=body.get("return_token_ids") is True)
            if body.get("n") not in (None, 1):       # n choices: one continuation cannot carry them all
                stream.unmigratable = "the request streams several choices (n > 1)"
            if self.runtime.name == VLLM:
                stream.unmigratable = stream.unmigratable or vllm_unmigratable(body)
            body["return_token_ids"] = True
            changed = True
        if self.route is not None:
            routed = await self.route.decide(kind, body, self.route.checked_override(request.headers),
                                             self.fleet, self.session, self._backend_headers(request))
            if routed is None:
                return self._no_backend(self.route.names[-1])
            ctx.tier = ctx.route_target = routed.decision.target
            ctx.route_reason, ctx.route_detail = routed.decision.reason, routed.decision.detail
            log.debug("route: %s (%s: %s)", ctx.tier, routed.decision.reason, routed.decision.detail)
            if routed.info.token_ids:
                ctx.hashes = block_hashes(routed.info.token_ids, routed.kv_block_size)
            if routed.model and isinstance(body, dict) and body.get("model") != routed.model:
                body["model"] = routed.model
                changed = True
            tier_model = None
        else:
            if self.tokenizer is not None and isinstance(body, dict):
                info = await asyncio.to_thread(prompt_info, kind, body, self.tokenizer)
            else:
                info = prompt_info(kind, body, None)
            model = body.get("model") if isinstance(body, dict) else None
            ctx.adapter = model if isinstance(model, str) and self.fleet.serves_adapter(model) else None
            ctx.hashes = (block_hashes(info.token_ids, self.config.kv_block_size, adapter=ctx.adapter,
                                       root=self.fleet.adapter_root(ctx.adapter)) if info.token_ids else ())
            if stream is not None and self.runtime.name == VLLM and info.token_ids:
                ctx.prompt_ids = list(info.token_ids)
            tiers = self.config.tiers
            picked = choose_tier(tiers, info.num_tokens, info.max_tokens, self.fleet.tiers_available())
            del info
            if picked is None:
                return self._no_backend(tiers[-1].name)
            tier, ctx.fallback = picked
            ctx.tier = tier.name
            tier_model = tier.model
        if tier_model and isinstance(body, dict) and body.get("model") != tier_model:
            body["model"] = tier_model
            changed = True
        if changed:
            ctx.raw = json.dumps(body).encode()
        ctx.body = body = None           # from here on the body is held once, as the bytes sent
        ctx.headers = self._backend_headers(request)
        ctx.sequence = next(self.sequence)
        opened = await self._open(ctx)
        if opened is None and await self._hold(ctx):     # none took it: wait for one to be back
            timing.held = True
            opened = await self._open(ctx)
        if opened is None:
            return self._no_backend(ctx.tier)
        backend, reason, upstream, matched = opened
        if ctx.hashes:
            self.metrics.prefix_query_blocks.inc(len(ctx.hashes))
            self.metrics.prefix_hit_blocks.inc(matched)
        try:
            return await self._relay(request, upstream, backend.name, reason, timing, client_wants_usage,
                                     stream, ctx)
        finally:
            self._close(upstream, backend)

    async def _open(self, ctx: _Request, raw: bytes | None = None, path: str | None = None
                    ) -> tuple[BackendState, str, aiohttp.ClientResponse, int] | None:
        """Send the request (``raw``, else ``ctx.raw``) to the best backend that takes it (at most MAX_ATTEMPTS
        tries: a backend that refuses the connection, answers 503 or stalls before it answers is marked failed
        and skipped). Returns (backend, route reason, response, matched blocks) with the backend's inflight count
        taken, or None."""
        data = ctx.raw if raw is None else raw
        for _ in range(MAX_ATTEMPTS):
            now = self.fleet.clock()
            pinned = self.fleet.sessions.pinned(ctx.session_key, now) if ctx.session_key else None
            decision = choose(RouteRequest(ctx.hashes, ctx.session_key, pinned, ctx.sequence, ctx.adapter),
                              self.fleet.views(ctx.tier, ctx.excluded(self.fleet)), self.params)
            if decision is None:
                return None
            backend = self.fleet.backends[decision.backend]
            reason = "tier-fallback" if ctx.fallback else decision.reason
            self.metrics.requests.labels(backend=decision.backend, reason=reason, tier=ctx.tier).inc()
            if ctx.session_key and (decision.reason == SESSION or pinned is None):
                self.fleet.sessions.pin(ctx.session_key, decision.backend, now)
            self.fleet.note_routed(decision.backend, ctx.hashes)
            backend.inflight += 1
            try:
                upstream = await self._unless_stalled(
                    decision.backend, self.session.post(backend.endpoint.url + (path or ctx.path), data=data, headers=ctx.headers))
            except (TimeoutError, aiohttp.ClientConnectionError, BackendStalledError) as exc:
                backend.inflight -= 1
                self.fleet.mark_failed(decision.backend, f"request failed: {type(exc).__name__}: {exc}")
                self.metrics.retries.labels(backend=decision.backend).inc()
                ctx.fail(backend)
                continue
            if upstream.status == 503:  # draining or still loading: another backend can take it
                await upstream.read()
                upstream.release()
                backend.inflight -= 1
                self.fleet.mark_failed(decision.backend, "answered 503")
                self.metrics.retries.labels(backend=decision.backend).inc()
                ctx.fail(backend)
                continue
            return backend, reason, upstream, decision.matched_blocks
        return None

    @property
    def _stall_check_s(self) -> float:
        return min(1.0, self.stall_timeout_s / 4)

    async def _unless_stalled(self, backend: str, awaitable: Any) -> Any:
        """The result of ``awaitable`` (an answer from ``backend``), unless the backend stalls first: nothing
        from it, answers and polls alike, for the stall timeout (``Fleet.stalled``); then BackendStalledError."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self._stall_check_s)
                if done:
                    return task.result()
                if self.fleet.stalled(backend, self.stall_timeout_s):
                    raise BackendStalledError(f"sent nothing and answered no poll for {self.stall_timeout_s:g} s")
        finally:
            if not task.done():
                task.cancel()

    def _watch_for_stall(self, upstream: aiohttp.ClientResponse, backend: str) -> asyncio.Task:
        """A task that closes ``upstream`` once its backend stalls (then its result is True), so a relay that
        waits for the next bytes of a frozen backend ends."""
        async def watch() -> bool:
            while not self.fleet.stalled(backend, self.stall_timeout_s):
                await asyncio.sleep(self._stall_check_s)
            log.warning("backend %s sent nothing and answered no poll for %g s: giving up its response",
                        backend, self.stall_timeout_s)
            self.fleet.mark_failed(backend, f"stalled: nothing for {self.stall_timeout_s:g} s")
            upstream.close()
            return True

        return asyncio.ensure_future(watch())

    @staticmethod
    def _stalled(watchdog: asyncio.Task) -> bool:
        watchdog.cancel()
        return watchdog.done() and not watchdog.cancelled() and watchdog.result() is True

    @staticmethod
    def _close(upstream: aiohttp.ClientResponse, backend: BackendState) -> None:
        if upstream.content.at_eof():
            upstream.release()  # keep the connection for the next request
        else:
            upstream.close()    # the client went away (or the stream moved): closing aborts it there
        backend.inflight -= 1

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, backend: str,
                     reason: str, timing: Timing, client_wants_usage: bool = True,
                     stream: StreamState | None = None, ctx: _Request | None = None) -> web.StreamResponse:
        """Relay the backend's response as it comes, noting the first token and the output tokens (``timing``).
        A stream is relayed event by event; the usage event the router asked for is dropped again when the
        client did not ask for it. A stream its backend breaks off continues on another backend
        (``_migrate``), into the same client response."""
        response = web.StreamResponse(status=upstream.status)
        for name in RELAYED_RESPONSE_HEADERS:
            if name in upstream.headers:
                response.headers[name] = upstream.headers[name]
        response.headers["x-tokenfleet-backend"] = backend
        response.headers["x-tokenfleet-route-reason"] = reason
        if ctx is not None and ctx.route_target is not None:
            response.headers[TARGET_HEADER] = ctx.route_target
            response.headers[REASON_HEADER] = ctx.route_reason
            response.headers[DETAIL_HEADER] = ctx.route_detail.encode("ascii", "replace").decode()[:512]
        await response.prepare(request)
        self.fleet.note_alive(backend)
        sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        if not sse:
            return await self._relay_body(response, upstream, backend, timing)
        state = stream or StreamState(client_wants_token_ids=True)
        try:
            broken = await self._pump(response, upstream, backend, timing, client_wants_usage, state)
            if broken is not None:
                if stream is None or ctx is None:
                    state.errored = state.done = True
                    await response.write(error_event(502, f"the backend {backend} failed mid-stream") + DONE_EVENT)
                else:
                    if backend in self.fleet.backends:
                        ctx.fail(self.fleet.backends[backend])
                    await self._migrate(response, ctx, state, timing, client_wants_usage, backend, broken)
        finally:
            # Also when the handler is cancelled: a client that hangs up once it has [DONE] (the openai client
            # does) cancels it while the backend has yet to end its response, and that request was served.
            timing.finished = self.fleet.clock()
            timing.ok = upstream.status == 200 and state.done and not state.errored
            timing.client_error = is_client_error(upstream.status)
        await response.write_eof()
        return response

    async def _relay_body(self, response: web.StreamResponse, upstream: aiohttp.ClientResponse, backend: str,
                          timing: Timing) -> web.StreamResponse:
        body = bytearray()
        watchdog = self._watch_for_stall(upstream, backend)
        try:
            async for chunk in upstream.content.iter_any():
                self.fleet.note_alive(backend)
                if len(body) < MAX_OBSERVED_BODY:
                    body += chunk
                await response.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            if not self._stalled(watchdog):
                log.warning("backend %s broke off a response: %s", backend, exc)
                self.fleet.mark_failed(backend, f"response broken off: {exc}")
            return response
        finally:
            watchdog.cancel()
        if self._stalled(watchdog):
            return response
        timing.finished = self.fleet.clock()
        timing.ok = upstream.status == 200
        timing.client_error = is_client_error(upstream.status)
        if timing.ok:
            try:
                timing.output_tokens = completion_tokens(json.loads(bytes(body))) or 0
            except ValueError:
                pass
        await response.write_eof()
        return response

    async def _pump(self, response: web.StreamResponse, upstream: aiohttp.ClientResponse, backend: str,
                    timing: Timing, client_wants_usage: bool, state: StreamState) -> str | None:
        """Relay one backend's events to the client until ``[DONE]``. Returns None when the stream ended (with
        ``[DONE]``), or why it broke off: the backend's connection failed before ``[DONE]``, or it sent an
        error event that means it is going away (the event is not relayed: the stream continues elsewhere)."""
        events = SseEvents()
        watchdog = self._watch_for_stall(upstream, backend)
        try:
            async for chunk in upstream.content.iter_any():
                self.fleet.note_alive(backend)
                broken = await self._relay_events(events.feed(chunk), response, backend, timing, client_wants_usage,
                                                  state)
                if broken is not None:
                    return broken
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            if self._stalled(watchdog):
                return f"{STALLED}: nothing from it, polls included, for {self.stall_timeout_s:g} s"
            # what arrived before the break was sent: relay it, so the stream continues after it
            broken = await self._relay_events(events.feed(arrived_before_the_break(upstream.content)), response,
                                              backend, timing, client_wants_usage, state)
            if broken is not None or state.done:
                return broken
            log.warning("backend %s broke off a stream: %s", backend, exc)
            self.fleet.mark_failed(backend, f"response broken off: {exc}")
            return f"{DISCONNECTED}: {type(exc).__name__}"
        finally:
            watchdog.cancel()
        if self._stalled(watchdog):
            return f"{STALLED}: nothing from it, polls included, for {self.stall_timeout_s:g} s"
        if not state.done:
            self.fleet.mark_failed(backend, "closed a stream before its end")
            return f"{DISCONNECTED}: closed before [DONE]"
        return None

    async def _relay_events(self, events: list[bytes], response: web.StreamResponse, backend: str, timing: Timing,
                            client_wants_usage: bool, state: StreamState) -> str | None:
        """Relay whole events of one backend's stream; returns why the stream broke off when one of them is an
        error event that means the backend is going away (that event is not relayed), else None."""
        out = []
        for event in events:
            if is_done(event):
                state.done = True
                out.append(event)
                continue
            obj = event_json(event)
            if obj is None:
                out.append(event)
                continue
            code = migratable_error(obj)
            if code is not None:
                if out:
                    await response.write(b"".join(out))
                self.fleet.mark_failed(backend, f"ended a stream with error {code}")
                return f"{BACKEND_ERROR}: {code} {str(obj['error'].get('message', ''))[:200]}"
            if timing.first_token is None and carries_output(obj):
                timing.first_token = self.fleet.clock()
            obj = state.translate(obj)
            if is_usage_only(obj):
                timing.output_tokens = completion_tokens(obj) or timing.output_tokens
                if not client_wants_usage:
                    continue
            relayed = state.accept(obj)
            if relayed is not None:
                out.append(sse_event(relayed))
        if out:
            await response.write(b"".join(out))
        return None

    async def _migrate(self, response: web.StreamResponse, ctx: _Request, state: StreamState, timing: Timing,
                       client_wants_usage: bool, backend: str, broken: str) -> None:
        """Continue a broken stream on other backends until it ends, or end it with one error event."""
        limit = self.config.migration_limit
        while broken is not None:
            why = broken.split(":", 1)[0]
            if state.finished:      # every token was relayed: only the usage event and [DONE] were lost
                log.info("stream from %s broke after its last token (%s); ending it here", backend, broken)
                state.done = True
                await response.write(DONE_EVENT)
                return
            if self.runtime.name == VLLM and state.prompt_token_ids is None and ctx.prompt_ids:
                # vLLM sends a completion's prompt ids with its first chunk that has output, and none when that
                # first output was empty: the router's own tokenization (the same tokenizer) stands in
                state.prompt_token_ids = ctx.prompt_ids
            if self.runtime.name == VLLM and state.token_ids and state.prompt_token_ids is None:
                state.unmigratable = state.unmigratable or "the vLLM replica did not report the prompt's token ids"
            failure = state.why_not(limit)
            opened = None
            if failure is None:
                opened = await self._open_continuation(ctx, state)
                if opened is None:
                    failure = NO_BACKEND
                elif isinstance(opened, bytes):
                    failure = TARGET_ERROR
            if failure is not None:
                self.metrics.migration_failures.labels(reason=failure).inc()
                state.errored = True
                if failure == TARGET_ERROR:
                    assert isinstance(opened, bytes)
                    await response.write(opened + DONE_EVENT)
                else:
                    status = 503 if failure == NO_BACKEND else 502
                    await response.write(error_event(status, failure_message(failure, broken, state, limit))
                                         + DONE_EVENT)
                state.done = True
                log.warning("stream from %s could not be continued (%s): %s", backend, failure, broken)
                return
            assert not isinstance(opened, bytes) and opened is not None
            target, upstream = opened
            state.migrations += 1
            state.continuing = True
            self.metrics.migrations.labels(reason=why).inc()
            log.info("stream moved from %s to %s after %d tokens (%s)", backend, target.name, len(state.token_ids),
                     broken)
            try:
                broken = await self._pump(response, upstream, target.name, timing, client_wants_usage, state)
            finally:
                self._close(upstream, target)
            if broken is not None:
                ctx.fail(target)
            backend = target.name

    async def _open_continuation(self, ctx: _Request, state: StreamState
                                 ) -> tuple[BackendState, aiohttp.ClientResponse] | bytes | None:
        """Send the continuation to another backend: (backend, its streaming response); an error event
        carrying the error a backend answered with; or None when no backend took it."""
        original = json.loads(ctx.raw)
        path: str | None = None
        if self.runtime.name == VLLM:
            held = 0
            if self.tokenizer is not None and state.token_ids:
                held = incomplete_tail(self.tokenizer.decode, state.token_ids[-8:])
            path, body = vllm_continuation(original, state, chat=ctx.path.endswith("/chat/completions"), path=ctx.path,
                                           max_model_len=self._max_model_len(), held_back=held)
        else:
            body = state.continuation_body(original)
        raw = json.dumps(body).encode()
        del original, body
        deadline = self.fleet.clock() + max(self.config.no_replica_hold_s, MIGRATION_WAIT_S)
        while True:
            opened = await self._open(ctx, raw, path)
            if opened is not None:
                break
            if self.fleet.clock() >= deadline:
                return None
            await asyncio.sleep(0.1)
        target, _, upstream, _ = opened
        if upstream.status == 200 and upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
            return target, upstream
        try:
            body = await upstream.read()
        except (aiohttp.ClientError, TimeoutError):
            body = b""
        finally:
            self._close(upstream, target)
        try:
            err = json.loads(body)["error"]
            message = f"continuing the stream on {target.name} failed: {err['message']}"
        except (ValueError, KeyError, TypeError):
            message = f"continuing the stream on {target.name} failed with status {upstream.status}"
        log.warning("%s", message)
        return error_event(upstream.status if upstream.status >= 400 else 502, message)

    def _max_model_len(self) -> int | None:
        """The smallest context length the routable replicas report (vLLM's /v1/models), or None."""
        lengths = [b.max_model_len for b in self.fleet.routable() if b.max_model_len is not None]
        return min(lengths) if lengths else None

    async def models(self, request: web.Request) -> web.Response:
        if self.route is not None:
            if not self.fleet.tiers_available() & set(self.route.names):
                return self._no_backend(self.route.names[-1])
            return web.json_response(self.route.models())
        headers = self._backend_headers(request)
        merged: dict[str, dict] = {}
        status = None
        for tier in self.config.tiers:
            views = self.fleet.views(tier.name)
            decision = choose(RouteRequest(sequence=next(self.sequence)), views, PolicyParams("least-load"))
            if decision is None:
                continue
            url = self.fleet.backends[decision.backend].endpoint.url + "/v1/models"
            try:
                async with self.session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status != 200:
                        return web.Response(status=r.status, body=await r.read(),
                                            content_type=r.content_type or "application/json")
                    data = await r.json()
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                self.fleet.mark_failed(decision.backend, f"/v1/models failed: {exc}")
                continue
            status = 200
            for entry in data.get("data") or []:
                if isinstance(entry, dict) and "id" in entry:
                    merged.setdefault(entry["id"], entry)
        if status is None:
            return self._no_backend(self.config.tiers[-1].name)
        return web.json_response({"object": "list", "data": list(merged.values())})

    async def drain(self, timeout_s: float, min_s: float = 0.0) -> None:
        """Readiness 503 at once; keep serving for at least ``min_s`` and until no request is open, up to
        ``timeout_s`` (``drain.py``)."""
        self.draining = True
        left = await self.open_requests.wait_until_done(min_s, timeout_s)
        if left:
            log.warning("drain: %d requests still open after %.0f s; they end with the router", left, timeout_s)
