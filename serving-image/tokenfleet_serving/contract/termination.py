"""The termination message: what a container leaves behind, where Kubernetes and the operator read it.

A container's termination message is the file at ``terminationMessagePath`` (default
``/dev/termination-log``, created by the kubelet); Kubernetes copies it into
``status.containerStatuses[].state.terminated.message`` (at most 4,096 bytes). tokenfleet's processes write
one line there before they exit:

- ``tokenfleet serve`` and ``tokenfleet route`` that cannot start or whose engine died: why (bad arguments
  exit 2, a model that does not load exits 1), so the operator can show why a pod crash-loops;
- the leader of a batch gang that finished: ``{"checkpoint": ID, "savedAt": RFC3339}``, its final commit,
  which the operator reads from the pod object into ``status.checkpoint`` (no scrape, no waiting).

``write_termination_message`` writes to ``$TOKENFLEET_TERMINATION_LOG`` when set (created if needed; the local
pod runner points it at a file it reads back), else to ``/dev/termination-log`` only when that file already
exists and is writable (outside a pod nothing is written), and never fails the caller.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn

DEFAULT_PATH = "/dev/termination-log"
# The exit code of a configuration the process cannot take (bad flags, files or input): restarting cannot help,
# so the operator fails the Slice at once (its restartPolicy.failOnExitCodes defaults to this code).
CONFIGURATION_EXIT_CODE = 2
ENV = "TOKENFLEET_TERMINATION_LOG"
MAX_BYTES = 4096


def termination_log_path() -> str | None:
    explicit = os.environ.get(ENV)
    if explicit:
        return explicit
    if os.path.isfile(DEFAULT_PATH) and os.access(DEFAULT_PATH, os.W_OK):
        return DEFAULT_PATH
    return None


def write_termination_message(message: str) -> str | None:
    """Write ``message`` as one line (at most 4,096 bytes); returns the path written, or None."""
    path = termination_log_path()
    if path is None:
        return None
    line = " ".join(message.split())
    data = line.encode("utf-8", errors="replace")[:MAX_BYTES]
    try:
        with open(path, "wb") as f:
            f.write(data.decode("utf-8", errors="ignore").encode("utf-8"))
    except OSError:
        return None
    return path


class ArgumentParser(argparse.ArgumentParser):
    """argparse that also leaves its error, as one line, in the termination log before exiting 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        text = f"{self.prog}: error: {message}"
        write_termination_message(text)
        self.exit(CONFIGURATION_EXIT_CODE, text + "\n")


def write_checkpoint(checkpoint: str, saved_at: str) -> bool:
    """A batch leader's final commit, for the operator."""
    return write_termination_message(json.dumps({"checkpoint": checkpoint, "savedAt": saved_at},
                                                separators=(",", ":"))) is not None


def checkpoint_of(pod: dict[str, Any]) -> dict[str, str] | None:
    """{latest, savedAt} from a finished pod's termination message, if it left one."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        message = ((status.get("state") or {}).get("terminated") or {}).get("message")
        if not message:
            continue
        try:
            data = json.loads(message)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("checkpoint"), str) and isinstance(data.get("savedAt"), str):
            return {"latest": data["checkpoint"], "savedAt": data["savedAt"]}
    return None
