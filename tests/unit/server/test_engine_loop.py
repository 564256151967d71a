"""The step-thread bridge answers every request within a bounded time, whatever the engine does.

In-process: a real engine on the tiny checkpoint, whose steps wait at a gate the test holds, so a request is
in the inbox, or in flight, exactly when the test says; the engine then dies, is stopped or stalls.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tokenfleet_serving.engine.engine import EngineConfig, LLMEngine
from tokenfleet_serving.engine.sampling_params import SamplingParams
from tokenfleet_serving.server.engine_loop import EngineDeadError, EngineLoop

ANSWER_WITHIN_S = 30      # "bounded": without an answer by then the request hangs (a timeout, not a race)
LONG = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)


class GatedEngine(LLMEngine):
    """Each step with work waits at ``gate``; ``stepping`` is set while it waits; ``fault`` makes it raise."""

    def __init__(self, config):
        super().__init__(config)
        self.gate, self.stepping = threading.Event(), threading.Event()
        self.fault: BaseException | None = None

    def step(self):
        if self.has_unfinished():
            self.stepping.set()
            assert self.gate.wait(120), "the test never opened the gate"
            self.stepping.clear()
            if self.fault is not None:
                raise self.fault
        return super().step()


@pytest.fixture(scope="module")
def config(tiny_model):
    return EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_bytes=2 << 20, num_threads=1)


async def _until_error(stream: asyncio.Queue) -> BaseException:
    while True:
        item = await stream.get()
        if isinstance(item, BaseException):
            return item


async def _blocked_loop(config, **kw) -> tuple[GatedEngine, EngineLoop, asyncio.Queue, list[asyncio.Future]]:
    """An engine loop whose step thread is held at the gate with one request in flight and three in the inbox."""
    loop = asyncio.get_running_loop()
    eng = GatedEngine(config)
    el = EngineLoop(eng, loop, max_queue=64, idle_wait_s=0.01, **kw)
    el.start()
    first = await el.submit("first", [1, 2, 3], LONG)
    assert await loop.run_in_executor(None, eng.stepping.wait, 60)
    queued = [asyncio.ensure_future(el.submit(f"queued-{i}", [4, 5], LONG)) for i in range(3)]
    await asyncio.sleep(0)
    assert len(el._inbox) == 3, "the three wait in the inbox while the step thread is held"
    return eng, el, first, queued


def test_requests_in_the_inbox_get_an_error_when_the_engine_dies(config):
    async def scenario():
        eng, el, first, queued = await _blocked_loop(config)
        eng.fault = RuntimeError("simulated device fault")
        eng.gate.set()
        answers = await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), ANSWER_WITHIN_S)
        assert all(isinstance(a, EngineDeadError) and "simulated device fault" in str(a) for a in answers), answers
        assert isinstance(await asyncio.wait_for(_until_error(first), ANSWER_WITHIN_S), EngineDeadError)
        assert not el.alive
        with pytest.raises(EngineDeadError):
            await el.submit("late", [1], LONG)
    asyncio.run(scenario())


def test_requests_in_the_inbox_get_an_error_when_the_engine_is_stopped(config):
    async def scenario():
        eng, el, first, queued = await _blocked_loop(config)
        el.stop(timeout=0.1)               # the thread is held in a step: stop cannot join it
        answers = await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), ANSWER_WITHIN_S)
        assert all(isinstance(a, EngineDeadError) for a in answers), answers
        assert isinstance(await asyncio.wait_for(_until_error(first), ANSWER_WITHIN_S), EngineDeadError)
        with pytest.raises(EngineDeadError):
            await el.submit("late", [1], LONG)
        eng.gate.set()
        await asyncio.get_running_loop().run_in_executor(None, el._thread.join, 60)
        assert set(eng.requests) <= {"first"}, "nothing from the inbox reached the engine after the stop"
    asyncio.run(scenario())


def test_a_stalled_step_fails_every_waiting_request_and_the_engine_turns_dead(config):
    async def scenario():
        eng, el, first, queued = await _blocked_loop(config, stall_timeout_s=60.0)
        assert not el.check_stalled(time.monotonic())          # held, but not for long yet
        assert el.alive
        assert el.check_stalled(time.monotonic() + 61.0)       # the watchdog's clock says a minute went by
        answers = await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), ANSWER_WITHIN_S)
        assert all(isinstance(a, EngineDeadError) and "stall" in str(a) for a in answers), answers
        assert "stall" in str(await asyncio.wait_for(_until_error(first), ANSWER_WITHIN_S))
        assert not el.alive and not el.stepping()
        eng.gate.set()                                          # the stuck step returns at last
        await asyncio.get_running_loop().run_in_executor(None, el._thread.join, 60)
        assert not el._thread.is_alive()
        assert set(eng.requests) <= {"first"}, "the inbox was not taken into the engine after the stall"
    asyncio.run(scenario())


def test_the_watchdog_runs_the_stall_check(config):
    async def scenario():
        eng, el, first, queued = await _blocked_loop(config, stall_timeout_s=0.05)
        watch = asyncio.ensure_future(el.watch(interval_s=0.01))   # the step is held by the gate: it stalls
        answers = await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), ANSWER_WITHIN_S)
        assert all(isinstance(a, EngineDeadError) for a in answers)
        await asyncio.wait_for(watch, ANSWER_WITHIN_S)
        eng.gate.set()
    asyncio.run(scenario())


def test_a_request_the_engine_fails_to_add_fails_alone(config):
    class Picky(LLMEngine):
        def add_request(self, request_id, prompt_token_ids, params=None):
            if request_id == "bad":
                raise RuntimeError("cannot take this one")
            return super().add_request(request_id, prompt_token_ids, params)

    async def scenario():
        el = EngineLoop(Picky(config), asyncio.get_running_loop(), max_queue=16, idle_wait_s=0.01)
        el.start()
        with pytest.raises(RuntimeError, match="cannot take this one"):
            await asyncio.wait_for(el.submit("bad", [1, 2], LONG), ANSWER_WITHIN_S)
        stream = await el.submit("good", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
        outs = []
        while not (outs and outs[-1].finished):
            outs.append(await asyncio.wait_for(stream.get(), ANSWER_WITHIN_S))
        assert sum(len(o.new_token_ids) for o in outs) == 3 and el.alive
        el.stop()
    asyncio.run(scenario())
