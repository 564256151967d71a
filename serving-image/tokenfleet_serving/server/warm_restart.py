"""Warm restart: the server keeps its hottest prefix-cache blocks in its disk tier, and a replacement starts on it.

With ``--prefix-checkpoint-dir DIR`` the server's KV disk tier (``engine/kv_offload.py``) is its warm-restart
store: ``DIR/NAME`` (NAME is ``--prefix-checkpoint-name``, the replica's name, so a replacement finds the tier
of the replica it replaces), or ``--kv-offload-disk-path`` when that is given. The server

- **loads** at start, after the weights and before its warm-up: the disk tier indexes its block files (those of
  this model, revision, dtype, KV dtype and block size only), and the most recently written blocks, up to
  ``--prefix-checkpoint-max-mb`` and the free pool, are copied into the accelerator tier, so the first requests
  that share a cached prefix hit at once; the rest stay on disk and are copied back on their first hit;
- **saves** every ``--prefix-checkpoint-interval`` seconds and once more when it drains (SIGTERM), after its
  last request: the hottest cached blocks of the accelerator and host tiers, up to ``--prefix-checkpoint-max-mb``,
  that the disk tier does not hold yet (blocks evicted from the host tier are written there anyway).

There is one format: the disk tier's block files, authenticated with a key from the service's secret
(``engine/kv_block_file.py``). A corrupt, planted, foreign or forged block is never loaded, nor a file of the
wrong size read, nor a link followed (the log says which and why); nothing about the store can stop the server
from starting.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tokenfleet.serve.warm_restart")


@dataclass(frozen=True)
class WarmRestartConfig:
    directory: str
    name: str
    interval_s: float = 60.0
    max_bytes: int = 256 * 2**20
    revision: str | None = None       # default: a fingerprint of the weight files

    @property
    def store(self) -> str:
        """The disk tier's directory when ``--kv-offload-disk-path`` does not name one."""
        return str(Path(self.directory) / self.name)


@dataclass
class LoadResult:
    blocks: int = 0
    seconds: float = 0.0
    source: str | None = None
    refused: str | None = None        # why nothing was loaded, when a store was there


class PrefixCheckpointer:
    def __init__(self, config: WarmRestartConfig, engine):
        self.config = config
        self.engine = engine
        offload = engine.offload
        if offload is None or offload.disk is None:
            raise ValueError("warm restart needs the engine's disk tier (--prefix-checkpoint-dir gives it one)")
        self.disk = offload.disk
        self.max_blocks = max(1, config.max_bytes // offload.io.block_bytes)
        self._lock = asyncio.Lock()
        self.saves = 0

    def load(self) -> LoadResult:
        """Copy the store's newest blocks into the (idle) engine's accelerator tier; never raises."""
        t0 = time.monotonic()
        source = str(self.disk.path)
        if not self.disk.enabled:
            log.warning("warm restart: the store %s cannot be used, starting cold", source)
            return LoadResult(source=source, refused="disk tier switched off")
        on_disk = len(self.disk.hashes())
        if not on_disk:
            log.info("warm restart: no prefix-cache blocks of this model in %s yet; starting cold", source)
            return LoadResult(source=source)
        try:
            blocks = self.engine.load_from_disk_tier(self.max_blocks)
        except Exception as exc:  # noqa: BLE001 - a store must never keep the server from starting
            log.warning("warm restart: cannot load from %s (%s: %s); starting cold", source, type(exc).__name__, exc)
            return LoadResult(source=source, refused=f"{type(exc).__name__}: {exc}")
        seconds = time.monotonic() - t0
        log.info("warm restart: loaded %d prefix-cache blocks from %s (of %d there) in %.2f s", blocks, source,
                 on_disk, seconds)
        return LoadResult(blocks, seconds, source, None if blocks else "no usable block")

    def save(self, reason: str) -> int | None:
        """Write the hottest blocks the store lacks (blocking; call it off the event loop); returns how many, or
        None when there were none."""
        t0 = time.monotonic()
        written = self.engine.flush_kv_to_disk(self.max_blocks)
        if not written:
            return None
        self.saves += 1
        log.info("warm restart: saved %d prefix-cache blocks to %s (%s) in %.2f s", written, self.disk.path, reason,
                 time.monotonic() - t0)
        return written

    async def save_async(self, reason: str) -> int | None:
        async with self._lock:
            try:
                return await asyncio.to_thread(self.save, reason)
            except Exception as exc:  # noqa: BLE001 - a failed save leaves what was there; serving goes on
                log.warning("warm restart: saving the prefix cache failed (%s: %s)", type(exc).__name__, exc)
                return None

    async def run_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.save_async("periodic")
