"""A structured request's wait for its grammar holds no thread of the event loop's shared default executor: when
that executor is busy (slow compiles of other clients once sat in it, as did the router's /cache/blocks poll),
a structured request is still compiled and served."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tokenfleet_serving.engine.engine import EngineConfig, LLMEngine
from tokenfleet_serving.engine.sampling_params import SamplingParams
from tokenfleet_serving.engine.structured.compiler import CompileQueueFull
from tokenfleet_serving.engine.structured.spec import StructuredOutputSpec
from tokenfleet_serving.server.engine_loop import EngineLoop

ANSWER_WITHIN_S = 60


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_bytes=2 << 20, num_threads=1))


async def _finished(stream: asyncio.Queue) -> int:
    while True:
        out = await stream.get()
        assert not isinstance(out, BaseException), out
        if out.finished:
            return out.num_output_tokens


def test_a_structured_request_is_served_while_the_default_executor_is_busy(engine):
    async def scenario():
        loop = asyncio.get_running_loop()
        busy, release = ThreadPoolExecutor(max_workers=1), threading.Event()
        loop.set_default_executor(busy)
        blocked = loop.run_in_executor(None, release.wait, 120)     # its only thread: taken
        el = EngineLoop(engine, loop, max_queue=8, idle_wait_s=0.01)
        el.start()
        try:
            spec = StructuredOutputSpec("regex", "[a-z]{3}", param="structured_outputs.regex")
            stream = await asyncio.wait_for(el.submit("s", [1, 2, 3], SamplingParams(max_tokens=3, structured=spec),
                                                      client="a"), ANSWER_WITHIN_S)
            assert await asyncio.wait_for(_finished(stream), ANSWER_WITHIN_S) >= 1
        finally:
            release.set()
            await blocked
            el.stop(timeout=5)
    asyncio.run(scenario())


def test_a_client_past_its_pending_compiles_is_refused_and_others_are_not(engine):
    async def scenario():
        loop = asyncio.get_running_loop()
        el = EngineLoop(engine, loop, max_queue=64, idle_wait_s=0.01)
        el.start()
        compiler = engine.grammar_compiler
        try:
            specs = [StructuredOutputSpec("regex", f"[a-z]{{{i}}}x", param="structured_outputs.regex")
                     for i in range(1, compiler.max_pending_per_client + 2)]
            params = [SamplingParams(max_tokens=2, structured=s) for s in specs]
            first = [asyncio.ensure_future(el.submit(f"g{i}", [1, 2], p, client="greedy"))
                     for i, p in enumerate(params[:-1])]
            await asyncio.sleep(0)
            with pytest.raises(CompileQueueFull) as e:
                await el.submit("over", [1, 2], params[-1], client="greedy")
            assert e.value.status == 429 and e.value.param == "structured_outputs.regex"
            other = await asyncio.wait_for(el.submit("other", [1, 2], params[-1], client="polite"), ANSWER_WITHIN_S)
            for stream in [other, *await asyncio.gather(*first)]:
                await asyncio.wait_for(_finished(stream), ANSWER_WITHIN_S)
        finally:
            el.stop(timeout=5)
    asyncio.run(scenario())
