"""KV offload: a host-memory tier and a disk tier under the accelerator's prefix cache.

The accelerator tier is the block pool (``block_pool.py``). When it evicts a cached block to reuse it, the
block's KV is first copied into the **host tier** (a preallocated buffer of block slots in host memory, pinned
on CUDA) under the same chained hash, with its parent's hash and its token ids; when the host tier is full its
least recently used block goes down to the **disk tier** (one file per block, written by a side thread). Each
tier is an LRU of its own; a block is looked up in the accelerator tier first, then host, then disk.

A prompt whose leading blocks miss the accelerator but hit a lower tier gets them **copied back** into freshly
allocated pool blocks, which are then cached blocks like any other (``kv_cache_manager.py``), instead of being
recomputed. The host tier stays inclusive: a block copied back keeps its host copy, so evicting it again costs
no copy.

What overlaps with compute and what does not:

- disk writes run on a writer thread (hashing and ``write`` release the GIL): the engine step only hands over
  a copy of the block;
- disk reads are prefetched on a reader thread when a request is added (``prefetch``), so while the request
  waits for admission (behind the running batch's steps) its blocks are read and checked; a block not read yet
  when the request is admitted is waited for, or read in the step;
- the copies between the pool and the host tier (out on eviction, in on a hit) run in the scheduling part of
  the step, before the forward pass: on CPU they are memory copies; on CUDA they are issued on the current
  stream (the forward pass that reuses an evicted block is ordered after its copy out), not on a side stream.

Disk block files (one per block; their format, their HMAC and how they are opened: ``kv_block_file.py``).
The config hash is the sha256 of the identity a block's KV depends on (model config, revision, dtype, KV
dtype, block size and layout, tensor-parallel rank and size; ``identity.engine_identity``). A file is
loaded only if it is a regular file of a block's size, its tag verifies under the tier key (a per-service
secret), its config hash is this engine's, its block hash is sha256(parent, tokens) and the name it was found
under: a corrupt, planted, foreign or forged block is never loaded (and a corrupt or planted one is deleted).
At start the disk tier indexes the files of its own config hash, so a replica that mounts the directory of the
replica it replaces (and has the same key) starts with the tier filled (warm restart, docs/recovery.md).

A disk path that cannot be written at start, or a write that fails (full disk, read-only, removed), switches
the disk tier off with one log line, ``tokenfleet:kv_offload_tier_enabled{tier="disk"} 0`` and an error
count; serving goes on with the tiers it has.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .kv_block_file import (
    BlockFileError,
    BlockRecord,
    LinkRefused,
    decode_block,
    encode_block,
    kv_bytes,
    open_directory,
    plausible_size,
    read_block_file,
    tier_key,
    write_block_file,
)

log = logging.getLogger("tokenfleet.engine.kv_offload")

TIERS = ("accelerator", "host", "disk")
SUFFIX = ".tfkv"
_PREFETCH_LIMIT = 8192          # disk reads kept ready at once


@dataclass(frozen=True)
class KVOffloadConfig:
    host_bytes: int = 0               # host-memory tier (0: none)
    disk_path: str | None = None      # disk tier directory (None: none)
    disk_bytes: int = 4 * 2**30       # disk tier budget
    key: bytes = field(default_factory=lambda: tier_key(None), repr=False)   # authenticates the disk tier's files

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_path is not None

    def check(self) -> None:
        if self.host_bytes < 0:
            raise ValueError(f"--kv-offload-host-mb must be >= 0, got {self.host_bytes >> 20}")
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ValueError("--kv-offload-disk-mb must be > 0 with --kv-offload-disk-path")


@dataclass
class TierCounters:
    """One tier's counters. queries/hits are prompt tokens (as vLLM's prefix_cache_*): a tier is queried for
    the tokens the tiers above it missed. Bytes and seconds: ``store`` into this tier, ``load`` out of it
    towards the accelerator."""

    queries: int = 0
    hits: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0
    load_bytes: int = 0
    load_seconds: float = 0.0
    blocks: int = 0                   # blocks held now
    capacity_blocks: int = 0
    enabled: bool = True
    errors: dict[str, int] = field(default_factory=dict)     # reason -> count (corrupt, foreign, write, ...)

    def copy(self) -> TierCounters:
        return TierCounters(self.queries, self.hits, self.store_bytes, self.store_seconds, self.load_bytes,
                            self.load_seconds, self.blocks, self.capacity_blocks, self.enabled, dict(self.errors))


class PoolIO:
    """Moves whole blocks in and out of the pool's tensors, each with the block index as dimension 3 (the KV
    values ``[layers, 2, kv_heads, num_blocks, block_size, head_dim]``, and the scales of a quantized KV cache
    where there are some). A block leaves the pool as one row of bytes: every tensor's part of it, in order."""

    BLOCK_DIM = 3

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = list(tensors)
        self.pool = self.tensors[0]
        self.parts = [t[:, :, :, 0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.parts)
        self.block_shape = (self.block_bytes,)

    @staticmethod
    def _order(t: torch.Tensor) -> tuple[int, ...]:
        return (3, 0, 1, 2, *range(4, t.dim()))

    def read(self, blocks: Sequence[int]) -> torch.Tensor:
        """[n, block_bytes] uint8 on the host."""
        n = len(blocks)
        if self.pool.device.type == "cpu":      # numpy: one thread, where torch's parallel copies of a few
            rows_np = []                        # blocks cost more in thread wake-ups than in bytes
            for t in self.tensors:
                a = np.take(_np(t), list(blocks), axis=self.BLOCK_DIM)
                rows_np.append(np.ascontiguousarray(np.moveaxis(a, self.BLOCK_DIM, 0)).reshape(n, -1).view(np.uint8))
            return torch.from_numpy(rows_np[0] if len(rows_np) == 1 else np.concatenate(rows_np, axis=1))
        index = torch.tensor(list(blocks), dtype=torch.long, device=self.pool.device)
        rows = [t.index_select(self.BLOCK_DIM, index).permute(self._order(t)).contiguous().view(n, -1)
                .view(torch.uint8) for t in self.tensors]
        data = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
        return data.cpu()

    def write(self, blocks: Sequence[int], data: torch.Tensor) -> None:
        if self.pool.device.type == "cpu":
            raw, offset = data.numpy(), 0
            for t, width in zip(self.tensors, self.parts):
                a = _np(t)
                rows = np.ascontiguousarray(raw[:, offset:offset + width]).view(a.dtype)
                a[:, :, :, list(blocks)] = np.moveaxis(rows.reshape(len(blocks), *a.shape[:3], *a.shape[4:]), 0,
                                                       self.BLOCK_DIM)
                offset += width
            return
        index = torch.tensor(list(blocks), dtype=torch.long, device=self.pool.device)
        if data.device != self.pool.device:
            data = data.to(self.pool.device, non_blocking=data.is_pinned())
        n, offset = len(blocks), 0
        for t, width in zip(self.tensors, self.parts):
            part = data[:, offset:offset + width].contiguous().view(t.dtype)
            shape = (n, *t.shape[:3], *t.shape[4:])
            inverse = (1, 2, 3, 0, *range(4, t.dim()))
            t.index_copy_(self.BLOCK_DIM, index, part.view(shape).permute(inverse))
            offset += width


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16, which numpy lacks, as int16: only bytes are moved)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


class HostTier:
    """Block slots in one host buffer, an LRU of hashes over them."""

    def __init__(self, capacity_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        self.capacity = capacity_blocks
        self.buf = torch.empty((capacity_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self._buf = _np(self.buf)
        self.free_slots = list(range(capacity_blocks - 1, -1, -1))
        self.entries: OrderedDict[bytes, tuple[int, bytes, tuple[int, ...]]] = OrderedDict()  # hash -> slot, origin

    def __contains__(self, h: object) -> bool:
        return h in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, h: bytes) -> None:
        self.entries.move_to_end(h)

    def store(self, records: Sequence[BlockRecord], data: torch.Tensor) -> list[BlockRecord]:
        """Keep ``records`` (their KV is ``data[i]``); returns the blocks pushed out for room, oldest first,
        each with a copy of its KV."""
        out: list[BlockRecord] = []
        src = _np(data)
        for i, r in enumerate(records):
            if r.hash in self.entries:
                self.entries.move_to_end(r.hash)
                continue
            if not self.free_slots:
                old, (slot, parent, tokens) = self.entries.popitem(last=False)
                out.append(BlockRecord(old, parent, tokens, torch.from_numpy(self._buf[slot].copy())))
                self.free_slots.append(slot)
            slot = self.free_slots.pop()
            self._buf[slot] = src[i]
            self.entries[r.hash] = (slot, r.parent, r.tokens)
        return out

    def get(self, hashes: Sequence[bytes]) -> tuple[list[BlockRecord], torch.Tensor]:
        """Records and a copy of their KV ([n, *block_shape]); each becomes the most recently used."""
        slots, records = [], []
        for h in hashes:
            slot, parent, tokens = self.entries[h]
            self.entries.move_to_end(h)
            slots.append(slot)
            records.append(BlockRecord(h, parent, tokens))
        return records, torch.from_numpy(self._buf[slots])

    def drop(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            entry = self.entries.pop(h, None)
            if entry is not None:
                self.free_slots.append(entry[0])

    def clear(self) -> None:
        self.entries.clear()
        self.free_slots = list(range(self.capacity - 1, -1, -1))


class DiskTier:
    """Block files in one directory (held open: every file is reached through its descriptor, no link
    followed; ``kv_block_file.py``): an LRU index by hash (file sizes against ``capacity_bytes``), a writer
    thread, a reader thread for prefetches. ``key`` authenticates the files; a block holds 1..``max_tokens``
    tokens."""

    def __init__(self, path: str, capacity_bytes: int, config_hash: bytes, block_shape: tuple[int, ...],
                 dtype: torch.dtype, counters: TierCounters, *, key: bytes, max_tokens: int):
        self.path, self.capacity_bytes = Path(path), capacity_bytes
        self.config_hash, self.block_shape, self.dtype = config_hash, block_shape, dtype
        self.key, self.max_tokens, self.kv_bytes = key, max_tokens, kv_bytes(block_shape, dtype)
        self.prefix = config_hash.hex()[:16]
        self.dir_fd: int | None = None
        self.c = counters
        self.lock = threading.Lock()
        self.index: OrderedDict[bytes, int] = OrderedDict()      # hash -> file size, least recently used first
        self.pending: dict[bytes, BlockRecord] = {}              # queued for writing (readable from memory)
        self.total_bytes = 0
        self.enabled = True
        self.queue: queue.Queue[BlockRecord | None] = queue.Queue()
        self.prefetched: OrderedDict[bytes, Future] = OrderedDict()
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        self.writer: threading.Thread | None = None
        try:
            self.dir_fd = open_directory(str(self.path))
            probe = f".probe-{os.getpid()}"
            write_block_file(self.dir_fd, probe, b"tokenfleet")
            os.unlink(probe, dir_fd=self.dir_fd)
        except LinkRefused as exc:
            self.switch_off("symlink", str(exc))
            return
        except OSError as exc:
            self.switch_off("unwritable", f"cannot write to {self.path} ({exc})")
            return
        self._scan()
        self.writer = threading.Thread(target=self._write_loop, name="kv-disk-write", daemon=True)
        self.writer.start()

    # ---- state -----------------------------------------------------------------------------------
    def switch_off(self, reason: str, why: str) -> None:
        """Stop using the disk tier (once): one log line, the metric, serving goes on."""
        with self.lock:
            if not self.enabled:
                return
            self.enabled = False
            self.c.enabled = False
            self.c.errors[reason] = self.c.errors.get(reason, 0) + 1
            self.index.clear()
            self.pending.clear()
            self.c.blocks = 0
        log.warning("KV offload: disk tier switched off, serving goes on without it: %s", why)

    def _name(self, h: bytes) -> str:
        return f"{self.prefix}-{h.hex()}{SUFFIX}"

    def _file(self, h: bytes) -> Path:
        return self.path / self._name(h)

    def _unlink(self, h: bytes) -> None:
        if self.dir_fd is None:
            return
        try:
            os.unlink(self._name(h), dir_fd=self.dir_fd)
        except OSError:
            pass

    def _scan(self) -> None:
        """Index this engine's block files: regular files of a block's size only (a link, or a file no block of
        this engine can be, is left out and counted; it is never read)."""
        assert self.dir_fd is not None
        found, refused, foreign = [], 0, 0
        with os.scandir(self.dir_fd) as entries:
            for entry in entries:
                if not entry.name.endswith(SUFFIX) or entry.name.startswith("."):
                    continue
                if not entry.name.startswith(self.prefix + "-"):
                    foreign += 1
                    continue
                try:
                    h = bytes.fromhex(entry.name[len(self.prefix) + 1:-len(SUFFIX)])
                    st = entry.stat(follow_symlinks=False)
                except (ValueError, OSError):
                    continue
                if len(h) != 32:
                    continue
                if not stat.S_ISREG(st.st_mode) or not plausible_size(st.st_size, self.kv_bytes, self.max_tokens):
                    refused += 1
                    continue
                found.append((st.st_mtime, h, st.st_size))
        found.sort()
        if refused:
            with self.lock:
                self.c.errors["corrupt"] = self.c.errors.get("corrupt", 0) + refused
            log.warning("KV offload: %d files in %s are links, not regular files, or not the size of a block of "
                        "this engine: never read", refused, self.path)
        with self.lock:
            for _, h, size in found:
                self.index[h] = size
                self.total_bytes += size
            self._enforce_capacity_locked()
            self.c.blocks = len(self.index)
        if found:
            log.info("KV offload: disk tier %s holds %d blocks of this model (%.1f MB)", self.path,
                     len(self.index), self.total_bytes / 2**20)
        if foreign:
            with self.lock:
                self.c.errors["foreign"] = self.c.errors.get("foreign", 0) + foreign
            log.warning("KV offload: %d blocks in %s are of another model, revision, dtype, KV dtype or block size: "
                        "ignored", foreign, self.path)

    def _enforce_capacity_locked(self) -> None:
        while self.total_bytes > self.capacity_bytes and self.index:
            h, size = self.index.popitem(last=False)
            self.total_bytes -= size
            self._unlink(h)

    def __contains__(self, h: object) -> bool:
        return self.enabled and (h in self.index or h in self.pending)

    def hashes(self) -> list[bytes]:
        with self.lock:
            return list(self.index) + [h for h in self.pending if h not in self.index]

    # ---- writing ---------------------------------------------------------------------------------
    def store(self, records: Sequence[BlockRecord]) -> None:
        """Queue blocks for writing (each with its KV); those already on disk become most recently used."""
        if not self.enabled:
            return
        with self.lock:
            for r in records:
                if r.hash in self.index:
                    self.index.move_to_end(r.hash)
                elif r.hash not in self.pending:
                    self.pending[r.hash] = r
                    self.queue.put(r)

    def _write_loop(self) -> None:
        while True:
            r = self.queue.get()
            if r is None:
                self.queue.task_done()
                return
            try:
                if self.enabled and r.hash in self.pending:
                    self._write(r)
            finally:
                self.queue.task_done()

    def _write(self, r: BlockRecord) -> None:
        started = time.perf_counter()
        assert r.data is not None
        raw = encode_block(self.config_hash, r, r.data, key=self.key)
        assert self.dir_fd is not None
        try:
            write_block_file(self.dir_fd, self._name(r.hash), raw)
        except OSError as exc:
            self.switch_off("write", f"writing {self._file(r.hash)} failed ({exc})")
            return
        with self.lock:
            self.pending.pop(r.hash, None)
            if not self.enabled:
                return
            self.index[r.hash] = len(raw)
            self.total_bytes += len(raw)
            self._enforce_capacity_locked()
            self.c.blocks = len(self.index)
            self.c.store_bytes += len(raw)
            self.c.store_seconds += time.perf_counter() - started

    def wait_written(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written (drain, tests); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # ---- reading ---------------------------------------------------------------------------------
    def _read(self, h: bytes) -> BlockRecord | None:
        started = time.perf_counter()
        path = self._file(h)
        try:
            if self.dir_fd is None:
                return None
            raw = read_block_file(self.dir_fd, self._name(h), self.kv_bytes, self.max_tokens)
            record = decode_block(raw, self.config_hash, h, self.block_shape, self.dtype, key=self.key)
        except FileNotFoundError:
            self._forget(h)
            return None
        except OSError as exc:
            log.warning("KV offload: cannot read %s (%s)", path, exc)
            self._forget(h)
            return None
        except BlockFileError as exc:
            log.warning("KV offload: disk block %s refused (%s): %s", path.name, exc.reason, exc)
            with self.lock:
                self.c.errors[exc.reason] = self.c.errors.get(exc.reason, 0) + 1
            self._forget(h, delete=exc.reason == "corrupt")
            return None
        with self.lock:
            self.c.load_bytes += len(raw)
            self.c.load_seconds += time.perf_counter() - started
            if h in self.index:
                self.index.move_to_end(h)
        return record

    def _forget(self, h: bytes, delete: bool = False) -> None:
        with self.lock:
            size = self.index.pop(h, None)
            if size is not None:
                self.total_bytes -= size
            self.c.blocks = len(self.index)
        if delete:
            self._unlink(h)

    def prefetch(self, hashes: Sequence[bytes]) -> None:
        """Start reading these blocks on the reader thread (they are waited for, or used, by ``load``)."""
        if not self.enabled:
            return
        for h in hashes:
            if h in self.prefetched or h not in self.index:
                continue
            self.prefetched[h] = self.reader.submit(self._read, h)
            while len(self.prefetched) > _PREFETCH_LIMIT:
                self.prefetched.popitem(last=False)

    def load(self, h: bytes) -> BlockRecord | None:
        """The block (with its KV), or None when it is gone or refused."""
        if not self.enabled:
            return None
        pending = self.pending.get(h)
        if pending is not None:
            return pending
        future = self.prefetched.pop(h, None)
        return future.result() if future is not None else self._read(h)

    def forget(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self.pending.pop(h, None)
            self._forget(h, delete=True)

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            self.queue.put(None)
            writer.join(timeout=10)
        self.reader.shutdown(wait=True, cancel_futures=True)     # a read is of one block's size at most
        if self.dir_fd is not None and (writer is None or not writer.is_alive()):
            os.close(self.dir_fd)          # (a writer still running keeps it: its number must not be reused)
            self.dir_fd = None


def config_hash(identity: dict[str, Any]) -> bytes:
    """sha256 of an engine identity (sorted JSON): what a disk block must have been written under."""
    import json

    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).digest()


class KVOffload:
    """The host and disk tiers of one engine, and the per-tier counters (``stats``)."""

    def __init__(self, config: KVOffloadConfig, io: PoolIO, identity: dict[str, Any]):
        config.check()
        self.config, self.io = config, io
        self.stats = {t: TierCounters() for t in TIERS}
        pin = io.pool.device.type == "cuda"
        self.host: HostTier | None = None
        if config.host_bytes > 0:
            capacity = config.host_bytes // io.block_bytes
            if capacity < 1:
                raise ValueError(f"--kv-offload-host-mb holds no KV block ({io.block_bytes} bytes each)")
            self.host = HostTier(capacity, io.block_shape, torch.uint8, pin)
            self.stats["host"].capacity_blocks = capacity
        else:
            self.stats["host"].enabled = False
        self.disk: DiskTier | None = None
        self.config_hash = config_hash(identity)
        if config.disk_path is not None:
            self.stats["disk"].capacity_blocks = config.disk_bytes // (io.block_bytes + 256)
            self.disk = DiskTier(config.disk_path, config.disk_bytes, self.config_hash, io.block_shape,
                                 torch.uint8, self.stats["disk"], key=config.key,
                                 max_tokens=io.pool.shape[PoolIO.BLOCK_DIM + 1])
        else:
            self.stats["disk"].enabled = False

    # ---- what each tier holds ----------------------------------------------------------------------
    def tier_of(self, h: bytes) -> str | None:
        if self.host is not None and h in self.host:
            return "host"
        if self.disk is not None and h in self.disk:
            return "disk"
        return None

    def lower_run(self, hashes: Sequence[bytes]) -> list[tuple[bytes, str]]:
        """The leading blocks of ``hashes`` that a lower tier holds, with the tier."""
        run = []
        for h in hashes:
            tier = self.tier_of(h)
            if tier is None:
                break
            run.append((h, tier))
        return run

    def host_hashes(self) -> list[str]:
        return [h.hex() for h in self.host.entries] if self.host is not None else []

    def disk_hashes(self) -> list[str]:
        return [h.hex() for h in self.disk.hashes()] if self.disk is not None and self.disk.enabled else []

    # ---- out of the accelerator --------------------------------------------------------------------
    def on_evict(self, evicted: Sequence[tuple[int, bytes, tuple[bytes, tuple[int, ...]]]]) -> None:
        """The pool is about to reuse these cached blocks (block, hash, (parent, tokens)): keep their KV below."""
        fresh = [(b, h, o) for b, h, o in evicted
                 if not (self.host is not None and h in self.host) and not (self.host is None and self.disk is not None
                                                                           and h in self.disk)]
        if self.host is not None:
            for _, h, _ in evicted:
                if h in self.host:
                    self.host.touch(h)
        if not fresh or (self.host is None and (self.disk is None or not self.disk.enabled)):
            return
        started = time.perf_counter()
        data = self.io.read([b for b, _, _ in fresh])
        records = [BlockRecord(h, o[0], o[1]) for _, h, o in fresh]
        if self.host is not None:
            down = self.host.store(records, data)
            c = self.stats["host"]
            c.store_bytes += len(fresh) * self.io.block_bytes
            c.store_seconds += time.perf_counter() - started
            c.blocks = len(self.host)
        else:
            down = [BlockRecord(r.hash, r.parent, r.tokens, data[i]) for i, r in enumerate(records)]
        if down and self.disk is not None:
            self.disk.store(down)

    def flush_to_disk(self, records: Sequence[BlockRecord]) -> int:
        """Write these blocks (with their KV) to the disk tier too (warm restart's save); returns how many
        were queued."""
        if self.disk is None or not self.disk.enabled:
            return 0
        todo = [r for r in records if r.hash not in self.disk]
        self.disk.store(todo)
        return len(todo)

    # ---- back into the accelerator -----------------------------------------------------------------
    def prefetch(self, hashes: Sequence[bytes]) -> None:
        """A request was added: start reading its leading disk-tier blocks."""
        if self.disk is None or not self.disk.enabled:
            return
        run = self.lower_run(hashes)
        self.disk.prefetch([h for h, tier in run if tier == "disk"])

    def fetch(self, run: Sequence[tuple[bytes, str]]) -> tuple[list[BlockRecord], torch.Tensor | None, list[str]]:
        """The KV of the leading blocks of ``run`` that can be had (a refused disk block ends it): records,
        their KV as one ``[n, *block_shape]`` host tensor, and each one's tier."""
        records: list[BlockRecord] = []
        parts: list[torch.Tensor] = []
        tiers: list[str] = []
        i = 0
        while i < len(run):
            h, tier = run[i]
            if tier == "host" and self.host is not None and h in self.host:
                j = i
                while j < len(run) and run[j][1] == "host" and run[j][0] in self.host:
                    j += 1
                recs, data = self.host.get([x for x, _ in run[i:j]])
                records += recs
                parts.append(data)
                tiers += ["host"] * len(recs)
                i = j
                continue
            record = self.disk.load(h) if self.disk is not None else None
            if record is None or record.data is None:
                break
            records.append(BlockRecord(record.hash, record.parent, record.tokens))
            parts.append(record.data.view(1, -1))
            tiers.append("disk")
            i += 1
        if not records:
            return [], None, []
        data = torch.from_numpy(np.concatenate([p.numpy() for p in parts])) if len(parts) > 1 else parts[0]
        return records, data, tiers

    def note_copied_in(self, tiers: Sequence[str], seconds: float) -> None:
        """Count a copy back into the accelerator: bytes per source tier, time shared by block count."""
        n = len(tiers)
        for tier in ("host", "disk"):
            k = sum(1 for t in tiers if t == tier)
            if k:
                c = self.stats[tier]
                if tier == "host":
                    c.load_bytes += k * self.io.block_bytes
                c.load_seconds += seconds * k / n

    def count_admission(self, prompt_tokens: int, cached_tokens: int, host_tokens: int, disk_tokens: int) -> None:
        """A request's first admission: its prompt tokens as queries and hits per tier."""
        s = self.stats
        disk_tokens = min(disk_tokens, cached_tokens)
        host_tokens = min(host_tokens, cached_tokens - disk_tokens)
        acc = cached_tokens - host_tokens - disk_tokens
        s["accelerator"].queries += prompt_tokens
        s["accelerator"].hits += acc
        if self.host is not None:
            s["host"].queries += prompt_tokens - acc
            s["host"].hits += host_tokens
        if self.disk is not None and self.disk.enabled:
            s["disk"].queries += prompt_tokens - acc - host_tokens
            s["disk"].hits += disk_tokens

    # ---- housekeeping ------------------------------------------------------------------------------
    def forget(self, hashes: Sequence[bytes]) -> None:
        if self.host is not None:
            self.host.drop(hashes)
            self.stats["host"].blocks = len(self.host)
        if self.disk is not None:
            self.disk.forget(hashes)

    def chains_from(self, root: bytes) -> list[bytes]:
        """Hashes in the lower tiers whose chain starts at ``root`` (host tier: by its parents; disk tier:
        unknown without reading, so every disk block whose parent is found is included as read)."""
        doomed: set[bytes] = {root}
        if self.host is not None:
            grown = True
            while grown:
                grown = False
                for h, (_, parent, _) in self.host.entries.items():
                    if h not in doomed and parent in doomed:
                        doomed.add(h)
                        grown = True
        doomed.discard(root)
        return list(doomed)

    def reset(self) -> None:
        if self.host is not None:
            self.host.clear()
            self.stats["host"].blocks = 0
        if self.disk is not None:
            with self.disk.lock:
                self.disk.index.clear()
                self.disk.total_bytes = 0
                self.disk.c.blocks = 0

    def snapshot(self) -> dict[str, TierCounters]:
        return {t: c.copy() for t, c in self.stats.items()}

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
