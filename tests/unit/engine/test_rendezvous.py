"""The tensor-parallel rendezvous (issue 48, item 9): only a process that proves the replica's key may use rank
0's store, nothing it sends is read before it has, the leader proves the key back, a taken port is named as
such, and what the ranks send each other (``wire.py``) is data that decoding can never turn into a call."""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from tokenfleet_serving.engine import wire
from tokenfleet_serving.engine.batch import SeqChunk, build_batch
from tokenfleet_serving.engine.distributed import ParallelConfig, RankFailure, join, listen_for_group
from tokenfleet_serving.engine.rendezvous import (
    NONCE_BYTES,
    SET,
    RendezvousRefused,
    RendezvousServer,
    RendezvousStore,
    derive_key,
    key_from_environment,
    send_request,
)
from tokenfleet_serving.engine.worker import RankSetup

KEY = derive_key("replica secret", "127.0.0.1:1")
TIMEOUT = datetime.timedelta(seconds=10)


class _Planted:
    """Unpickling this creates ``path``: the marker that a pickle was loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture
def server():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    srv = RendezvousServer(listener, KEY)
    yield srv, listener.getsockname()[1]
    srv.close()


def _closed_without_answer(s: socket.socket) -> bool:
    s.settimeout(10)
    try:
        return s.recv(1024) == b""
    except ConnectionResetError:                          # closed with what it sent still unread
        return True


def _wait(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_member_that_proves_the_key_uses_the_store(server):
    srv, port = server
    store = RendezvousStore("127.0.0.1", port, KEY, TIMEOUT)
    other = RendezvousStore("127.0.0.1", port, KEY, TIMEOUT)
    threading.Timer(0.3, lambda: other.set("late", b"x")).start()
    assert store.get("late") == b"x"                    # get waits for the key
    assert store.add("n", 2) == 2 and other.add("n", 3) == 5
    assert store.check(["late", "n"]) and not store.check(["missing"])
    assert store.compare_set("c", b"", b"first") == b"first"
    assert store.compare_set("c", b"wrong", b"second") == b"first"
    assert store.compare_set("c", b"first", b"second") == b"second"
    assert store.num_keys() == 3 and store.delete_key("c") and not store.delete_key("c")
    with pytest.raises(torch.distributed.DistStoreError, match="timed out after 0.2s waiting for never"):
        store.wait(["never"], datetime.timedelta(seconds=0.2))
    assert srv.refused == 0 and srv.proved == 2


def test_a_connection_that_sends_before_proving_the_key_is_refused_with_nothing_read(server, tmp_path):
    """A process that reaches the port first and sends a pickle (and a store request) is cut off at the
    handshake: the pickle is never loaded, nothing it asked for is stored, and members still join after."""
    srv, port = server
    marker = tmp_path / "unpickled"
    with socket.create_connection(("127.0.0.1", port)) as s:
        assert len(s.recv(NONCE_BYTES)) == NONCE_BYTES
        s.sendall(pickle.dumps(_Planted(str(marker))))
        assert _closed_without_answer(s)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.recv(NONCE_BYTES)
        send_request(s, SET, b"0//cpu//0/1", b"\x00" * 64)
        assert _closed_without_answer(s)
    _wait(lambda: srv.refused == 2)
    assert not marker.exists() and srv.data == {}
    store = RendezvousStore("127.0.0.1", port, KEY, TIMEOUT)
    store.set("k", b"v")
    assert srv.data == {"k": b"v"}


def test_a_member_with_another_key_is_refused(server):
    srv, port = server
    with pytest.raises(RendezvousRefused, match="refused this rank's proof of the replica's key"):
        RendezvousStore("127.0.0.1", port, derive_key("another secret", "127.0.0.1:1"), TIMEOUT)
    _wait(lambda: srv.refused == 1)
    assert srv.proved == 0


def test_a_process_posing_as_the_leader_is_found_out():
    """A process that took the leader's port cannot prove the key back; the member does not use it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def pose() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(os.urandom(NONCE_BYTES))
            conn.recv(64)
            conn.sendall(os.urandom(32))
            conn.recv(1)

    threading.Thread(target=pose, daemon=True).start()
    try:
        with pytest.raises(RendezvousRefused, match="is not this replica's leader"):
            RendezvousStore("127.0.0.1", listener.getsockname()[1], KEY, TIMEOUT)
    finally:
        listener.close()


def test_connections_that_never_prove_the_key_are_bounded_and_time_out(server, monkeypatch):
    from tokenfleet_serving.engine import rendezvous

    monkeypatch.setattr(rendezvous, "HANDSHAKE_S", 1.0)
    srv, port = server
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(rendezvous.MAX_PENDING + 3)]
    try:
        _wait(lambda: srv.refused >= 3, 0.9)             # past the bound: closed at once
        _wait(lambda: srv.refused == rendezvous.MAX_PENDING + 3, 5)     # the others at the handshake's bound
        RendezvousStore("127.0.0.1", port, KEY, TIMEOUT).set("k", b"v")
    finally:
        for s in idle:
            s.close()


def test_a_port_another_process_holds_is_named():
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    port = squatter.getsockname()[1]
    try:
        with pytest.raises(RankFailure, match=f"rendezvous on 127.0.0.1:{port}: port {port} is in use by another "
                                              f"process"):
            listen_for_group(ParallelConfig(2, master_port=port))
    finally:
        squatter.close()


def test_a_rank_without_a_key_does_not_join():
    with pytest.raises(RankFailure, match="no rendezvous key .* TOKENFLEET_RENDEZVOUS_KEY"):
        join(ParallelConfig(2, master_port=1), 1, torch.device("cpu"))


def test_hosts_derive_one_key_per_replica_from_their_shared_secret(monkeypatch, checkpoints):
    from tokenfleet_serving.serve_args import parse_serve_args
    from tokenfleet_serving.server.main import parallel_config

    argv = ["--model", str(checkpoints["llama"]), "--tensor-parallel-size", "2", "--nnodes", "2",
            "--master-addr", "10.0.0.5", "--master-port", "29500"]
    monkeypatch.delenv("TOKENFLEET_RENDEZVOUS_KEY", raising=False)
    monkeypatch.delenv("TOKENFLEET_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--nnodes > 1 needs the replica's rendezvous key .*TOKENFLEET_RENDEZVOUS_KEY"):
        parallel_config(parse_serve_args(argv))
    monkeypatch.setenv("TOKENFLEET_API_KEY", "the service's replica key")
    key = parallel_config(parse_serve_args(argv)).key
    assert key == derive_key("the service's replica key", "10.0.0.5:29500")
    assert key != derive_key("the service's replica key", "10.0.0.6:29500")      # another replica's leader
    monkeypatch.setenv("TOKENFLEET_RENDEZVOUS_KEY", "its own")
    assert key_from_environment("10.0.0.5:29500") == derive_key("its own", "10.0.0.5:29500")


# ---- what the ranks send each other ----------------------------------------------------------------------

def test_a_step_batch_and_the_setup_go_through_the_encoding_unchanged():
    chunks = [SeqChunk([5], 40 + i, list(range(i * 4, i * 4 + 4)), True) for i in range(8)]
    chunks.append(SeqChunk(list(range(30)), 0, [40, 41], True))
    batch = build_batch(chunks, 16, torch.device("cpu"))
    setup = RankSetup(torch.bfloat16, "int8", True, None, 1 << 20, 16, memory_utilization=0.5)
    odd = [torch.tensor(7).expand(1), torch.tensor(5).expand(3), torch.tensor(5).expand(0), torch.tensor(3),
           torch.arange(6).reshape(2, 3).t(), torch.zeros(0, 4)]      # expanded, empty, 0-d, strided
    message = ("forward", batch, False, {"x": np.arange(3, dtype=np.int32)}, setup, torch.ones(2, dtype=torch.bfloat16),
               odd)
    got = wire.decode(bytes(wire.encode(message)))
    assert got[0] == "forward" and got[2] is False and got[4] == setup
    assert np.array_equal(got[3]["x"], message[3]["x"]) and torch.equal(got[5], message[5])
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(got[6], odd))
    for name in ("input_ids", "positions", "slots", "logits_rows"):
        assert torch.equal(getattr(got[1], name), getattr(batch, name))
    assert got[1].sample_order == batch.sample_order and got[1].position_range == batch.position_range
    for mine, theirs in zip(got[1].groups, batch.groups):
        assert torch.equal(mine.block_ids, theirs.block_ids) and np.array_equal(mine.query_starts, theirs.query_starts)
        assert torch.equal(mine.mask, theirs.mask)


def test_what_is_not_data_cannot_be_sent():
    class Stranger:
        pass

    for obj in (Stranger(), np.array([object()]), {1: "not a str key"}, torch.zeros(2, dtype=torch.complex64)):
        with pytest.raises(TypeError):
            wire.encode(obj)


def test_frames_that_are_not_messages_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "unpickled"
    good = wire.encode(("forward", torch.arange(4)))
    header = b'{"D":"Popen","k":["args"],"v":[["touch","x"]]}'
    outside = b'{"A":["int64",[1000],0]}'
    for frame in (pickle.dumps(_Planted(str(marker))), len(header).to_bytes(4, "little") + header,
                  len(outside).to_bytes(4, "little") + outside, b'\x05\x00\x00\x00{"d":"cuda"}', good[:3],
                  len(b'{"T":[{"Q":1}]}').to_bytes(4, "little") + b'{"T":[{"Q":1}]}'):
        with pytest.raises(wire.WireError):
            wire.decode(frame)
    assert not marker.exists()


def test_a_rank_that_cannot_prove_the_key_over_the_group_is_named(tmp_path):
    """Defence in depth: once the group is formed, a rank that holds a place in it without the key (a process
    that reached a rank's own port) is named by every other rank before anything it sends is decoded."""
    script = (
        "import datetime, sys, torch, torch.distributed as dist\n"
        "from tokenfleet_serving.engine.distributed import ParallelConfig, ProcessGroup, RankFailure\n"
        "rank, port = int(sys.argv[1]), int(sys.argv[2])\n"
        "t = datetime.timedelta(seconds=30)\n"
        "store = dist.TCPStore('127.0.0.1', port, 2, rank == 0, t)\n"
        "dist.init_process_group('gloo', store=store, rank=rank, world_size=2, timeout=t)\n"
        "group = ProcessGroup(ParallelConfig(2, master_port=port), rank, torch.device('cpu'))\n"
        "try:\n"
        "    group.prove_membership(b'k' * 32 if rank == 0 else b'x' * 32)\n"
        "except RankFailure as e:\n"
        "    print(e); sys.exit(3)\n")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(port)], stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [3, 3]
    assert "rank 1 did not prove the replica's key" in outs[0]
    assert "rank 0 did not prove the replica's key" in outs[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
