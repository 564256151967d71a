"""A work queue of object keys, with the semantics of client-go's rate-limited delaying queue.

- A key is queued at most once: adding a key that is already waiting does nothing (triggers coalesce).
- A key is processed by one worker at a time: a key added while it is being processed is queued again when
  that worker calls ``done``, so its next pass sees everything that happened during the current one.
- ``add_after`` queues a key once a delay has passed (a requeue, a backoff, a periodic pass); an earlier
  ``add_after`` of the same key wins.
- Keys in ``first`` (the gang pass) jump the line: they are queued in front of the others, so a burst of
  thousands of reconciles does not hold back the one pass that binds their pods.
- ``add_rate_limited`` is a failure's requeue: the delay doubles per consecutive failure of that key (from
  ``base_delay`` to ``max_delay``) until ``forget`` resets it.

The queue counts its adds, the triggers each key received, and how long keys waited and were worked on, for
the operator's metrics and benchmark.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Any

Key = Hashable


@dataclass
class QueueStats:
    adds: int = 0              # add() calls that queued a key
    coalesced: int = 0         # add() calls for a key already waiting
    processed: int = 0         # done() calls


class ShutDown(Exception):
    """get() on a queue that is shutting down."""


class WorkQueue:
    def __init__(self, name: str, *, base_delay: float = 0.5, max_delay: float = 300.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_wait: Callable[[str, float], None] | None = None, first: Collection[Key] = ()):
        self.name = name
        self.first = frozenset(first)
        self.base_delay, self.max_delay = base_delay, max_delay
        self.clock = clock
        self.on_wait = on_wait                  # (queue name, seconds a key waited) when a worker takes it
        self._cond = threading.Condition()
        self._queue: deque[Key] = deque()
        self._dirty: dict[Key, float] = {}      # waiting (or to be requeued) -> when it was first added
        self._processing: set[Key] = set()
        self._delayed: list[tuple[float, int, Key]] = []
        self._due: dict[Key, float] = {}        # the earliest pending add_after per key
        self._failures: dict[Key, int] = {}
        self._seq = itertools.count()
        self._shutdown = False
        self.stats = QueueStats()

    # ---- adding -----------------------------------------------------------------
    def add(self, key: Key) -> None:
        with self._cond:
            self._add_locked(key)

    def _add_locked(self, key: Key) -> None:
        if self._shutdown:
            return
        if key in self._dirty:
            self.stats.coalesced += 1
            return
        self.stats.adds += 1
        self._dirty[key] = self.clock()
        if key not in self._processing:
            self._enqueue_locked(key)

    def _enqueue_locked(self, key: Key) -> None:
        if key in self.first:
            self._queue.appendleft(key)
        else:
            self._queue.append(key)
        self._cond.notify()

    def add_after(self, key: Key, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        with self._cond:
            at = self.clock() + delay
            if self._due.get(key, float("inf")) <= at:
                return
            self._due[key] = at
            heapq.heappush(self._delayed, (at, next(self._seq), key))
            self._cond.notify()

    def add_rate_limited(self, key: Key) -> float:
        """Queue a failed key again after its backoff; returns the delay."""
        with self._cond:
            n = self._failures.get(key, 0)
            self._failures[key] = n + 1
        delay = min(self.max_delay, self.base_delay * 2 ** min(n, 30))
        self.add_after(key, delay)
        return delay

    def forget(self, key: Key) -> None:
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: Key) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    # ---- taking -----------------------------------------------------------------
    def _promote_due_locked(self) -> float | None:
        """Move due delayed keys into the queue; the seconds until the next one is due (None: none)."""
        now = self.clock()
        while self._delayed:
            at, _, key = self._delayed[0]
            if self._due.get(key) != at:            # superseded by an earlier add_after
                heapq.heappop(self._delayed)
                continue
            if at > now:
                return at - now
            heapq.heappop(self._delayed)
            del self._due[key]
            self._add_locked(key)
        return None

    def get(self, timeout: float | None = None) -> Key | None:
        """The next key to work on (the caller must call ``done``), or None after ``timeout`` seconds.
        Raises ShutDown once the queue shuts down."""
        deadline = None if timeout is None else self.clock() + timeout
        with self._cond:
            while True:
                if self._shutdown:
                    raise ShutDown(self.name)
                wait = self._promote_due_locked()
                if self._queue:
                    key = self._queue.popleft()
                    self._processing.add(key)
                    added = self._dirty.pop(key)
                    if self.on_wait is not None:
                        self.on_wait(self.name, self.clock() - added)
                    return key
                if deadline is not None:
                    left = deadline - self.clock()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def work(self, handle: Callable[[Key], None]) -> None:
        """A worker's loop: take a key, handle it, mark it done; until the queue shuts down."""
        while True:
            try:
                key = self.get()
            except ShutDown:
                return
            try:
                handle(key)
            finally:
                self.done(key)

    def done(self, key: Key) -> None:
        with self._cond:
            self._processing.discard(key)
            self.stats.processed += 1
            if key in self._dirty:                  # added again while it was processed
                self._enqueue_locked(key)

    # ---- state --------------------------------------------------------------------
    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            return {"queued": len(self._queue), "processing": len(self._processing), "delayed": len(self._due)}

    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()

    @property
    def shutting_down(self) -> bool:
        return self._shutdown
