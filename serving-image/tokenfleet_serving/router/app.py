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
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenfleet_serving.router.config import ConfigError, RouterConfig, load_endpoints
from tokenfleet_serving.router.metrics import RouterMetrics
from tokenfleet_serving.router.policy import SESSION, PolicyParams, RouteRequest, choose, choose_tier
from tokenfleet_serving.router.prefix import block_hashes
from tokenfleet_serving.engine.tokenizer import Tokenizer
from tokenfleet_serving.router.prompt import prompt_info
from tokenfleet_serving.router.state import Fleet, poll_forever

log = logging.getLogger("tokenfleet.router")

MAX_ATTEMPTS = 3
RETRY_AFTER_S = "1"
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"})
RELAYED_RESPONSE_HEADERS = ("Content-Type", "Content-Length", "Content-Encoding", "Retry-After", "Cache-Control",
                            "X-Request-Id")
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 500: "server_error", 502: "bad_gateway", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, *, retry_after: bool = False) -> web.Response:
    headers = {"Retry-After": RETRY_AFTER_S} if retry_after else None
    return web.json_response(error_body(status, message), status=status, headers=headers)


class Router:
    def __init__(self, config: RouterConfig, endpoints_path: str | Path, tokenizer: Tokenizer | None, *,
                 poll_interval_s: float = 0.5, endpoints_interval_s: float = 1.0,
                 backend_api_key: str | None = None, max_body_bytes: int = 4 * 2**20 + 4096):
        self.config = config
        self.endpoints_path = Path(endpoints_path)
        self.endpoints_interval_s = endpoints_interval_s
        self.tokenizer = tokenizer
        self.backend_api_key = backend_api_key
        self.params = PolicyParams(config.policy, config.load_factor, config.kv_usage_threshold, config.load_slack)
        self.fleet = Fleet(config, interval_s=poll_interval_s)
        self.metrics = RouterMetrics(self.fleet, tokenizer is not None)
        self.sequence = itertools.count()
        self.draining = False
        self._endpoints_text: bytes | None = None
        self._endpoints_problem: str | None = None
        self._tasks: list[asyncio.Task] = []
        self.session: aiohttp.ClientSession | None = None
        self.max_body_bytes = max_body_bytes
        self.app = self._build_app(max_body_bytes)

    def _build_app(self, max_body_bytes: int) -> web.Application:
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self._errors])
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
        self.reload_endpoints()
        self._tasks = [asyncio.ensure_future(self._watch_endpoints()),
                       asyncio.ensure_future(poll_forever(self.session, self.fleet, self.backend_api_key))]

    async def _stop(self, _app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
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

    # ---- middleware and probes -----------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = {404: f"no route {request.method} {request.path}", 405: f"method {request.method} not allowed "
                       f"on {request.path}", 413: f"request body exceeds {self.max_body_bytes} bytes"}
            response = web.json_response(error_body(exc.status, message.get(exc.status, exc.reason)),
                                         status=exc.status)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            response = error_response(500, "the router failed; see its log")
        if request.path.startswith("/v1/"):
            self.metrics.responses.labels(code=str(response.status)).inc()
        return response

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        routable = self.fleet.routable()
        if self.draining:
            reason = "draining"
        elif not self.fleet.endpoints_loaded:
            reason = self._endpoints_problem or f"{self.endpoints_path} not read yet"
        elif not routable:
            reason = f"no ready backend among {len(self.fleet.backends)} listed"
        else:
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

    async def _generate(self, request: web.Request, kind: str, path: str) -> web.StreamResponse:
        if self.draining:
            return error_response(503, "the router is shutting down", retry_after=True)
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # the backend answers with the precise error
        if self.tokenizer is not None and isinstance(body, dict):
            info = await asyncio.to_thread(prompt_info, kind, body, self.tokenizer)
        else:
            info = prompt_info(kind, body, None)
        hashes = block_hashes(info.token_ids, self.config.kv_block_size) if info.token_ids else ()

        tiers = self.config.tiers
        picked = choose_tier(tiers, info.num_tokens, info.max_tokens, self.fleet.tiers_available())
        if picked is None:
            return self._no_backend(tiers[-1].name)
        tier, fallback = picked
        if tier.model and isinstance(body, dict) and body.get("model") != tier.model:
            body["model"] = tier.model
            raw = json.dumps(body).encode()

        affinity = self.config.session_affinity
        session_key = request.headers.get(affinity.header) if affinity.enabled else None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        seq = next(self.sequence)
        tried: set[str] = set()
        for _ in range(MAX_ATTEMPTS):
            now = self.fleet.clock()
            pinned = self.fleet.sessions.pinned(session_key, now) if session_key else None
            decision = choose(RouteRequest(hashes, session_key, pinned, seq), self.fleet.views(tier.name, tried),
                              self.params)
            if decision is None:
                break
            backend = self.fleet.backends[decision.backend]
            reason = "tier-fallback" if fallback else decision.reason
            self.metrics.requests.labels(backend=decision.backend, reason=reason, tier=tier.name).inc()
            if session_key and (decision.reason == SESSION or pinned is None):
                self.fleet.sessions.pin(session_key, decision.backend, now)
            self.fleet.note_routed(decision.backend, hashes)
            backend.inflight += 1
            try:
                upstream = await self.session.post(backend.endpoint.url + path, data=raw, headers=headers)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                backend.inflight -= 1
                self.fleet.mark_failed(decision.backend, f"request failed: {type(exc).__name__}: {exc}")
                self.metrics.retries.labels(backend=decision.backend).inc()
                tried.add(decision.backend)
                continue
            if upstream.status == 503:  # draining or still loading: another backend can take it
                await upstream.read()
                upstream.release()
                backend.inflight -= 1
                self.fleet.mark_failed(decision.backend, "answered 503")
                self.metrics.retries.labels(backend=decision.backend).inc()
                tried.add(decision.backend)
                continue
            try:
                if hashes:
                    self.metrics.prefix_query_blocks.inc(len(hashes))
                    self.metrics.prefix_hit_blocks.inc(decision.matched_blocks)
                return await self._relay(request, upstream, decision.backend, reason)
            finally:
                if upstream.content.at_eof():
                    upstream.release()  # keep the connection for the next request
                else:
                    upstream.close()    # the client went away: closing makes the backend abort the request
                backend.inflight -= 1
        return self._no_backend(tier.name)

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, backend: str,
                     reason: str) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status)
        for name in RELAYED_RESPONSE_HEADERS:
            if name in upstream.headers:
                response.headers[name] = upstream.headers[name]
        response.headers["x-tokenfleet-backend"] = backend
        response.headers["x-tokenfleet-route-reason"] = reason
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            log.warning("backend %s broke off a response: %s", backend, exc)
            self.fleet.mark_failed(backend, f"response broken off: {exc}")
            if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                event = json.dumps(error_body(502, f"the backend {backend} failed mid-stream"))
                await response.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
            return response
        await response.write_eof()
        return response

    async def models(self, request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
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
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                self.fleet.mark_failed(decision.backend, f"/v1/models failed: {exc}")
                continue
            status = 200
            for entry in data.get("data") or []:
                if isinstance(entry, dict) and "id" in entry:
                    merged.setdefault(entry["id"], entry)
        if status is None:
            return self._no_backend(self.config.tiers[-1].name)
        return web.json_response({"object": "list", "data": list(merged.values())})

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests (readiness 503), then wait for open ones to finish."""
        self.draining = True
        deadline = self.fleet.clock() + timeout_s
        while any(b.inflight for b in self.fleet.backends.values()) and self.fleet.clock() < deadline:
            await asyncio.sleep(0.1)
