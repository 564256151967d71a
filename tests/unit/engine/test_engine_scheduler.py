"""Scheduler without a model: token budget, caps, FCFS, chunking, preemption, abort."""
from __future__ import annotations

from tokenfleet_serving.engine.kv_cache_manager import KVCacheManager
from tokenfleet_serving.engine.request import Request, RequestStatus
from tokenfleet_serving.engine.sampling_params import SamplingParams
from tokenfleet_serving.engine.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size))


def req(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=100))


def execute(sched: Scheduler, scheduled) -> None:
    """Stand-in for the model: advance computed tokens, append a token when a sequence is complete."""
    for r, n in scheduled:
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(1)


def test_token_budget_and_chunked_prefill():
    s = make(max_num_batched_tokens=10)
    a, b = req("a", 25), req("b", 3)
    s.add(a), s.add(b)
    step = s.schedule()
    assert [(r.request_id, n) for r, n in step] == [("a", 10)]
    execute(s, step)
    step = s.schedule()
    assert [(r.request_id, n) for r, n in step] == [("a", 10)]
    execute(s, step)
    step = s.schedule()                      # a finishes its prompt (5), b gets the rest of the budget
    assert [(r.request_id, n) for r, n in step] == [("a", 5), ("b", 3)]
    execute(s, step)
    assert [(r.request_id, n) for r, n in s.schedule()] == [("a", 1), ("b", 1)]
    assert s.counters.num_chunked_prefills == 2


def test_without_chunked_prefill_a_long_prompt_waits_for_a_full_budget():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add(req("a", 8)), s.add(req("b", 8))
    assert [(r.request_id, n) for r, n in s.schedule()] == [("a", 8)]


def test_max_num_seqs_cap_and_fcfs_order():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", 3))
    step = s.schedule()
    assert [r.request_id for r, _ in step] == ["r0", "r1"] and len(s.waiting) == 2
    execute(s, step)
    s.finish(s.running[0], "stop")
    step = s.schedule()
    assert [r.request_id for r, _ in step] == ["r1", "r2"]


def test_preemption_evicts_the_newest_and_requeues_it_first():
    s = make(num_blocks=4, block_size=4)
    a, b = req("a", 7), req("b", 7, start=100)
    s.add(a), s.add(b)
    execute(s, s.schedule())                 # both hold 2 blocks, pool is full
    assert s.kv.pool.num_free == 0
    execute(s, s.schedule())                 # 8 tokens each: still fits in 2 blocks
    step = s.schedule()                      # a needs a third block: b is preempted
    assert [r.request_id for r, _ in step] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert s.counters.num_preemptions == 1 and len(s.kv.block_tables["a"]) == 3


def test_preempting_the_only_request_leaves_it_waiting():
    s = make(num_blocks=2, block_size=4)
    a = req("a", 8)
    s.add(a)
    execute(s, s.schedule())
    assert s.schedule() == [] and a.status is RequestStatus.WAITING and s.kv.pool.num_free == 2


def test_abort_frees_blocks_immediately():
    s = make(num_blocks=8)
    a, b = req("a", 10), req("b", 10, start=100)
    s.add(a), s.add(b)
    execute(s, s.schedule())
    assert s.kv.pool.num_free == 2
    s.finish(a, "abort")
    assert s.kv.pool.num_free == 5 and a.status is RequestStatus.FINISHED and a not in s.running
    s.finish(b, "abort")
    assert s.kv.pool.num_free == 8 and not s.has_unfinished()


def test_waiting_request_aborted_before_scheduling():
    s = make()
    a = req("a", 5)
    s.add(a)
    s.finish(a, "abort")
    assert s.schedule() == [] and not s.has_unfinished()
