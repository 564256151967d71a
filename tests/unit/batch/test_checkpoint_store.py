"""The gang's commit protocol, in one process: commits need every member's round, LATEST is the only
commit point, a crash before it leaves the previous commit in force, and results enter a chain once."""
from __future__ import annotations

import json
import os
import threading

import pytest

from tokenfleet_serving.batch import checkpoint_store as cs
from tokenfleet_serving.batch.checkpoint_store import CheckpointStore, StoreError
from tokenfleet_serving.batch.job import JobError, Member, num_rounds, read_items, run_member, shard

JOB = {"input": "x", "items": 4, "hosts": 2, "perRound": 1}


def write_items(path, n):
    path.write_text("".join(json.dumps({"x": i}) + "\n" for i in range(n)))
    return read_items(path)


def squares(items):
    return [{"square": i["x"] ** 2} for i in items]


def test_shards_and_rounds_cover_every_item_once():
    for n in range(1, 30):
        for hosts in range(1, 6):
            assert sorted(i for m in range(hosts) for i in shard(n, hosts, m)) == list(range(n))
            for per_round in range(1, 7):
                longest = max(len(shard(n, hosts, m)) for m in range(hosts))
                assert (num_rounds(n, hosts, per_round) - 1) * per_round < max(longest, 1) <= num_rounds(n, hosts, per_round) * per_round


def test_a_round_commits_only_once_every_member_staged_it(tmp_path):
    store = CheckpointStore(tmp_path)
    store.stage("run", 1, 0, [{"index": 0}])
    assert not store.staged("run", 1, 2)
    with pytest.raises(StoreError, match="not staged by all 2 members"):
        store.commit_round("run", 1, 2, None, JOB, finished=False)
    assert store.latest() is None
    store.stage("run", 1, 1, [{"index": 1}])
    first = store.commit_round("run", 1, 2, None, JOB, finished=False)
    assert store.latest() == first
    with pytest.raises(StoreError, match="needs round 2"):
        store.commit_round("run", 3, 2, first, JOB, finished=False)
    assert [r["index"] for r in store.results(first, 2)] == [0, 1]


def test_a_crash_before_the_commit_point_keeps_the_previous_commit(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    for m in range(2):
        store.stage("run", 1, m, [{"index": m}])
    first = store.commit_round("run", 1, 2, None, JOB, finished=False)
    for m in range(2):
        store.stage("run", 2, m, [{"index": 2 + m}])
    real = cs.write_atomic

    def crash_at_latest(path, data):
        if path.name == "LATEST":
            raise OSError("power cut")
        real(path, data)
    monkeypatch.setattr(cs, "write_atomic", crash_at_latest)
    with pytest.raises(OSError):
        store.commit_round("run", 2, 2, first, JOB, finished=True)
    monkeypatch.setattr(cs, "write_atomic", real)
    assert store.latest() == first                       # the half-made commit is invisible
    assert len(list((tmp_path / "commits").iterdir())) == 2


def test_resume_after_a_crash_commits_each_result_once(tmp_path, monkeypatch):
    """The leader dies at the commit point of round 3 of 5; the restarted gang recomputes round 3 and
    the final result holds every item once, with the right values."""
    items, digest = write_items(tmp_path / "in.jsonl", 10)
    store = CheckpointStore(tmp_path / "ck")
    commits = []
    real = cs.write_atomic

    def crash_third_commit(path, data):
        if path.name == "LATEST":
            commits.append(data)
            if len(commits) == 3:
                raise OSError("killed")
        real(path, data)
    monkeypatch.setattr(cs, "write_atomic", crash_third_commit)
    errors = []

    def member(m, attempt, resume):
        try:
            run_member(store, items, digest, Member(m, 2, attempt), 1, squares, resume=resume, poll_s=0.001, wait_s=2)
        except (OSError, TimeoutError) as e:
            errors.append((m, type(e).__name__))
    threads = [threading.Thread(target=member, args=(m, 0, False)) for m in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert (0, "OSError") in errors and store.latest().round == 2
    monkeypatch.setattr(cs, "write_atomic", real)
    computed = []

    def counting(items_):
        computed.extend(i["x"] for i in items_)
        return squares(items_)
    threads = [threading.Thread(target=lambda m=m: run_member(store, items, digest, Member(m, 2, 1), 1, counting,
                                                               resume=True, poll_s=0.001, wait_s=5)) for m in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(computed) == list(range(4, 10))        # rounds 1-2 (items 0-3) were not computed again
    result = [json.loads(line) for line in (tmp_path / "ck" / "RESULT.jsonl").read_text().splitlines()]
    assert [(r["index"], r["square"]) for r in result] == [(i, i * i) for i in range(10)]
    assert not (tmp_path / "ck" / "staging").exists() or not any((tmp_path / "ck" / "staging").iterdir())


def test_a_fresh_start_makes_a_new_chain_and_a_finished_job_is_not_redone(tmp_path):
    items, digest = write_items(tmp_path / "in.jsonl", 3)
    store = CheckpointStore(tmp_path / "ck")
    first = run_member(store, items, digest, Member(0, 1), 2, squares, resume=False)
    assert first.finished and first.round == 2
    again = run_member(store, items, digest, Member(0, 1, attempt=1), 2,
                       lambda _: pytest.fail("a finished job was computed again"), resume=True)
    assert again == first
    fresh = run_member(store, items, digest, Member(0, 1, attempt=2), 2, squares, resume=False)
    assert fresh.id != first.id and [c.id for c in store.chain(fresh)][0] != store.chain(first)[0].id


def test_resuming_another_jobs_checkpoints_is_refused(tmp_path):
    items, digest = write_items(tmp_path / "in.jsonl", 4)
    store = CheckpointStore(tmp_path / "ck")
    run_member(store, items, digest, Member(0, 1), 2, squares, resume=False)
    with pytest.raises(JobError, match="belongs to another job"):
        run_member(store, items, digest, Member(0, 2), 2, squares, resume=True)       # other hosts
    other, other_digest = write_items(tmp_path / "other.jsonl", 5)
    with pytest.raises(JobError, match="belongs to another job"):
        run_member(store, other, other_digest, Member(0, 1), 2, squares, resume=True)


def test_bad_input_lines_are_named(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"x": 1}\n\nnot json\n')
    with pytest.raises(JobError, match="line 3 is not JSON"):
        read_items(p)
    p.write_text('[1]\n')
    with pytest.raises(JobError, match="line 1 is not a JSON object"):
        read_items(p)
    p.write_text('\n')
    with pytest.raises(JobError, match="no items"):
        read_items(p)


def test_staged_rounds_of_other_attempts_are_cleared_by_the_leader(tmp_path):
    items, digest = write_items(tmp_path / "in.jsonl", 2)
    store = CheckpointStore(tmp_path / "ck")
    store.stage("old-a0-scratch", 1, 1, [{"index": 1, "square": 999}])      # a dead attempt's round
    head = run_member(store, items, digest, Member(0, 1), 1, squares, resume=False)
    assert [r["square"] for r in store.results(head, 1)] == [0, 1]
    assert not os.path.exists(tmp_path / "ck" / "staging" / "old-a0-scratch")
