"""The collectives of ranks on one host and on CPU, over one shared-memory segment instead of loopback TCP.

Layout: a header of one 64-byte line per rank (its sequence number and its pid), then per rank two slots of
``slot_bytes`` each. Every collective is one numbered round ``s``: each rank writes what it contributes into
its slot ``s % 2``, publishes ``seq[rank] = s``, waits until every rank's ``seq >= s``, then reads the slots
it needs. A rank only overwrites slot ``s % 2`` in round ``s + 2``, after every rank published ``s + 1``,
i.e. after every rank finished reading round ``s``: two slots per rank make that safe without a second
barrier. Messages larger than a slot go in several rounds.

Sums add the ranks' slots in rank order on every rank, so every rank holds the same bits. Where the compiled
CPU kernels load, fp32 sums run in C (``cpu_kernels.Comm``, ``tf_comm_sum``: the same protocol, sharing this
rank's round counter), and the one-call decoder sums its row-parallel outputs there between its layers.

Ordering: the data is written before the sequence number and read after it (x86-64 keeps stores in order
and loads in order; the writes and reads go through separate library calls the interpreter cannot merge).

Bounds: a wait spins, then yields, then sleeps in short naps; every few milliseconds it checks that every
rank it waits for is still a live process (``/proc``) and that ``timeout_s`` has not passed since the wait
began. A rank that exited or stalls past the timeout raises ``ShmPeerFailure`` naming it.
"""
from __future__ import annotations

import mmap
import os
import time

import numpy as np
import torch

from . import cpu_kernels

LINE = 64                       # bytes per rank in the header (a cache line: no false sharing)
SLOT_BYTES = 2 << 20            # per rank and per parity; larger messages take several rounds


class ShmPeerFailure(RuntimeError):
    """A rank this one waited for exited or did not arrive within the timeout."""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def segment_bytes(size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return size * LINE + 2 * size * slot_bytes


def create_segment(tag: str, size: int, slot_bytes: int = SLOT_BYTES) -> str:
    """Create and reserve (so a full /dev/shm fails here, not later with SIGBUS) a zeroed segment; its path."""
    path = f"/dev/shm/tokenfleet-tp-{tag}-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, segment_bytes(size, slot_bytes))
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


class ShmChannel:
    """This rank's view of the segment at ``path``, shared by ``size`` ranks of one host."""

    def __init__(self, path: str, rank: int, size: int, timeout_s: float, slot_bytes: int = SLOT_BYTES):
        if size < 2:
            raise ValueError(f"a shared-memory channel joins 2 or more ranks, not {size}")
        self.rank, self.size, self.timeout_s, self.slot_bytes = rank, size, timeout_s, slot_bytes
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < segment_bytes(size, slot_bytes):
                raise ValueError(f"shared-memory segment {path} is smaller than {size} ranks need")
            self.map = mmap.mmap(fd, segment_bytes(size, slot_bytes))
        finally:
            os.close(fd)
        header = np.frombuffer(self.map, dtype=np.int64, count=size * LINE // 8).reshape(size, LINE // 8)
        self.seq, self.pid = header[:, 0], header[:, 1]
        base = torch.frombuffer(self.map, dtype=torch.uint8, offset=size * LINE, count=2 * size * slot_bytes)
        self.slots = base.view(2, size, slot_bytes)
        self._round = np.array([self.seq[rank]], dtype=np.int64)    # this rank's last round; C shares it
        self.pid[rank] = os.getpid()
        self.peer_pids = np.zeros(size, dtype=np.int64)            # set by ready(); C reads them too
        # the compiled kernels' view of the same channel (None without them)
        self.kernels = cpu_kernels.load()
        self.comm: cpu_kernels.Comm | None = None
        self._keep: tuple | None = None
        if self.kernels is not None:
            self.comm = cpu_kernels.Comm(rank=rank, size=size, slot_bytes=slot_bytes, header=header.ctypes.data,
                                         slots=base.data_ptr(), round=self._round.ctypes.data,
                                         pids=self.peer_pids.ctypes.data, timeout_s=timeout_s)
            self._keep = (header, base)          # what the struct points into

    @property
    def round(self) -> int:
        return int(self._round[0])

    @round.setter
    def round(self, value: int) -> None:
        self._round[0] = value

    def failure(self, e: cpu_kernels.CommFailure) -> ShmPeerFailure:
        """A failed wait inside the kernels, as ``_check_peers`` words it."""
        r = e.rank
        if e.code == cpu_kernels.COMM_PEER_EXITED:
            return ShmPeerFailure(f"rank {r} (pid {self.peer_pids[r]}) exited")
        return ShmPeerFailure(f"rank {r} did not arrive within {self.timeout_s:g}s")

    def ready(self) -> None:
        """After every rank attached (the caller's barrier): remember the others' pids."""
        self.peer_pids[:] = self.pid

    # ---- one round -------------------------------------------------------
    def _slot(self, parity: int, rank: int, nbytes: int) -> torch.Tensor:
        return self.slots[parity, rank, :nbytes]

    def _publish_and_wait(self, waits_for: range | list[int]) -> int:
        """Publish this round; wait until the ranks in ``waits_for`` published it too. Returns the parity."""
        self.round += 1
        s = self.round
        self.seq[self.rank] = s
        seq = self.seq
        if all(seq[r] >= s for r in waits_for):
            return s % 2
        started = time.monotonic()
        spins = 0
        next_check = started + 0.005
        while True:
            for r in waits_for:
                if seq[r] < s:
                    break
            else:
                return s % 2
            spins += 1
            if spins > 2000:
                now = time.monotonic()
                if now - started < 0.02:
                    os.sched_yield()
                else:
                    time.sleep(0.0002 if now - started < 1 else 0.002)
                if now >= next_check:
                    next_check = now + 0.005
                    self._check_peers(waits_for, s, now - started)

    def _check_peers(self, waits_for, s: int, waited: float) -> None:
        for r in waits_for:
            if self.seq[r] < s and not _alive(self.peer_pids[r]):
                raise ShmPeerFailure(f"rank {r} (pid {self.peer_pids[r]}) exited")
        if waited > self.timeout_s:
            late = [r for r in waits_for if self.seq[r] < s]
            raise ShmPeerFailure(f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not arrive "
                                 f"within {self.timeout_s:g}s")

    # ---- collectives -----------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (contiguous, CPU) over the ranks in place."""
        if self.comm is not None and x.dtype == torch.float32:
            assert self.kernels is not None
            try:
                return cpu_kernels.comm_sum_(self.kernels, self.comm, x)
            except cpu_kernels.CommFailure as e:
                raise self.failure(e) from None
        flat = x.view(-1).view(torch.uint8)
        everyone = range(self.size)
        item = x.element_size()
        step = self.slot_bytes - self.slot_bytes % item
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            n = piece.numel()
            p = (self.round + 1) % 2
            self._slot(p, self.rank, n).copy_(piece)
            self._publish_and_wait(everyone)
            out = piece.view(x.dtype)
            torch.add(self._slot(p, 0, n).view(x.dtype), self._slot(p, 1, n).view(x.dtype), out=out)
            for r in range(2, self.size):
                out.add_(self._slot(p, r, n).view(x.dtype))
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 gets every rank's ``x`` (same shape and dtype on every rank); the others get None."""
        flat = x.contiguous().view(-1).view(torch.uint8)
        parts = [torch.empty_like(flat) for _ in range(self.size)] if self.rank == 0 else None
        everyone = range(self.size)
        for start in range(0, flat.numel(), self.slot_bytes):
            piece = flat[start:start + self.slot_bytes]
            n = piece.numel()
            p = (self.round + 1) % 2
            self._slot(p, self.rank, n).copy_(piece)
            self._publish_and_wait(everyone)
            if parts is not None:
                for r in range(self.size):
                    parts[r][start:start + n].copy_(self._slot(p, r, n))
        return None if parts is None else [part.view(x.dtype).view(x.shape) for part in parts]

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's ``x`` [rows, n] (same shape and dtype on every rank) side by side,
        [rows, size * n]; the others get None. Each round carries as many whole rows as fit a slot; rank 0 copies
        the slots straight into their columns (and its own part from ``x``)."""
        rows, n = x.shape
        row_bytes = n * x.element_size()
        if row_bytes > self.slot_bytes:
            parts = self.gather(x)
            return None if parts is None else torch.cat(parts, dim=1)
        x = x.contiguous()
        out = torch.empty(rows, self.size * n, dtype=x.dtype) if self.rank == 0 else None
        everyone = range(self.size)
        per_round = self.slot_bytes // row_bytes
        for r0 in range(0, rows, per_round):
            piece = x[r0:r0 + per_round]
            k = piece.shape[0]
            p = (self.round + 1) % 2
            if out is None:
                self._slot(p, self.rank, k * row_bytes).view(x.dtype).view(k, n).copy_(piece)
            self._publish_and_wait(everyone)
            if out is not None:
                out[r0:r0 + k, :n].copy_(piece)
                for r in range(1, self.size):
                    out[r0:r0 + k, r * n:(r + 1) * n].copy_(self._slot(p, r, k * row_bytes).view(x.dtype).view(k, n))
        return out

    def broadcast_bytes(self, data: bytes | bytearray | None) -> bytes | bytearray:
        """Rank 0 sends ``data``; every rank returns it. The first round carries the length (8 bytes) and as much
        of the data as fits after it."""
        everyone = range(self.size)
        head = 8
        if self.rank == 0:
            assert data is not None
            total = len(data)
            writable = data if isinstance(data, bytearray) else bytearray(data)
            src = torch.frombuffer(writable, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
        got: bytearray | None = None
        offset = 0
        first = True
        while first or offset < total:
            p = (self.round + 1) % 2
            room = self.slot_bytes - (head if first else 0)
            if self.rank == 0:
                n = min(room, total - offset)
                slot = self._slot(p, 0, self.slot_bytes)
                if first:
                    slot[:head].view(torch.int64)[0] = total
                    slot[head:head + n].copy_(src[offset:offset + n])
                else:
                    slot[:n].copy_(src[offset:offset + n])
            self._publish_and_wait(everyone)
            if self.rank != 0:
                slot = self._slot(p, 0, self.slot_bytes)
                if first:
                    total = int(slot[:head].view(torch.int64)[0])
                    got = bytearray(total)
                n = min(room, total - offset)
                assert got is not None
                at = head if first else 0
                got[offset:offset + n] = slot[at:at + n].numpy().tobytes()
            offset += n
            first = False
        if self.rank == 0:
            assert data is not None
            return data
        return got if got is not None else bytearray()

    def close(self) -> None:
        self.comm = None
        self._keep = None
        self.slots = self.seq = self.pid = None  # type: ignore[assignment]
        try:
            self.map.close()
        except BufferError:     # a view still alive somewhere; the mapping goes with the process
            pass
