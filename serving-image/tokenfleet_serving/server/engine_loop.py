"""Run the engine's step loop in its own thread and bridge it to asyncio.

The event loop never takes the engine lock: adds and aborts go into an inbox
the step thread drains between steps, and each step's outputs come back to
the event loop with ``call_soon_threadsafe``, one ``asyncio.Queue`` per
request. A forward pass therefore never stalls the HTTP server, and
``/metrics`` reads a stats snapshot published after every step.

Every submitted request gets an answer within a bounded time, whatever the
engine does: a request the engine refuses or fails alone gets that error; when
the step thread stops (on an exception no request can be blamed for, or on
``stop()``), every request in flight and every request still in the inbox gets
:class:`EngineDeadError`; and a step thread that has not come round its loop
for ``stall_timeout_s`` is declared stalled (``check_stalled``, run every
second by ``watch()``): the same errors, and ``alive`` turns False so that
``/health`` fails and the pod is restarted.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenfleet_serving.contract.termination import write_termination_message
from tokenfleet_serving.engine.engine import EngineStats, LLMEngine
from tokenfleet_serving.engine.request import RequestOutput
from tokenfleet_serving.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The step thread stopped (or stalled); no request can make progress."""


class EngineStalledError(RuntimeError):
    """The step thread has not come round its loop within the stall timeout."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the client should retry later."""


@dataclass(frozen=True)
class Snapshot:
    stats: EngineStats
    taken_at: float          # time.monotonic()
    drained_seq: int         # every submission with seq <= this is inside the engine


log = logging.getLogger("tokenfleet.serve")

OutputListener = Callable[[list[RequestOutput], float], None]


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop, *, max_queue: int,
                 idle_wait_s: float = 0.2, stall_timeout_s: float = 120.0):
        self.engine, self.loop, self.max_queue = engine, loop, max_queue
        self.idle_wait_s = idle_wait_s
        self.stall_timeout_s = stall_timeout_s
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._streams: dict[str, asyncio.Queue] = {}     # touched only on the event loop
        self._submitted_seq = 0
        self._drained_seq = 0                             # written by the step thread
        self.listeners: list[OutputListener] = []
        self.error: BaseException | None = None
        self.heartbeat = time.monotonic()                 # last loop iteration of the step thread
        self.snapshot = Snapshot(engine.stats(), time.monotonic(), 0)

    # ---- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._fail_all("the engine was stopped")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def check_stalled(self, now: float) -> bool:
        """Declare the engine stalled when its step thread has not come round for ``stall_timeout_s``
        (a step that never returns): every waiting request gets an error and ``alive`` turns False."""
        if self.error is not None or not self._thread.is_alive() or now - self.heartbeat <= self.stall_timeout_s:
            return False
        self.error = EngineStalledError(f"no engine step finished in {now - self.heartbeat:.0f} s "
                                        f"(stall timeout {self.stall_timeout_s:g} s)")
        log.error("engine stalled: %s", self.error)
        write_termination_message(f"tokenfleet serve: engine stalled: {self.error}")
        self._fail_all(f"engine stopped: {self.error}")
        return True

    async def watch(self, interval_s: float = 1.0) -> None:
        """Check for a stall every ``interval_s`` until the engine stops."""
        while self.error is None and self._thread.is_alive():
            await asyncio.sleep(interval_s)
            self.check_stalled(time.monotonic())

    def stepping(self, within_s: float = 30.0) -> bool:
        """The step thread is alive and went round its loop recently (a step or an idle wake-up)."""
        return self.alive and time.monotonic() - self.heartbeat < within_s

    # ---- event-loop side -------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def queue_depth(self) -> int:
        """Requests waiting in the engine plus those submitted since the last snapshot."""
        snap = self.snapshot
        return snap.stats.num_waiting + (self._submitted_seq - snap.drained_seq)

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     continuation=None, share_prompt_with: str | None = None,
                     lora: str | None = None, client: str = "") -> asyncio.Queue:
        """Hand a request to the engine; returns the queue its outputs arrive on. A structured output's grammar
        is compiled first by the grammar compiler's own workers (bounded in time, at most a few pending per
        ``client``), awaited here without holding a thread, never on the step thread. ``lora``: the adapter it
        runs with (None: the base model), read on a worker thread first when it is not in memory.

        Raises EngineDeadError, QueueFullError, or the engine's ValueError for a request it refuses
        (StructuredOutputError for a grammar it cannot compile in time).
        """
        grammar = lora_read = None
        if params.structured is not None:
            grammar = await self._compiled(params.structured, client)
        if lora is not None:          # a registered adapter not in memory is read here, not on the step thread
            lora_read = await asyncio.to_thread(self.engine.prepare_lora, lora)
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if self._stop or not self._thread.is_alive():
            raise EngineDeadError("engine is not running")
        if self.queue_depth() >= self.max_queue:
            raise QueueFullError(f"{self.queue_depth()} requests are waiting (limit {self.max_queue})")
        accepted = self.loop.create_future()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._submitted_seq += 1
        self._inbox.append(("add", self._submitted_seq, request_id, prompt_token_ids, params, continuation,
                            (grammar, share_prompt_with, lora, lora_read), accepted))
        self._wake.set()
        try:
            await accepted
        except BaseException:
            self._streams.pop(request_id, None)
            self.abort(request_id)    # cancelled after the engine took it: do not leave it running
            raise
        return stream

    async def _compiled(self, spec, client: str):
        """The compiled grammar of ``spec``; StructuredOutputError after the compiler's timeout. Waiting does
        not cancel the compile: another request may share it, and it lands in the cache for the next."""
        compiler = self.engine.grammar_compiler
        compiling = asyncio.wrap_future(compiler.submit(spec, client))
        # a failure nobody waits for any more (timed out, client gone) is retrieved here: no asyncio warning
        compiling.add_done_callback(lambda f: f.cancelled() or f.exception())
        done, _ = await asyncio.wait({compiling}, timeout=compiler.timeout_s)
        if not done:
            raise compiler.timed_out(spec)
        return compiling.result()

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its stream is dropped (nobody reads it)."""
        self._streams.pop(request_id, None)
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def abort_all(self) -> None:
        for rid in list(self._streams):
            self._inbox.append(("abort", rid))
        self._wake.set()

    def refresh_snapshot(self) -> None:
        """Take the engine's stats now, on the event loop: a change made outside a step (an adapter loaded or
        unloaded while the engine idles) shows on /metrics at once instead of at the next step."""
        self.snapshot = Snapshot(self.engine.stats(), time.monotonic(), self.snapshot.drained_seq)

    def _deliver(self, outputs: list[RequestOutput], at: float, snapshot: Snapshot | None) -> None:
        if snapshot is not None:
            self.snapshot = snapshot
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
                if out.finished:
                    del self._streams[out.request_id]
        for listener in self.listeners:
            listener(outputs, at)

    def _fail_all(self, reason: str) -> None:
        """On the event loop, once the step thread will take nothing more: answer everything left."""
        dead = EngineDeadError(reason)
        while True:
            try:
                cmd = self._inbox.popleft()
            except IndexError:
                break
            if cmd[0] == "add":
                self._resolve(cmd[-1], dead)
        for stream in self._streams.values():
            stream.put_nowait(dead)
        self._streams.clear()

    # ---- step thread -----------------------------------------------------------
    def _resolve(self, fut: asyncio.Future, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    def _drain_inbox(self) -> None:
        while self._inbox and self.error is None:
            cmd = self._inbox.popleft()
            if cmd[0] == "add":
                _, seq, rid, ids, params, continuation, (grammar, sibling, lora, lora_read), fut = cmd
                try:
                    extra = {k: v for k, v in (("continuation", continuation), ("grammar", grammar),
                                               ("share_prompt_with", sibling), ("lora", lora),
                                               ("lora_read", lora_read)) if v is not None}
                    self.engine.add_request(rid, ids, params, **extra)
                    error = None
                except Exception as e:  # noqa: BLE001 - refused (ValueError) or failed: this request alone
                    if not isinstance(e, ValueError):
                        log.exception("adding request %s failed", rid)
                    error = e
                self._drained_seq = seq
                self.loop.call_soon_threadsafe(self._resolve, fut, error)
            else:
                self.engine.abort_request(cmd[1])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        snap = Snapshot(self.engine.stats(), now, self._drained_seq)
        self.loop.call_soon_threadsafe(self._deliver, outputs, now, snap)

    def _run(self) -> None:
        reason = "the engine was stopped"
        try:
            while not self._stop and self.error is None:
                self.heartbeat = time.monotonic()
                self._wake.clear()
                self._drain_inbox()
                if self.error is not None:
                    break
                if self.engine.has_unfinished():
                    self._publish(self.engine.step())
                else:
                    self._publish([])
                    self._wake.wait(self.idle_wait_s)
                    keepalive = getattr(self.engine, "keepalive", None)
                    if keepalive is not None:      # tensor parallelism: the other ranks' wait stays bounded
                        keepalive()
        except BaseException as e:  # noqa: BLE001 - the engine is broken: fail every request, stop stepping
            log.exception("engine step loop stopped")
            if self.error is None:
                self.error = e
            write_termination_message(f"tokenfleet serve: engine stopped: {e!r}")
            reason = f"engine stopped: {e!r}"
        finally:
            # whatever ended the loop, nothing left in the inbox or in flight may wait for an answer
            try:
                self.loop.call_soon_threadsafe(self._fail_all, reason)
            except RuntimeError:     # event loop already closed
                pass
