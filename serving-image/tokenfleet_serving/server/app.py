"""The aiohttp application: OpenAI routes, probes, metrics, cache hashes, drain.

Lifecycle: the server listens first (``/health`` answers while weights load),
loads the engine in a thread, runs one warm-up token through it, and only then
reports ``/ready``. ``begin_drain`` (SIGTERM) flips readiness off, answers new
requests with 503, lets every accepted request finish within the drain
timeout, aborts what is left after it, and sets ``stopped``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hashlib
import hmac
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenfleet_serving.engine.engine import EngineConfig, LLMEngine
from tokenfleet_serving.engine.lora_manager import UnknownAdapter
from tokenfleet_serving.engine.request import RequestOutput
from tokenfleet_serving.engine.sampling_params import SamplingParams
from tokenfleet_serving.engine.structured.sandbox import SandboxUnavailable
from tokenfleet_serving.engine.structured.spec import StructuredOutputError
from tokenfleet_serving.openai import protocol as P
from tokenfleet_serving.openai.errors import ApiError, error_body
from tokenfleet_serving.openai.prompt import prompt_token_ids
from tokenfleet_serving.openai.sse import DONE_EVENT, sse_event
from tokenfleet_serving.openai.tool_calls import apply_tool_calls, finish_reason, tool_call_stream, tool_output_parser
from tokenfleet_serving.openai.tool_parsers import ToolParser

from . import lora_api
from .connection import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, read_body, send_and_close
from .engine_loop import EngineDeadError, EngineLoop, QueueFullError
from .lora_file import AdapterFile
from .metrics import RequestTimer, ServerMetrics
from .startup import StartupPhases
from .warm_restart import LoadResult, PrefixCheckpointer, WarmRestartConfig

log = logging.getLogger("tokenfleet.serve")

GUARDED_PREFIXES = ("/v1/", "/cache/")   # need the API key when one is set; probes and /metrics do not


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    max_prompt_tokens: int | None = None      # default: the model's context - 1
    max_tokens_limit: int | None = None       # default: the model's context
    max_queue: int = 256
    drain_timeout_s: float = 25.0
    price_per_hour: float | None = None
    retry_after_s: int = 1
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S   # request line and headers (connection.py)
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S       # the whole body, from the end of the headers
    engine_stall_timeout_s: float = 120.0               # a step this long means the engine is stuck
    warm_restart: WarmRestartConfig | None = None       # prefix-cache checkpoints (warm_restart.py)
    tool_call_parser: str | None = None                 # reads tool calls for tool_choice auto (openai/tool_parsers)
    lora_modules: tuple[tuple[str, str], ...] = ()       # (name, PEFT directory) loaded at start (--lora-modules)
    lora_modules_file: str | None = None                # adapters file followed while serving (lora_file.py)
    lora_roots: tuple[tuple[str, str], ...] = ()         # (volume name, directory) the file's roots (--lora-root)


class Server:
    def __init__(self, config: ServerConfig, engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine):
        self.config = config
        self.engine_factory = engine_factory
        self.engine: LLMEngine | None = None
        self.engine_loop: EngineLoop | None = None
        self.limits: P.Limits | None = None
        self.metrics = ServerMetrics(config.served_model_names[0], price_per_hour=config.price_per_hour)
        self.metrics.state = lambda: {"ready": self.is_ready(), "draining": self.draining}
        self.load_error: BaseException | None = None
        self.warm = False
        self.draining = False
        self.active = 0                       # generation handlers past admission
        self.stopped = asyncio.Event()
        self.created = P.now()
        self.started_at = time.monotonic()
        self.phases = StartupPhases()
        self.metrics.startup_phases = self.phases.seconds
        self.checkpointer: PrefixCheckpointer | None = None
        self._saver: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self.adapter_file: AdapterFile | None = None
        self._adapter_follower: asyncio.Task | None = None
        # /cache/blocks reads the cache on its own thread: the router's poll never queues behind other work
        self._cache_reader = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-blocks")
        self.app = self._build_app()

    # ---- lifecycle -------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._errors_middleware, self._auth_middleware])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/cache/blocks", self.cache_blocks)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        return app

    async def load(self) -> None:
        """Load the engine off the event loop, start stepping, warm up; then ready."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(result, error) -> None:
            if not done.done():
                done.set_result(result) if error is None else done.set_exception(error)

        def build() -> None:        # a daemon thread, so SIGTERM during loading does not wait for it
            try:
                loop.call_soon_threadsafe(settle, self.engine_factory(self.config.engine), None)
            except BaseException as e:  # noqa: BLE001 - reported by load(); the process exits 1
                loop.call_soon_threadsafe(settle, None, e)

        threading.Thread(target=build, name="engine-load", daemon=True).start()
        try:
            engine = await done
        except BaseException as e:
            self.load_error = e
            log.error("loading the model failed: %s", e)
            raise
        self.engine = engine
        for name, path in self.config.lora_modules:       # --lora-modules: a bad one fails the start, named
            await asyncio.to_thread(engine.load_lora_adapter, name, path)
        if self.config.lora_modules_file is not None:      # a refused adapter is reported, never fails the start
            self.adapter_file = AdapterFile(engine, self.config.lora_modules_file, dict(self.config.lora_roots))
            await asyncio.to_thread(self.adapter_file.sync)
            self.metrics.lora_errors = lambda: {n: (e.file, e.field, e.reason)
                                                for n, e in list(self.adapter_file.errors.items())}
        for phase, at in getattr(engine, "startup_marks", {}).items():
            self.phases.mark(phase, at)
        if self.config.warm_restart is not None:
            self.checkpointer, loaded = await asyncio.to_thread(self._open_checkpoint, engine)
            self.metrics.prefix_checkpoint_blocks = loaded.blocks
            self.phases.mark("prefix_cache_loaded")
        stats = engine.stats()
        ctx = engine.max_model_len
        cfg = self.config
        self.limits = P.Limits(
            max_model_len=ctx,
            max_prompt_tokens=min(cfg.max_prompt_tokens or ctx - 1, ctx - 1),
            max_tokens_limit=min(cfg.max_tokens_limit or ctx, ctx),
            kv_capacity_tokens=stats.num_kv_blocks * stats.block_size)
        self.metrics.configure(ctx, cfg.engine.enable_prefix_caching)
        self.engine_loop = EngineLoop(engine, loop, max_queue=cfg.max_queue,
                                      stall_timeout_s=cfg.engine_stall_timeout_s)
        self.metrics.snapshot = lambda: self.engine_loop.snapshot.stats
        self.engine_loop.listeners.append(lambda outs, at: self.metrics.on_snapshot(self.engine_loop.snapshot.stats, at))
        self.engine_loop.start()
        self._watchdog = loop.create_task(self.engine_loop.watch())
        await self._warm_up()
        self.metrics.startup_seconds = time.monotonic() - self.started_at
        self.phases.mark("first_token")
        if self.checkpointer is not None:
            self._saver = loop.create_task(self.checkpointer.run_periodically())
        if self.adapter_file is not None:
            self.adapter_file.on_change = self.engine_loop.refresh_snapshot
            self._adapter_follower = loop.create_task(self.adapter_file.run())
        self.warm = True
        log.info("ready in %.1f s: %s (context %d tokens, %d KV blocks of %d); start-up phases (s since the "
                 "process started): %s", self.metrics.startup_seconds, cfg.served_model_names[0], ctx,
                 stats.num_kv_blocks, stats.block_size, self.phases.seconds())

    def _open_checkpoint(self, engine: LLMEngine) -> tuple[PrefixCheckpointer | None, LoadResult]:
        """The warm-restart checkpointer and what it loaded; a failure only means a cold start."""
        assert self.config.warm_restart is not None
        try:
            checkpointer = PrefixCheckpointer(self.config.warm_restart, engine)
        except Exception as exc:  # noqa: BLE001 - e.g. an unreadable model directory for the identity
            log.warning("warm restart is off: %s: %s", type(exc).__name__, exc)
            return None, LoadResult(refused=str(exc))
        return checkpointer, checkpointer.load()

    async def _warm_up(self) -> None:
        """One real forward pass before readiness: proves weights, KV cache and the step thread work."""
        stream = await self.engine_loop.submit(f"warmup-{uuid.uuid4().hex}", [0], SamplingParams(max_tokens=1))
        while True:
            out = await stream.get()
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                return

    def is_ready(self) -> bool:
        return (self.warm and not self.draining and self.engine_loop is not None
                and self.engine_loop.stepping())

    def begin_drain(self) -> None:
        """First call: stop admitting and drain. A second call: abort what is in flight now."""
        if self.draining:
            log.warning("second stop signal: aborting %d in-flight requests", self.active)
            if self.engine_loop is not None:
                self._abort_everything()
            return
        self.draining = True
        log.info("draining: %d requests in flight, up to %.0f s", self.active, self.config.drain_timeout_s)
        asyncio.get_running_loop().create_task(self._drain())

    def _abort_everything(self) -> None:
        for stream in list(self.engine_loop._streams.values()):
            stream.put_nowait(EngineDeadError("aborted: the server is shutting down"))
        self.engine_loop.abort_all()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active and self.engine_loop is not None:
            log.warning("drain timeout: aborting %d requests", self.active)
            self._abort_everything()
            end = time.monotonic() + 5
            while self.active and time.monotonic() < end:
                await asyncio.sleep(0.05)
        if self.checkpointer is not None and self.engine_loop is not None and self.engine_loop.alive:
            if self._saver is not None:
                self._saver.cancel()
            await self.checkpointer.save_async("drain")
        log.info("drained")
        self.stopped.set()

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._adapter_follower is not None:
            self._adapter_follower.cancel()
        if self._saver is not None:
            self._saver.cancel()
        if self.engine_loop is not None:
            self.engine_loop.stop()
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()          # releases the other ranks of a tensor-parallel replica

    # ---- middleware ------------------------------------------------------------
    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            if request.path.startswith("/v1/") and request.method == "POST":
                self.metrics.reject(e.status)
            resp = web.json_response(e.body(), status=e.status, headers=e.headers)
            if e.close_connection:       # the body stopped arriving or cannot be decoded: answer, close at once
                return await send_and_close(request, resp)
            if e.status == 413:          # the body is too long: answer, read the rest away (so the client
                resp.force_close()       # can finish sending and read the answer), then close
            return resp
        except web.HTTPException as e:   # unknown route, wrong method, body over client_max_size
            if e.status < 400:
                raise
            status = e.status
            message = {404: f"no route {request.method} {request.path}",
                       405: f"method {request.method} is not allowed on {request.path}",
                       413: f"request body exceeds {self.config.max_body_bytes} bytes"}.get(status, e.reason)
            if status == 413:
                self.metrics.reject(413)
            resp = web.json_response(error_body(status, message), status=status)
            if status == 413:
                resp.force_close()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001 - the server keeps serving; the client gets a 500 body
            log.exception("unhandled error on %s %s", request.method, request.path)
            return web.json_response(error_body(500, f"internal error: {type(e).__name__}"), status=500)

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler):
        key = self.config.api_key
        if key and request.path.startswith(GUARDED_PREFIXES):
            # a header's bytes that are not UTF-8 arrive as lone surrogates: compared as the bytes they were
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')")
        return await handler(request)

    # ---- probes, metrics, models -----------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """Liveness: the process answers and the engine (once loaded) has not died."""
        if self.engine_loop is not None and not self.engine_loop.alive:
            return web.json_response({"status": "engine dead", "error": repr(self.engine_loop.error)}, status=503)
        if self.load_error is not None:
            return web.json_response({"status": "load failed", "error": str(self.load_error)}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if self.is_ready():
            return web.json_response({"ready": True})
        reason = ("draining" if self.draining else "loading model" if not self.warm
                  else "engine not stepping")
        return web.json_response({"ready": False, "reason": reason}, status=503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        ctx = self.limits.max_model_len if self.limits else 0
        body = P.models_response(list(self.config.served_model_names), self.created, ctx)
        if self.engine is not None and self.engine.lora is not None:
            body["data"] += lora_api.adapter_models(self.engine, self.config.served_model_names[0], self.created, ctx)
        return web.json_response(body)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await lora_api.load(self, await self._read_json(request))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await lora_api.unload(self, await self._read_json(request))

    async def cache_blocks(self, request: web.Request) -> web.Response:
        """Hashes of the full blocks now in the prefix cache, for cache-aware routing (spec in block_pool.py).

        They tell whether a guessed prompt was served, so only the router gets them: the holder of
        --api-key (the auth middleware checks it); without a key nobody does."""
        if not self.config.api_key:
            raise ApiError(403, "the prefix-cache hashes are served only to the router: start the server with "
                                  "--api-key (the router's key) to enable /cache/blocks")
        if self.engine is None:
            raise ApiError(503, "model is loading")
        tiers = await asyncio.get_running_loop().run_in_executor(self._cache_reader,
                                                                 self.engine.cached_block_hashes_by_tier)
        hashes = tiers["accelerator"]
        return web.json_response({"model": self.config.served_model_names[0],
                                  "block_size": self.engine_loop.snapshot.stats.block_size,
                                  "hash": "sha256-chain-uint32le", "num_blocks": len(hashes),
                                  "block_hashes": hashes, "host_block_hashes": tiers["host"],
                                  "disk_block_hashes": tiers["disk"]})

    # ---- generation ------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, P.parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, P.parse_chat)

    async def _read_json(self, request: web.Request):
        raw = await read_body(request, max_bytes=self.config.max_body_bytes, timeout_s=self.config.body_timeout_s)
        return P.parse_json_body(raw)

    def _admit(self) -> None:
        if self.draining:
            raise ApiError(503, "server is draining; send the request to another replica",
                             headers={"Retry-After": str(self.config.retry_after_s)})
        if self.engine_loop is not None and not self.engine_loop.alive:
            raise ApiError(503, "engine is not running")
        if not self.warm:
            raise ApiError(503, "model is loading", headers={"Retry-After": str(self.config.retry_after_s)})

    async def _generate(self, request: web.Request, parse) -> web.StreamResponse:
        self._admit()
        self.active += 1
        try:
            return await self._run_request(request, parse)
        finally:
            self.active -= 1

    async def _run_request(self, request: web.Request, parse) -> web.StreamResponse:
        arrival = time.monotonic()
        req = parse(await self._read_json(request))
        engine = self.engine
        lora = lora_api.resolve(self, req.model)       # None: the base model; 404 for a model not served
        tool_parser = tool_output_parser(req.tools, self.config.tool_call_parser)
        ids = prompt_token_ids(engine.tokenizer, req, engine.model_config.vocab_size)
        max_tokens = P.resolve_max_tokens(req, len(ids), self.limits)
        if tool_parser is not None and tool_parser.keeps_special_tokens and "skip_special_tokens" not in req.sampling:
            req.sampling["skip_special_tokens"] = False      # the parser reads the call markers
        params = P.sampling_params(req, max_tokens)
        rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        # n > 1: one engine request per choice; the later ones take the prompt's KV from the first's
        rids = [rid] if req.n == 1 else [f"{rid}-{i}" for i in range(req.n)]
        streams: list[asyncio.Queue] = []
        try:
            for i, erid in enumerate(rids):
                p = params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
                streams.append(await self._submit(erid, ids, p, req, rids[0] if i else None, lora,
                                                  _client_of(request)))
        except StructuredOutputError as e:     # a grammar that does not compile (in time): the field at fault
            self._abort(rids[:len(streams)])
            headers = {"Retry-After": str(self.config.retry_after_s)} if e.status == 429 else None
            raise ApiError(e.status, e.message, e.param, headers=headers) from e
        except BaseException:
            self._abort(rids[:len(streams)])
            raise
        runs = [_Run(self, erid, req, RequestTimer(arrival), index=i, tool_parser=tool_parser)
                for i, erid in enumerate(rids)]
        for run in runs:
            run.running_usage = P.usage(len(ids), 0, 0)
        try:
            if req.stream:
                return await _stream(request, runs, streams)
            bodies = await asyncio.gather(*(run.collect(s) for run, s in zip(runs, streams)))
            return web.json_response(_merge_choices(list(bodies)))
        finally:
            self._abort([run.rid for run in runs if not run.finished])  # client gone or we failed: free the KV

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine_loop.abort(rid)

    async def _submit(self, rid: str, ids: list[int], params: SamplingParams, req: P.GenerationRequest,
                      share_prompt_with: str | None, lora: str | None, client: str = "") -> asyncio.Queue:
        try:
            return await self.engine_loop.submit(rid, ids, params, req.continuation, share_prompt_with, lora,
                                                 client)
        except QueueFullError as e:
            raise ApiError(429, f"server is at capacity: {e}",
                             headers={"Retry-After": str(self.config.retry_after_s)}) from e
        except EngineDeadError as e:
            raise ApiError(503, str(e)) from e
        except StructuredOutputError:
            raise
        except SandboxUnavailable as e:   # the server's fault, not the grammar's
            raise ApiError(503, f"structured outputs are unavailable: {e}",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from e
        except UnknownAdapter as e:   # unloaded since it was resolved
            raise lora_api.not_found(self, req.model) from e
        except ValueError as e:       # the engine refused it (ids, KV capacity); it names the problem
            raise ApiError(400, str(e), P.named_param(str(e))) from e
        except Exception as e:        # the engine failed this request alone (engine_loop logged it)
            raise ApiError(500, f"the engine failed this request: {type(e).__name__}: {e}") from e


def _client_of(request: web.Request) -> str:
    """Who sent a request, for per-client bounds: its API key (hashed) and its peer. Behind the router every
    client is the router."""
    key = hashlib.sha256(request.headers.get("Authorization", "").encode()).hexdigest()[:16]
    return f"{key}@{request.remote}"


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (finish_reason "error"); the others go on. ``param``: the request's
    own field at fault (its grammar hit llguidance's per-token limits): a 400 naming it, not a 500."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    @property
    def status(self) -> int:
        return 500 if self.param is None else 400


class _Run:
    """One request's journey from engine outputs to the HTTP response."""

    def __init__(self, server: Server, rid: str, req: P.GenerationRequest, timer: RequestTimer, index: int = 0,
                 tool_parser: ToolParser | None = None):
        self.server, self.rid, self.req, self.timer = server, rid, req, timer
        self.index = index                    # the choice this run answers (n > 1)
        self.tool_parser = tool_parser        # reads tool calls out of the text (openai/tool_calls.py)
        self.running_usage: dict | None = None     # usage so far (stream_options.continuous_usage_stats)
        self.model, self.created = req.model, P.now()
        self.finished = False
        self.saw_output = False
        self.usage: dict | None = None
        self.tokenizer = server.engine.tokenizer

    async def outputs(self, stream: asyncio.Queue):
        """Engine outputs for this request, with metrics recorded as they arrive."""
        m = self.server.metrics
        while True:
            out = await stream.get()
            if isinstance(out, BaseException):
                raise out
            at = time.monotonic()
            gaps_before = len(self.timer.gaps)
            self.timer.on_tokens(len(out.new_token_ids), at)
            if not self.saw_output and out.new_token_ids:
                self.saw_output = True
                m.observe_first_output(self.timer, out.num_prompt_tokens, out.num_cached_tokens)
            m.observe_gaps(self.timer.gaps[gaps_before:])
            self.running_usage = P.usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
            if out.finish_reason == "error":
                self.finished = True
                raise RequestFailedError(f"generation failed for this request: {out.error}", out.error_param)
            if out.finished:
                self.finished = True
                self.usage = P.usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
                m.observe_finished(self.timer, out.num_prompt_tokens, out.finish_reason, at)
            yield out
            if out.finished:
                return

    def _logprobs(self, out: RequestOutput) -> dict | None:
        if out.logprobs is None or self.req.logprobs is None:
            return None

        def text(tid: int) -> str:
            return self.tokenizer.decode([tid], skip_special_tokens=False) if self.tokenizer else str(tid)

        infos = [P.TokenInfo(text(lp.token_id), lp.logprob, [(text(t), v) for t, v in lp.top])
                 for lp in out.logprobs]
        return P.chat_logprobs(infos) if self.req.kind == "chat" else P.completion_logprobs(infos)

    async def collect(self, stream: asyncio.Queue) -> dict:
        text, reason, lps, token_ids = [], None, [], []
        try:
            async for out in self.outputs(stream):
                text.append(out.text_delta)
                token_ids += out.new_token_ids
                reason = out.finish_reason
                lp = self._logprobs(out)
                if lp is not None:
                    lps.append(lp)
        except EngineDeadError as e:
            raise ApiError(503, str(e)) from e
        except RequestFailedError as e:
            raise ApiError(e.status, str(e), e.param) from e
        logprobs = _merge_logprobs(lps, self.req.kind) if self.req.logprobs is not None else None
        make = P.chat_response if self.req.kind == "chat" else P.completion_response
        body = make(self.rid, self.model, self.created, "".join(text), reason, self.usage, logprobs)
        if self.tool_parser is not None and self.req.tools is not None:
            apply_tool_calls(body["choices"][0], "".join(text), self.tool_parser, self.req.tools)
        if self.req.return_token_ids:
            body["choices"][0]["token_ids"] = token_ids
        return body

    async def stream(self, send: Callable, stream: asyncio.Queue, response_id: str) -> None:
        """This choice's chunks, through ``send`` (shared by the n choices of one response)."""
        chat = self.req.kind == "chat"

        async def send_chunk(chunk: dict) -> None:
            chunk["choices"][0]["index"] = self.index
            if self.req.continuous_usage_stats and self.req.include_usage:
                chunk["usage"] = self.running_usage
            await send(chunk)

        with_ids = self.req.return_token_ids
        tools = self.req.tools
        tool_stream = tool_call_stream(tools, self.tool_parser) if tools and self.tool_parser else None
        if tool_stream is not None and self.req.continuation is not None:
            # the client has what another replica's stream made of this text: take it in again, silently (off
            # the event loop: up to MAX_CONTINUATION_TEXT of it, which other requests need not wait for)
            await asyncio.to_thread(tool_stream.push, self.req.continuation.delivered_text)
        if chat and self.req.continuation is None:      # a continued stream has had its opening chunk
            await send_chunk(P.chat_chunk(response_id, self.model, self.created, {"role": "assistant", "content": ""},
                                          None))
        async for out in self.outputs(stream):
            if not out.text_delta and not out.finished and not out.logprobs and not (with_ids and out.new_token_ids):
                continue
            lp = self._logprobs(out)
            if tool_stream is not None:     # content and tool-call deltas, then (as OpenAI) why it ended, alone
                deltas = tool_stream.push(out.text_delta, final=out.finished)
                if out.finished or not deltas:
                    deltas.append({})
                reason = finish_reason(out.finish_reason, tool_stream.calls, tools)
                for i, delta in enumerate(deltas):
                    chunk = P.chat_chunk(response_id, self.model, self.created, delta,
                                         reason if i == len(deltas) - 1 else None, lp if i == 0 else None)
                    if with_ids:      # and the text they decode to, which a continuation needs (router/migration.py)
                        chunk["choices"][0]["token_ids"] = out.new_token_ids if i == 0 else []
                        chunk["choices"][0]["output_text"] = out.text_delta if i == 0 else ""
                    await send_chunk(chunk)
                continue
            if chat:
                delta = {"content": out.text_delta} if out.text_delta else {}
                chunk = P.chat_chunk(response_id, self.model, self.created, delta, out.finish_reason, lp)
            else:
                chunk = P.completion_chunk(response_id, self.model, self.created, out.text_delta,
                                           out.finish_reason, lp)
            if with_ids:
                chunk["choices"][0]["token_ids"] = out.new_token_ids
            await send_chunk(chunk)


def _response_id(runs: list[_Run]) -> str:
    return runs[0].rid if len(runs) == 1 else runs[0].rid.rsplit("-", 1)[0]


async def _stream(request: web.Request, runs: list[_Run], streams: list[asyncio.Queue]) -> web.StreamResponse:
    """One SSE response for the n choices: their chunks interleave, each naming its choice ``index``."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    lock = asyncio.Lock()
    rid, req = _response_id(runs), runs[0].req

    async def send(obj: dict) -> None:
        async with lock:
            await resp.write(sse_event(obj))

    try:
        await asyncio.gather(*(run.stream(send, s, rid) for run, s in zip(runs, streams)))
        if req.include_usage:
            await send(P.usage_chunk(rid, runs[0].model, runs[0].created, req.kind, _total_usage(runs)))
    except EngineDeadError as e:
        await send(error_body(503, str(e)))
    except RequestFailedError as e:
        await send(error_body(e.status, str(e), e.param))
    await resp.write(DONE_EVENT)
    await resp.write_eof()
    return resp


def _total_usage(runs: list[_Run]) -> dict | None:
    """The prompt once (its KV is shared), the completion tokens of every choice."""
    usages = [r.usage for r in runs]
    if any(u is None for u in usages):
        return None
    total = dict(usages[0])                                   # type: ignore[arg-type]
    total["completion_tokens"] = sum(u["completion_tokens"] for u in usages)     # type: ignore[index]
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    return total


def _merge_choices(bodies: list[dict]) -> dict:
    if len(bodies) == 1:
        return bodies[0]
    body = dict(bodies[0], id=bodies[0]["id"].rsplit("-", 1)[0])
    body["choices"] = [dict(b["choices"][0], index=i) for i, b in enumerate(bodies)]
    usages = [b["usage"] for b in bodies]
    body["usage"] = dict(usages[0], completion_tokens=sum(u["completion_tokens"] for u in usages))
    body["usage"]["total_tokens"] = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    return body


def _merge_logprobs(parts: list[dict], kind: str) -> dict | None:
    if kind == "chat":
        return {"content": [c for p in parts for c in p["content"]]}
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pos = 0
    for p in parts:
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            merged[key] += p[key]
    for tok in merged["tokens"]:
        merged["text_offset"].append(pos)
        pos += len(tok)
    return merged
