"""Tensor parallelism across processes: the group of ranks, how a rank joins it, and what rank 0 sends.

A replica of world size ``tp`` (``pp`` > 1 is not built: refused by ``ParallelConfig.check``) spans ``nnodes``
hosts, each running ``world_size / nnodes`` ranks, one process per local accelerator (or per share of the
CPU cores). Global rank = node_rank * local_ranks + local index. Rank 0 serves the API, schedules and
samples; before each forward pass it broadcasts the step's batch, and every rank runs the forward pass over
its shards (``model_runner.py``). Backend: gloo on CPU, NCCL on CUDA; when every rank is a CPU process of
this host, the per-step collectives (broadcast, all-reduce, gather) go over one shared-memory segment
instead (``shm_channel.py``), and gloo keeps the join and the identity check.

Bounds: joining and every collective are bounded by ``timeout_s`` (a member that cannot reach the leader
exits within it, naming its rank and the address it waited for); an idle rank 0 sends a keepalive every
``timeout_s / 4`` so that the followers' wait for the next batch is bounded too. A rank that dies breaks the
others' next collective (gloo: at once, the connection closes; shared memory: at once, its process is gone
from ``/proc``; otherwise at the timeout): ``RankFailure``.

Joining is authenticated (``rendezvous.py``): the group forms through rank 0's store, which serves only
connections that prove the replica's key (an HMAC challenge and response, checked before anything else a
connecting process sends is read); once the group is formed, every rank proves the key again over the
group's own connections, so that no process that reached a rank's port in the meantime holds a rank. What
the ranks then send each other is data in ``wire.py``'s encoding, never pickles.

At join the ranks exchange the checkpoint identity (revision, or a fingerprint of the weight files, and the
sha256 of config.json); any difference from rank 0's is refused on every rank, naming both.
"""
from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import wire
from .rendezvous import RendezvousRefused, RendezvousServer, RendezvousStore
from .shm_channel import ShmChannel, create_segment

log = logging.getLogger("tokenfleet.distributed")


class RankFailure(RuntimeError):
    """A rank of the replica is gone, a collective timed out, or a rank could not join: the replica is broken
    and must restart as a whole."""


class ParallelConfigError(ValueError):
    """Parallel flags that cannot work together; the message names the flag."""


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 60.0
    # the replica's rendezvous key (rendezvous.py); None: a single-host leader makes a random one for its ranks
    key: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_ranks(self) -> int:
        return self.world_size // self.nnodes

    def global_rank(self, local_index: int) -> int:
        return self.node_rank * self.local_ranks + local_index

    @property
    def address(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def check(self) -> None:
        """Raise ParallelConfigError naming the flag at fault."""
        if self.pipeline_parallel_size != 1:
            raise ParallelConfigError(
                f"--pipeline-parallel-size {self.pipeline_parallel_size}: pipeline parallelism is not implemented "
                f"yet; use --tensor-parallel-size (tensor parallelism) across the replica's accelerators")
        for flag, value in (("--tensor-parallel-size", self.tensor_parallel_size), ("--nnodes", self.nnodes)):
            if value < 1:
                raise ParallelConfigError(f"{flag} must be >= 1, got {value}")
        if self.world_size % self.nnodes:
            raise ParallelConfigError(f"--nnodes {self.nnodes} does not divide the world size "
                                      f"{self.world_size} (--tensor-parallel-size x --pipeline-parallel-size)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ParallelConfigError(f"--node-rank {self.node_rank} is not in [0, --nnodes {self.nnodes})")
        if not 0 < self.master_port < 65536:
            raise ParallelConfigError(f"--master-port must be in [1, 65535], got {self.master_port}")
        if not self.timeout_s > 0:
            raise ParallelConfigError(f"--distributed-timeout-seconds must be > 0, got {self.timeout_s}")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _to(obj: Any, device: torch.device) -> Any:
    """``obj`` (a batch: dataclasses, lists and tuples of tensors) with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, list):
        return [_to(x, device) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_to(x, device) for x in obj)
    return obj


def _proof_of(key: bytes, nonce: bytes, rank: int) -> bytes:
    return hmac.new(key, b"tokenfleet rank " + rank.to_bytes(4, "little") + nonce, hashlib.sha256).digest()


class ProcessGroup:
    """This process's rank in the replica's ``torch.distributed`` group, with the collectives the layers and
    the runner use. ``collective_seconds`` adds up the time spent in them (waiting for the others included)."""

    def __init__(self, config: ParallelConfig, rank: int, device: torch.device,
                 server: RendezvousServer | None = None):
        self.config, self.rank, self.size, self.device = config, rank, config.world_size, device
        self.server = server                   # rank 0: the group's store, served until the group closes
        self.collective_seconds = 0.0
        self.last_message = time.monotonic()
        self.broken: RankFailure | None = None
        self.shm: ShmChannel | None = None     # the collectives over shared memory (every rank on this host, CPU)

    def _failed(self, what: str, error: BaseException) -> RankFailure:
        self.broken = RankFailure(f"rank {self.rank}: {what} failed (group at {self.config.address}, "
                                  f"{self.size} ranks, timeout {self.config.timeout_s:g}s): a rank is gone or "
                                  f"stalled: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        return self.broken

    def _run(self, what: str, fn, *args):
        if self.broken is not None:
            raise self.broken
        started = time.perf_counter()
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses of every kind
            raise self._failed(what, e) from e
        finally:
            self.collective_seconds += time.perf_counter() - started

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is not None:
            whole = x if x.is_contiguous() else x.contiguous()
            self._run("all-reduce", self.shm.all_reduce, whole)
            if whole is not x:
                x.copy_(whole)
            return x
        self._run("all-reduce", dist.all_reduce, x)
        return x

    @property
    def kernel_comm(self):
        """The shared-memory channel as the compiled kernels take it (``cpu_kernels.Comm``), or None."""
        return self.shm.comm if self.shm is not None else None

    def run_kernels(self, fn, *args):
        """Call ``fn`` (a compiled call that sums across the ranks through ``kernel_comm``): its time in those
        sums counts as collective time, and a failed sum breaks the group (RankFailure)."""
        from .cpu_kernels import CommFailure

        if self.broken is not None:
            raise self.broken
        comm = self.kernel_comm
        before = comm.seconds if comm is not None else 0.0
        try:
            return fn(*args)
        except CommFailure as e:
            assert self.shm is not None
            raise self._failed("all-reduce", self.shm.failure(e)) from e
        finally:
            if comm is not None:
                self.collective_seconds += comm.seconds - before

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        x = x.contiguous()
        if self.shm is not None:
            return self._run("gather", self.shm.gather_columns, x)
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self._run("gather", lambda: dist.gather(x, parts, dst=0))
        return torch.cat(parts, dim=1) if parts is not None else None

    def _decode(self, frame: bytes | bytearray, sender: int) -> Any:
        try:
            return wire.decode(frame)
        except wire.WireError as e:
            raise self._failed("decoding a message", RuntimeError(f"rank {sender} sent a frame that is not a "
                                                                  f"message: {e}")) from e

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0 sends ``message`` (``wire.py``'s encoding; tensors go as CPU tensors), every rank returns it."""
        if self.shm is not None:
            raw = wire.encode(message) if self.rank == 0 else None
            got_bytes = self._run("broadcast", self.shm.broadcast_bytes, raw)
            self.last_message = time.monotonic()
            return message if self.rank == 0 else self._decode(got_bytes, 0)
        if self.rank == 0:
            message = _to(message, torch.device("cpu")) if self.device.type != "cpu" else message
            data = torch.frombuffer(wire.encode(message), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        on = self.device
        size = size.to(on)
        self._run("broadcast", dist.broadcast, size, 0)
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        buf = data.to(on)
        self._run("broadcast", dist.broadcast, buf, 0)
        self.last_message = time.monotonic()
        if self.rank == 0:
            return message
        got = self._decode(bytearray(buf.cpu().numpy().tobytes()), 0)
        return _to(got, self.device) if self.device.type != "cpu" else got

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (``wire.py``'s encoding), by rank."""
        frame = wire.encode(obj)
        size = torch.tensor([len(frame)], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(size) for _ in range(self.size)]
        self._run("exchange", dist.all_gather, sizes, size)
        lengths = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[:len(frame)] = torch.frombuffer(frame, dtype=torch.uint8)
        parts = [torch.empty(max(lengths), dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        self._run("exchange", dist.all_gather, parts, padded.to(self.device))
        return [self._decode(bytearray(p[:n].cpu().numpy().tobytes()), r)
                for r, (p, n) in enumerate(zip(parts, lengths))]

    def prove_membership(self, key: bytes) -> None:
        """Every rank proves the replica's key to every other over the group's own connections (rank 0 picks a
        fresh nonce; each rank sends an HMAC of it and its rank); RankFailure naming a rank that cannot. Fixed
        sizes both ways: nothing a rank sends is parsed before this has passed."""
        nonce = torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8) if self.rank == 0 else \
            torch.zeros(32, dtype=torch.uint8)
        nonce = nonce.to(self.device)
        self._run("membership proof", dist.broadcast, nonce, 0)
        seen = nonce.cpu().numpy().tobytes()
        mine = torch.frombuffer(bytearray(_proof_of(key, seen, self.rank)), dtype=torch.uint8).to(self.device)
        proofs = [torch.empty_like(mine) for _ in range(self.size)]
        self._run("membership proof", dist.all_gather, proofs, mine)
        for r, proof in enumerate(proofs):
            if not hmac.compare_digest(proof.cpu().numpy().tobytes(), _proof_of(key, seen, r)):
                raise self._failed("membership proof", RuntimeError(
                    f"rank {r} did not prove the replica's key: a process that is not one of this replica's ranks "
                    f"holds its place in the group"))

    def barrier(self) -> None:
        self._run("barrier", dist.barrier)

    def attach_shared_memory(self) -> bool:
        """Move the collectives onto one shared-memory segment when every rank is a CPU process of this host
        (same boot id and hostname, and every rank could open the segment rank 0 made); else keep gloo. gloo
        carries the exchange that decides it. Returns whether the group now uses shared memory."""
        if self.device.type != "cpu" or self.config.nnodes != 1:
            return False
        here = (socket.gethostname(), _boot_id())
        path = None
        if self.rank == 0:
            try:
                path = create_segment(str(self.config.master_port), self.size)
            except OSError as e:
                log.warning("no shared-memory segment for the group's collectives (%s); using gloo", e)
        every = self.all_gather_object((here, path))
        path = every[0][1]
        same_host = path is not None and all(host == every[0][0] for host, _ in every)
        channel = None
        if same_host:
            try:
                channel = ShmChannel(path, self.rank, self.size, self.config.timeout_s)
            except (OSError, ValueError) as e:
                log.warning("rank %d cannot open the group's shared-memory segment %s (%s); using gloo",
                            self.rank, path, e)
        opened = self.all_gather_object(channel is not None)
        if self.rank == 0 and path is not None:
            os.unlink(path)                      # every rank that will use it holds its mapping
        if channel is None or not all(opened):
            if channel is not None:
                channel.close()
            return False
        channel.ready()
        self.shm = channel
        return True

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already broken; nothing left to release
                pass
        if self.server is not None:
            self.server.close()
            self.server = None


def listen_for_group(config: ParallelConfig) -> socket.socket:
    """Rank 0's listening socket for the group's store, on the leader's own address (not every address of the
    machine): two leaders that share a network namespace (pods of the local pod runner, hostNetwork pods) each
    have the port on their own address. Where that address is none this machine can bind (a Service's virtual
    IP, a wildcard, a name it cannot resolve) it listens on every address. RankFailure naming the port when
    another process holds it."""
    host, port = config.master_addr, config.master_port
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        family, kind, proto, address = socket.AF_INET, socket.SOCK_STREAM, 0, ("0.0.0.0", port)
    wildcard = ("::" if family == socket.AF_INET6 else "0.0.0.0", port)
    for where in ([address] if address[0] not in ("0.0.0.0", "::") else []) + [wildcard]:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
            sock.listen(256)
            return sock
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise RankFailure(
                    f"rank 0 cannot serve its group's rendezvous on {where[0]}:{port}: port {port} is in use by "
                    f"another process (a previous server of this replica still exiting, or another program); "
                    f"free the port or choose another --master-port") from e
            if where is wildcard:
                raise RankFailure(f"rank 0 cannot serve its group's rendezvous on port {port}: {e}") from e
    raise AssertionError("unreachable: the wildcard is always tried")


def _join_message(config: ParallelConfig, rank: int) -> str:
    if rank != 0:
        return (f"rank {rank} of {config.world_size} could not join the replica's group at {config.address} within "
                f"{config.timeout_s:g}s (--master-addr/--master-port; is the leader up and reachable?)")
    return (f"rank 0 of {config.world_size} (the leader) did not see every rank join its group at {config.address} "
            f"within {config.timeout_s:g}s (are all members up, and can they reach this address?)")


def join(config: ParallelConfig, rank: int, device: torch.device) -> ProcessGroup:
    """Join the replica's group as ``rank``, within ``config.timeout_s``, proving ``config.key``; RankFailure
    naming the rank and the leader's address when it cannot."""
    if config.key is None:
        raise RankFailure(f"rank {rank}: no rendezvous key (the replica's ranks prove a shared key to join; "
                          f"set TOKENFLEET_RENDEZVOUS_KEY or TOKENFLEET_API_KEY on every host)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    server = RendezvousServer(listen_for_group(config), config.key) if rank == 0 else None
    # the join's own bound, whatever the store's retry loop does: a member that cannot reach the leader must
    # not wait longer (the process exits; the pod restarts and the Slice condition carries this message)
    done = threading.Event()
    timeout = datetime.timedelta(seconds=config.timeout_s)
    what = _join_message(config, rank)

    def watchdog() -> None:
        if not done.wait(config.timeout_s + 5):
            from tokenfleet_serving.contract.termination import write_termination_message
            log.error("%s", what)
            write_termination_message(f"tokenfleet: {what}")
            os._exit(1)

    threading.Thread(target=watchdog, name="join-watchdog", daemon=True).start()
    try:
        store = RendezvousStore(config.master_addr, config.master_port, config.key, timeout)
        if server is not None:
            server.wait_for(config.world_size, config.timeout_s)
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=config.world_size,
                                timeout=timeout)
    except Exception as e:  # noqa: BLE001 - store timeouts and connection errors have many types
        if server is not None:
            if server.refused:
                what += (f"; refused {server.refused} connection(s) that did not prove the replica's key, the last "
                         f"from {server.last_refused}")
            server.close()
        if isinstance(e, RendezvousRefused):
            what = f"rank {rank} of {config.world_size} was refused at {config.address}"
        raise RankFailure(f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    finally:
        done.set()
    group = ProcessGroup(config, rank, device, server)
    try:
        group.prove_membership(config.key)
        group.attach_shared_memory()
    except RankFailure:
        group.close()
        raise
    return group


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def checkpoint_identity(model_dir: str, revision: str | None = None) -> dict[str, str]:
    """What every rank's checkpoint must share with rank 0's: the revision (given, or a fingerprint of the
    weight files) and the sha256 of config.json."""
    from .identity import config_sha256, weights_fingerprint

    return {"revision": revision or weights_fingerprint(model_dir), "config_sha256": config_sha256(model_dir)}


def check_identities(group: ProcessGroup, identity: dict[str, str], model_dir: str) -> None:
    """Exchange the identities; RankFailure (on every rank) naming both revisions where one differs from rank
    0's."""
    every = group.all_gather_object({**identity, "model": model_dir})
    leader = every[0]
    for rank, other in enumerate(every):
        if rank and (other["revision"], other["config_sha256"]) != (leader["revision"], leader["config_sha256"]):
            raise RankFailure(
                f"rank {rank} holds another checkpoint than rank 0: revision {other['revision']} "
                f"(config.json sha256 {other['config_sha256'][:12]}) at {other['model']} on rank {rank}, "
                f"revision {leader['revision']} (config.json sha256 {leader['config_sha256'][:12]}) at "
                f"{leader['model']} on rank 0; refusing to serve a mix of weights")
