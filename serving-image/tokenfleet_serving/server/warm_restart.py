"""Warm restart: the server saves its hottest prefix-cache blocks and a replacement loads them.

With ``--prefix-checkpoint-dir DIR`` the server

- loads ``DIR/NAME.tfprefix`` when it starts (NAME is ``--prefix-checkpoint-name``, the replica's name, so a
  replacement finds the file of the replica it replaces; without that file, the newest one in DIR), after the
  weights and before the warm-up, so the first requests that share a cached prefix hit at once;
- saves it every ``--prefix-checkpoint-interval`` seconds (skipped when the cache's hottest blocks did not
  change) and once more when it drains (SIGTERM), after the last request finished.

A checkpoint of another model, revision, dtype or KV layout is refused, and a corrupt or truncated one
ignored: the server then starts cold and its log says why (``engine/prefix_checkpoint.py``). Nothing about
a checkpoint can stop the server from starting.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tokenfleet_serving.engine.prefix_checkpoint import (
    SUFFIX,
    CheckpointUnusable,
    engine_identity,
    export_snapshot,
    import_snapshot,
    read_checkpoint,
    write_checkpoint,
)

log = logging.getLogger("tokenfleet.serve.warm_restart")


@dataclass(frozen=True)
class WarmRestartConfig:
    directory: str
    name: str
    interval_s: float = 60.0
    max_bytes: int = 256 * 2**20
    revision: str | None = None       # default: a fingerprint of the weight files


@dataclass
class LoadResult:
    blocks: int = 0
    seconds: float = 0.0
    source: str | None = None
    refused: str | None = None        # why nothing was loaded, when a file was there


class PrefixCheckpointer:
    def __init__(self, config: WarmRestartConfig, engine):
        self.config = config
        self.engine = engine
        self.identity = engine_identity(engine, config.revision)
        self.path = Path(config.directory) / f"{config.name}{SUFFIX}"
        bytes_per_block = engine.runner.kv_block_bytes(engine.kv.block_size)
        self.max_blocks = max(1, config.max_bytes // bytes_per_block)
        self._last_saved: tuple[bytes, ...] | None = None
        self._lock = asyncio.Lock()
        self.saves = 0

    def _source(self) -> Path | None:
        if self.path.is_file():
            return self.path
        others = [p for p in Path(self.config.directory).glob(f"*{SUFFIX}") if p.is_file()]
        return max(others, key=lambda p: p.stat().st_mtime) if others else None

    def load(self) -> LoadResult:
        """Load the checkpoint into the (idle) engine; never raises."""
        t0 = time.monotonic()
        try:
            source = self._source()
        except OSError as exc:
            log.warning("warm restart: cannot list %s (%s); starting cold", self.config.directory, exc)
            return LoadResult(refused=str(exc))
        if source is None:
            log.info("warm restart: no prefix checkpoint in %s yet; starting cold", self.config.directory)
            return LoadResult()
        try:
            snap, header = read_checkpoint(source, self.identity)
            blocks = import_snapshot(self.engine, snap)
        except CheckpointUnusable as exc:
            log.warning("warm restart: prefix checkpoint refused, starting cold: %s", exc)
            return LoadResult(source=str(source), refused=str(exc))
        except Exception as exc:  # noqa: BLE001 - a checkpoint must never keep the server from starting
            log.warning("warm restart: cannot load %s (%s: %s); starting cold", source, type(exc).__name__, exc)
            return LoadResult(source=str(source), refused=f"{type(exc).__name__}: {exc}")
        seconds = time.monotonic() - t0
        age = time.time() - float(header.get("created", time.time()))
        log.info("warm restart: loaded %d prefix-cache blocks from %s (written by %s, %.0f s ago) in %.2f s",
                 blocks, source, header.get("written_by", "?"), age, seconds)
        self._last_saved = tuple(snap.hashes)
        return LoadResult(blocks, seconds, str(source))

    def save(self, reason: str) -> int | None:
        """Write the checkpoint (blocking; call it off the event loop); returns its size in bytes, or None
        when the hottest blocks are those of the last save."""
        t0 = time.monotonic()
        snap = export_snapshot(self.engine, self.max_blocks)
        key = tuple(snap.hashes)
        if key == self._last_saved:
            return None
        size = write_checkpoint(self.path, snap, self.identity, written_by=self.config.name, reason=reason)
        self._last_saved = key
        self.saves += 1
        log.info("warm restart: saved %d prefix-cache blocks (%.1f MB) to %s (%s) in %.2f s", len(snap),
                 size / 2**20, self.path, reason, time.monotonic() - t0)
        return size

    async def save_async(self, reason: str) -> int | None:
        async with self._lock:
            try:
                return await asyncio.to_thread(self.save, reason)
            except Exception as exc:  # noqa: BLE001 - a failed save leaves the previous file; serving goes on
                log.warning("warm restart: saving the prefix checkpoint failed (%s: %s)", type(exc).__name__, exc)
                return None

    async def run_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.save_async("periodic")
