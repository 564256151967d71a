"""``tokenfleet serve`` as a process: bad arguments exit 2 with a clear one-line reason, which also lands in
the termination log Kubernetes reads (terminationMessagePath), as do a failed model load and a dead engine."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def serve(tmp_path, *args: str, model: str | None = None) -> tuple[subprocess.CompletedProcess, str | None]:
    log = tmp_path / "termination-log"
    env = dict(os.environ, TOKENFLEET_TERMINATION_LOG=str(log))
    proc = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "serve", "--model", model or str(tmp_path),
                           "--host", "127.0.0.1", "--port", "0", *args],
                          capture_output=True, text=True, timeout=180, env=env)
    return proc, (log.read_text() if log.exists() else None)


@pytest.mark.parametrize("args,reason", [
    (["--served-model-name=--api-key"], "'--api-key' is not a valid model name"),
    (["--served-model-name", "-v"], "expected one argument"),
    (["--served-model-name", "has space"], "'has space' is not a valid model name"),
    (["--served-model-name", "x" * 129], "is not a valid model name"),
    (["--data-parallel-size", "8"], "unrecognized arguments: --data-parallel-size 8"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: pipeline parallelism is not implemented"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1"),
    (["--body-timeout", "-1"], "argument --body-timeout: must be seconds in (0, 86400], got -1"),
])
def test_bad_arguments_exit_2_with_the_reason_in_the_termination_log(tmp_path, args, reason):
    proc, message = serve(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert reason in proc.stderr
    assert message is not None and "\n" not in message.strip()
    assert message.startswith("tokenfleet serve: error: ") and reason in message


def test_a_model_that_fails_to_load_exits_1_with_the_reason_in_the_termination_log(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    proc, message = serve(tmp_path)
    assert proc.returncode == 1
    assert message is not None and message.startswith("tokenfleet serve: loading the model failed:")
    assert "architectures" in message and "\n" not in message
