"""The shared-memory collectives of ranks on one host (``engine/shm_channel.py``): sums, gathers and broadcasts
that match the plain computation, messages larger than a slot, and bounded failure when a peer never arrives
or exits. Ranks are threads here (each with its own view of the segment, as a process would have); the
processes case runs in test_tensor_parallel.py."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tokenfleet_serving.engine.shm_channel import ShmChannel, ShmPeerFailure, create_segment


@pytest.fixture
def channels():
    made: list[ShmChannel] = []

    def make(size: int, slot_bytes: int, timeout_s: float = 10.0) -> list[ShmChannel]:
        path = create_segment("test", size, slot_bytes)
        try:
            chans = [ShmChannel(path, r, size, timeout_s, slot_bytes) for r in range(size)]
        finally:
            os.unlink(path)
        for c in chans:
            c.ready()
        made.extend(chans)
        return chans

    yield make
    for c in made:
        c.close()


def on_every_rank(chans: list[ShmChannel], fn) -> list:
    results: list = [None] * len(chans)
    errors: list[BaseException] = []

    def body(r: int) -> None:
        try:
            results[r] = fn(chans[r], r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(chans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("in_c", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("size", [2, 3])
def test_all_reduce_sums_in_rank_order_on_every_rank_across_several_rounds(channels, size, in_c):
    chans = channels(size, slot_bytes=4096)             # 1,000 floats per slot: the tensors take several rounds
    if in_c:
        assert all(c.comm is not None for c in chans), "the compiled kernels did not load"
    else:
        for c in chans:
            c.comm = None                               # the Python rounds (no kernels, or not fp32)
    inputs = [[torch.randn(37, 129, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(5)]
              for r in range(size)]

    def reduce_all(chan, r):
        return [chan.all_reduce(x.clone()) for x in inputs[r]]

    got = on_every_rank(chans, reduce_all)
    for i in range(5):
        want = inputs[0][i].clone()
        for r in range(1, size):
            want += inputs[r][i]
        for r in range(size):
            assert torch.equal(got[r][i], want)          # the same bits on every rank


def test_gather_and_broadcast_carry_messages_larger_than_a_slot(channels):
    chans = channels(2, slot_bytes=1024)
    parts = [torch.arange(3000, dtype=torch.float32).view(30, 100) + 10_000 * r for r in range(2)]
    message = os.urandom(5000)

    wide = [torch.randn(3, 300, generator=torch.Generator().manual_seed(r)) for r in range(2)]  # a row > a slot

    def exchange(chan, r):
        gathered = chan.gather(parts[r])
        columns = chan.gather_columns(parts[r])         # 2 rows of 100 floats a round: 15 rounds
        wide_columns = chan.gather_columns(wide[r])
        empty = chan.broadcast_bytes(b"" if r == 0 else None)
        sent = chan.broadcast_bytes(message if r == 0 else None)
        return gathered, columns, wide_columns, empty, sent

    (g0, c0, w0, e0, b0), (g1, c1, w1, e1, b1) = on_every_rank(chans, exchange)
    assert g1 is None and all(torch.equal(a, b) for a, b in zip(g0, parts))
    assert c1 is None and torch.equal(c0, torch.cat(parts, dim=1))
    assert w1 is None and torch.equal(w0, torch.cat(wide, dim=1))
    assert e0 == e1 == b"" and b0 == b1 == message


def test_a_peer_that_never_arrives_fails_the_wait_within_the_timeout_naming_it(channels):
    chans = channels(2, slot_bytes=4096, timeout_s=1.0)
    for x in (torch.ones(8), torch.ones(8, dtype=torch.float64)):     # the compiled wait (fp32), Python's
        started = time.monotonic()
        with pytest.raises(ShmPeerFailure, match="rank 1 did not arrive within 1s"):
            chans[0].all_reduce(x)
        assert 1.0 <= time.monotonic() - started < 3.0


def test_a_peer_that_exited_fails_the_wait_at_once_naming_it(channels):
    chans = channels(2, slot_bytes=4096, timeout_s=60.0)
    peer = subprocess.Popen([sys.executable, "-c", "pass"])
    peer.wait()                                          # a zombie until reaped: wait() reaps it
    chans[0].peer_pids[1] = peer.pid
    started = time.monotonic()
    with pytest.raises(ShmPeerFailure, match=f"rank 1 \\(pid {peer.pid}\\) exited"):
        chans[0].broadcast_bytes(b"batch")
    assert time.monotonic() - started < 2.0


def test_a_zombie_peer_counts_as_exited(channels):
    chans = channels(2, slot_bytes=4096, timeout_s=60.0)
    peer = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:             # exited but not reaped: state Z in /proc
            with open(f"/proc/{peer.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.01)
        chans[0].peer_pids[1] = peer.pid
        with pytest.raises(ShmPeerFailure, match="rank 1 .* exited"):
            chans[0].all_reduce(torch.ones(4))
    finally:
        peer.wait()
