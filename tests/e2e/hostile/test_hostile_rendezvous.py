"""The hostile layer's rendezvous family (issue 48, item 9): foreign processes reach a tensor-parallel leader's
rendezvous port while it waits for its member, before the member itself.

One joins as rank 1 the way torch lets any process (a TCPStore client, then ``init_process_group``) and sends
a pickle through ``all_gather_object`` whose unpickling would create a marker file: the leader used to
unpickle it (code run in the server). Another sends the same pickle straight onto the port. Asserted: both are
refused, the marker never appears, the leader names the refused connections in its log, and the replica
still forms with its real member and answers a completion. Real ``tokenfleet serve`` processes (the leader
and a ``--headless`` member, two hosts' worth on one machine) sharing a rendezvous secret, as the operator's
pods share the service's replica key."""
from __future__ import annotations

import json
import os
import pickle
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness.support import http, wait_until

pytestmark = pytest.mark.slow

SECRET = "the replica's shared secret"

FOREIGN_RANK = """
import datetime, sys, torch.distributed as dist

class Planted:
    def __reduce__(self):
        return open, (sys.argv[2], "w")

t = datetime.timedelta(seconds=20)
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, t)
dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=t)
dist.all_gather_object([None, None], Planted())
print("FOREIGN RANK JOINED")
"""


class _Planted:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(log: Path, *args: str, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tokenfleet_cli", "serve", "--host", "127.0.0.1", "--port", "0", "--dtype", "float32",
           "--kv-cache-mb", "8", "--block-size", "16", "--served-model-name", "tiny", "--num-threads", "1", "--tensor-parallel-size", "2",
           "--nnodes", "2", "--master-addr", "127.0.0.1", "--distributed-timeout-seconds", "150", *args]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_foreign_processes_that_join_first_are_refused_and_nothing_they_send_is_unpickled(tiny_model, tmp_path):
    marker, raw_marker = tmp_path / "unpickled-by-a-rank", tmp_path / "unpickled-from-the-port"
    port = _free_port()
    env = {**os.environ, "TOKENFLEET_RENDEZVOUS_KEY": SECRET, "TOKENFLEET_LOG_LEVEL": "info"}
    leader_log, member_log = tmp_path / "leader.log", tmp_path / "member.log"
    leader = _serve(leader_log, "--model", str(tiny_model), "--master-port", str(port), env=env)
    member = None
    try:
        wait_until(lambda: _listening(port), 120, what="the leader's rendezvous port")
        foreign = subprocess.run([sys.executable, "-c", FOREIGN_RANK, str(port), str(marker)], capture_output=True,
                                 text=True, timeout=120)
        assert not marker.exists(), "the leader unpickled what the foreign rank sent"
        assert foreign.returncode != 0 and "FOREIGN RANK JOINED" not in foreign.stdout, foreign.stdout
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(pickle.dumps(_Planted(str(raw_marker))) * 4)
            s.settimeout(15)
            try:
                while s.recv(4096):                     # the leader's nonce, then the close
                    pass
            except ConnectionResetError:
                pass
        assert leader.poll() is None, leader_log.read_text()
        member = _serve(member_log, "--model", str(tiny_model), "--master-port", str(port), "--node-rank", "1",
                        "--headless", env=env)

        def http_port() -> int | None:
            found = re.search(r"listening on [\d.]+:(\d+)", leader_log.read_text())
            assert leader.poll() is None, leader_log.read_text()
            return int(found.group(1)) if found else None

        wait_until(lambda: http_port() is not None, 240, what="the leader serving, its member joined")
        base = f"http://127.0.0.1:{http_port()}"
        wait_until(lambda: http("GET", f"{base}/ready")[0] == 200, 120, what="the leader /ready")
        status, _, body = http("POST", f"{base}/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4,
                                                                  "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 4
        assert not marker.exists() and not raw_marker.exists()
        log = leader_log.read_text()
        assert log.count("rendezvous: refused the connection from 127.0.0.1:") >= 2, log
    finally:
        for p in (member, leader):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(20)
