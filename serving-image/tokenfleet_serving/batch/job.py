"""One gang member's part of a batch job: its shard, round by round, checkpointed exactly once.

The job is a list of items (the input file's lines). Member ``m`` of ``hosts`` owns the items whose
index is ``m`` modulo ``hosts``; round ``r`` (1-based) covers positions ``(r-1)K .. rK-1`` of every
member's shard, K items per round. The job has ``ceil(ceil(items / hosts) / K)`` rounds, the same for
every member, so a member whose shard is shorter stages empty rounds at the end.

Every member computes its round and stages the results. The leader (member 0) then waits until all
members have staged the round and commits it (``CheckpointStore.commit_round``): rounds are committed
in order, each only once every member's part of it is on disk. The other members do not wait for the
commits until their last round. A gang that restarts after a failure resumes after the latest commit
(all members read the same one), so a result is computed again only if its round was not committed, and
committed at most once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint_store import CheckpointStore, Commit, StoreError

log = logging.getLogger("tokenfleet.batch")

# items of one round of this member -> one result per item (dicts, JSON-serialisable), in order
Compute = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


class JobError(ValueError):
    """Bad input or settings: a clear message, no retry will help."""


def read_items(path: str | Path) -> tuple[list[dict[str, Any]], str]:
    """The input file's items (one JSON object per non-empty line) and the file's SHA-256."""
    data = Path(path).read_bytes()
    items = []
    for number, line in enumerate(data.decode().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise JobError(f"{path}: line {number} is not JSON ({e})") from None
        if not isinstance(item, dict):
            raise JobError(f"{path}: line {number} is not a JSON object")
        items.append(item)
    if not items:
        raise JobError(f"{path}: no items")
    return items, hashlib.sha256(data).hexdigest()


def shard(num_items: int, hosts: int, member: int) -> list[int]:
    return list(range(member, num_items, hosts))


def num_rounds(num_items: int, hosts: int, per_round: int) -> int:
    longest = -(-num_items // hosts)
    return max(1, -(-longest // per_round))


@dataclass(frozen=True)
class Member:
    index: int
    hosts: int
    attempt: int = 0
    revision: str = "local"

    @property
    def leader(self) -> bool:
        return self.index == 0


@dataclass
class Progress:
    """What a member reports (its metrics): rounds done and committed, the latest commit, tokens made."""
    rounds: int = 0
    computed_items: int = 0
    committed_round: int = 0
    latest: Commit | None = None
    output_tokens: int = 0


def run_member(store: CheckpointStore, items: list[dict[str, Any]], digest: str, member: Member, per_round: int,
               compute: Compute, *, resume: bool, progress: Progress | None = None, poll_s: float = 0.05,
               wait_s: float = 3600.0, on_commit: Callable[[float], None] | None = None) -> Commit:
    """Run this member's rounds; returns the job's final commit. ``resume``: continue after the latest
    commit (a restarted gang); otherwise start a new chain from round 1 (LATEST moves to it at its first
    commit). Raises JobError when the store's latest commit belongs to another job, and TimeoutError
    when the other members do not stage a round (or the leader does not commit) within ``wait_s``.
    ``on_commit`` gets the seconds each commit took the leader, from staging its own part."""
    progress = progress if progress is not None else Progress()
    job = {"input": digest, "items": len(items), "hosts": member.hosts, "perRound": per_round}
    total = num_rounds(len(items), member.hosts, per_round)
    base = store.latest() if resume else None
    if base is not None and base.job != job:
        raise JobError(f"the latest checkpoint {base.id} belongs to another job ({base.job}); this one is {job}: "
                       "use a new checkpoint store, or the same input, hosts and items per round")
    run = f"{member.revision}-a{member.attempt}-{base.id if base else 'scratch'}"
    progress.latest, progress.committed_round = base, base.round if base else 0
    if member.leader:
        store.clear_staging(keep=run)
    if base is not None:
        log.info("member %d resumes after %s (round %d of %d)", member.index, base.id, base.round, total)
    mine = shard(len(items), member.hosts, member.index)
    head = base
    for round_ in range((base.round if base else 0) + 1, total + 1):
        positions = mine[(round_ - 1) * per_round: round_ * per_round]
        results = compute([items[i] for i in positions]) if positions else []
        if len(results) != len(positions):
            raise RuntimeError(f"compute returned {len(results)} results for {len(positions)} items")
        store.stage(run, round_, member.index, [{"index": i, **r} for i, r in zip(positions, results)])
        progress.rounds += 1
        progress.computed_items += len(positions)
        if member.leader:
            started = time.monotonic()
            _wait(lambda r=round_: store.staged(run, r, member.hosts), wait_s, poll_s,
                  f"round {round_}: not every member staged it")
            head = store.commit_round(run, round_, member.hosts, head, job, finished=round_ == total)
            progress.latest, progress.committed_round = head, round_
            if on_commit is not None:
                on_commit(time.monotonic() - started)
            log.info("committed %s (round %d of %d)", head.id, round_, total)
    if member.leader:
        if head is None or not head.finished:
            raise StoreError("the leader ended without the final commit")
        store.write_result(head, member.hosts)
        store.clear_staging(keep="")
        return head
    if base is not None and base.finished:          # the job was done before this attempt
        return base

    def final() -> Commit | None:
        c = store.latest()
        return c if c is not None and c.finished and c.run == run else None
    head = _wait(final, wait_s, poll_s, "the leader did not commit the last round")
    progress.latest, progress.committed_round = head, head.round
    return head


def _wait(done: Callable[[], Any], timeout_s: float, poll_s: float, what: str) -> Any:
    """Poll ``done`` until it returns something true, and return that."""
    deadline = time.monotonic() + timeout_s
    while not (value := done()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        time.sleep(poll_s)
    return value
