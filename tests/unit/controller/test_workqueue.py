"""The work queue's contract: a key waits once, runs on one worker at a time, is delayed and backed off."""
from __future__ import annotations

import threading

import pytest

from tokenfleet_operator.controller.workqueue import ShutDown, WorkQueue


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_waiting_key_is_queued_once_and_order_is_kept():
    q = WorkQueue("t")
    for key in ("a", "b", "a", "a", "c"):
        q.add(key)
    assert [q.get(0), q.get(0), q.get(0), q.get(0)] == ["a", "b", "c", None]
    assert q.stats.adds == 3 and q.stats.coalesced == 2


def test_a_key_of_first_jumps_the_line_also_when_it_comes_back_after_running():
    q = WorkQueue("t", first=("gang",))
    for key in ("a", "b", "gang", "c"):
        q.add(key)
    assert q.get(0) == "gang"
    q.add("gang")                      # asked for again while it runs
    q.add("d")
    q.done("gang")
    assert [q.get(0) for _ in range(6)] == ["gang", "a", "b", "c", "d", None]


def test_a_key_added_while_it_is_processed_runs_again_after_and_never_twice_at_once():
    q = WorkQueue("t")
    q.add("a")
    assert q.get(0) == "a"
    q.add("a")                         # a trigger during the pass
    assert q.get(0) is None            # not handed to a second worker while the first works on it
    q.done("a")
    assert q.get(0) == "a"             # but it runs once more afterwards
    q.done("a")
    assert q.get(0) is None


def test_the_earliest_delay_wins_and_due_keys_come_out():
    clock = Clock()
    q = WorkQueue("t", clock=clock)
    q.add_after("a", 10)
    q.add_after("a", 30)               # later: ignored
    q.add_after("b", 5)
    assert q.get(0) is None
    clock.t += 6
    assert q.get(0) == "b"
    clock.t += 5
    assert q.get(0) == "a"
    q.done("a")
    clock.t += 60
    assert q.get(0) is None            # the superseded 30 s entry does not fire again


def test_failures_back_off_exponentially_until_forgotten():
    q = WorkQueue("t", base_delay=1.0, max_delay=5.0, clock=Clock())
    assert [q.add_rate_limited("k") for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert q.failures("k") == 5
    q.forget("k")
    assert q.add_rate_limited("k") == 1.0


def test_get_blocks_until_a_key_arrives_and_shutdown_wakes_everyone():
    q = WorkQueue("t")
    got = []
    t = threading.Thread(target=lambda: got.append(q.get(5)))
    t.start()
    q.add("x")
    t.join(5)
    assert got == ["x"]
    waiting = threading.Thread(target=lambda: pytest.raises(ShutDown, q.get))
    waiting.start()
    q.shutdown()
    waiting.join(5)
    assert not waiting.is_alive()
    with pytest.raises(ShutDown):
        q.get(0)


def test_wait_time_is_reported():
    clock = Clock()
    waits = []
    q = WorkQueue("t", clock=clock, on_wait=lambda name, s: waits.append((name, s)))
    q.add("a")
    clock.t += 2.5
    q.get(0)
    assert waits == [("t", 2.5)]


def test_a_worker_handles_keys_marks_them_done_and_stops_at_shutdown():
    q = WorkQueue("t")
    handled = []

    def handle(key):
        handled.append(key)
        if key == "boom":
            raise RuntimeError("a handler that fails still marks its key done")

    worker = threading.Thread(target=lambda: pytest.raises(RuntimeError, q.work, handle))
    q.add("boom")
    worker.start()
    worker.join(5)
    assert handled == ["boom"] and q.snapshot()["processing"] == 0
    ok = threading.Thread(target=q.work, args=(handled.append,))
    ok.start()
    q.add("a")
    for _ in range(100):
        if "a" in handled:
            break
        threading.Event().wait(0.02)
    q.shutdown()
    ok.join(5)
    assert not ok.is_alive() and handled == ["boom", "a"]
