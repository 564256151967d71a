"""A batch member reports its latest commit on its metrics endpoint while it runs, and the leader leaves its
final commit in its termination message, where the operator reads it from the pod object."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenfleet_operator.pod_metrics import checkpoint_from_metrics
from tokenfleet_serving.batch.checkpoint_store import CheckpointStore
from tokenfleet_serving.batch.job import Member, Progress, read_items, run_member
from tokenfleet_serving.contract.termination import checkpoint_of

REPO = Path(__file__).resolve().parents[3]


def write_items(path, n):
    path.write_text("".join(json.dumps({"x": i}) + "\n" for i in range(n)))
    return read_items(path)


def squares(items):
    return [{"square": i["x"] ** 2} for i in items]


def test_the_members_metrics_report_the_latest_commit(tmp_path):
    import urllib.error
    import urllib.request

    from prometheus_client import Histogram

    from tokenfleet_serving.batch.main import serve_metrics
    items, digest = write_items(tmp_path / "in.jsonl", 3)
    progress = Progress()
    port = _free_port()
    progress.output_tokens = 7
    serve_metrics("127.0.0.1", port, progress, 2, Histogram("h_seconds", "h", registry=None))
    url = f"http://127.0.0.1:{port}"

    def get(path):
        with urllib.request.urlopen(url + path, timeout=5) as r:
            return r.read().decode()
    assert get("/health") == "ok\n"
    assert checkpoint_from_metrics(get("/metrics")) is None                # nothing committed yet
    head = run_member(CheckpointStore(tmp_path / "ck"), items, digest, Member(0, 1), 2, squares, resume=False,
                      progress=progress)
    text = get("/metrics")
    assert checkpoint_from_metrics(text)["latest"] == head.id
    assert "tokenfleet_batch_committed_round 2.0" in text and "tokenfleet_batch_output_tokens_total 7.0" in text
    with pytest.raises(urllib.error.HTTPError):
        get("/other")


def test_the_leader_leaves_its_final_commit_in_its_termination_message(tmp_path, tiny_model):
    items = tmp_path / "in.jsonl"
    items.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 2}) + "\n" for i in range(3)))
    message = tmp_path / "termination-log"
    done = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "batch", "--model", str(tiny_model), "--input",
                           str(items), "--checkpoint-dir", str(tmp_path / "ck"), "--port", "0", "--dtype", "float32"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TOKENFLEET_TERMINATION_LOG": str(message)})
    assert done.returncode == 0, done.stderr[-2000:]
    head = CheckpointStore(tmp_path / "ck").latest()
    # the pod object as the kubelet reports it once the container has exited
    pod = {"status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 0, "message": message.read_text()}}}]}}
    reported = checkpoint_of(pod)
    assert reported is not None and reported["latest"] == head.id and head.finished
    assert reported["savedAt"].endswith("Z")


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
