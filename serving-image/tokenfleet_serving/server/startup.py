"""Where a server's start-up time goes: its phases, measured from the start of the process.

Phases, in order (``tokenfleet:startup_phase_seconds{phase}``, and one log line when the server is ready):

- ``weights_loaded``: config, safetensors weights and tokenizer read (``engine/loader.py``);
- ``kernels_ready``: the model built on them: CPU kernels loaded (compiled on a first start), weights
  fused and packed, the KV pool allocated;
- ``prefix_cache_loaded``: a prefix-cache checkpoint loaded (warm restart; absent without one);
- ``first_token``: one warm-up token generated: the server turns ready.

The process start is the kernel's (``/proc/self/stat``), so interpreter start-up and imports count too.
"""
from __future__ import annotations

import os
import time

PHASES = ("weights_loaded", "kernels_ready", "prefix_cache_loaded", "first_token")


def process_start_monotonic() -> float:
    """time.monotonic() at the moment this process started (Linux: from /proc; elsewhere: now)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started_ticks = int(fields[19])             # field 22 of stat(5), counted after the command name
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
        return time.monotonic() - max(age, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()


class StartupPhases:
    """Monotonic marks of the start-up phases, reported as seconds since the process started."""

    def __init__(self, process_start: float | None = None):
        self.process_start = process_start_monotonic() if process_start is None else process_start
        self.marks: dict[str, float] = {}

    def mark(self, phase: str, at: float | None = None) -> None:
        self.marks[phase] = time.monotonic() if at is None else at

    def seconds(self) -> dict[str, float]:
        return {p: round(self.marks[p] - self.process_start, 4) for p in PHASES if p in self.marks}
