"""The replica's rendezvous: the key-value store its ranks form their group through, which only a process that
proves the replica's key may use.

Rank 0 serves the store on the leader's address (``--master-addr``/``--master-port``). Every connection starts
with a challenge and response over HMAC-SHA256 of the replica's key; nothing else a connecting process sends is
read before it has proved the key, and a connection that does not prove it within ``HANDSHAKE_S`` is closed
(logged, counted in ``RendezvousServer.refused``)::

    leader -> member   32 random bytes (leader nonce)
    member -> leader   32 random bytes (member nonce) + HMAC(key, "member" + leader nonce + member nonce)
    leader -> member   HMAC(key, "leader" + leader nonce + member nonce)

so the leader also proves the key to the member (a process that took the leader's port cannot pose as it).
Then each request is an operation code and length-prefixed arguments, each answer a status and a
length-prefixed value; ``RendezvousStore`` is the member's side, a ``torch.distributed.Store`` that
``init_process_group`` takes in place of torch's TCPStore.

The key: a single-host replica's ranks are the server's own children, which get a random key from it (on a
pipe, ``worker.py``); the hosts of a multi-host replica derive it from a secret they share
(``TOKENFLEET_RENDEZVOUS_KEY``, else the replica key the operator gives every pod of the service as
``TOKENFLEET_API_KEY``) and the leader's address (``derive_key``).
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time

import torch.distributed as dist

log = logging.getLogger("tokenfleet.rendezvous")

NONCE_BYTES = 32
HANDSHAKE_S = 10.0               # a connection that has not proved the key by then is closed
MAX_PENDING = 32                 # connections still proving the key at once (more are closed at once)
MAX_ARG_BYTES = 1 << 20          # one key or value (gloo's and NCCL's are a few hundred bytes)
MAX_KEYS = 1 << 16

SET, GET, ADD, CHECK, WAIT, COMPARE_SET, DELETE, NUM_KEYS = range(1, 9)
OK, TIMEOUT, MISSING = range(3)
_REQUEST = struct.Struct("<BH")         # operation, number of arguments
_LENGTH = struct.Struct("<I")
_ANSWER = struct.Struct("<BI")          # status, value length


class RendezvousRefused(RuntimeError):
    """The other end of a rendezvous connection did not prove the replica's key."""


def derive_key(secret: str | bytes, address: str) -> bytes:
    """The rendezvous key of the replica whose leader listens on ``address`` (host:port), from a secret every host
    of the replica holds."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(raw, b"tokenfleet rendezvous\0" + address.encode(), hashlib.sha256).digest()


def key_from_environment(address: str, api_key: str | None = None) -> bytes | None:
    """The key of the replica whose leader is at ``address`` on a host of a multi-host replica: derived from
    ``TOKENFLEET_RENDEZVOUS_KEY``, else from the replica key (``api_key``, else ``TOKENFLEET_API_KEY``); None
    without either."""
    secret = os.environ.get("TOKENFLEET_RENDEZVOUS_KEY") or api_key or os.environ.get("TOKENFLEET_API_KEY")
    return derive_key(secret, address) if secret else None


def _proof(key: bytes, role: bytes, leader_nonce: bytes, member_nonce: bytes) -> bytes:
    return hmac.new(key, role + leader_nonce + member_nonce, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``; ConnectionError when it closes first."""
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError(f"the connection closed after {got} of {n} bytes")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def check_member(sock: socket.socket, key: bytes) -> bool:
    """The leader's side of the handshake: whether the process at the other end proved ``key`` (it read exactly
    the nonce and the proof, and compared them in constant time)."""
    leader_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(leader_nonce)
    got = recv_exact(sock, NONCE_BYTES + hashlib.sha256().digest_size)
    member_nonce, proof = got[:NONCE_BYTES], got[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _proof(key, b"member", leader_nonce, member_nonce)):
        return False
    sock.sendall(_proof(key, b"leader", leader_nonce, member_nonce))
    return True


def prove_member(sock: socket.socket, key: bytes) -> None:
    """The member's side: prove ``key`` and check the leader's proof; RendezvousRefused naming who failed."""
    try:
        leader_nonce = recv_exact(sock, NONCE_BYTES)
        member_nonce = os.urandom(NONCE_BYTES)
        sock.sendall(member_nonce + _proof(key, b"member", leader_nonce, member_nonce))
        answer = recv_exact(sock, hashlib.sha256().digest_size)
    except ConnectionError as e:
        raise RendezvousRefused("the leader closed the connection at the handshake: it refused this rank's proof of "
                                "the replica's key (do all hosts share the same key?)") from e
    if not hmac.compare_digest(answer, _proof(key, b"leader", leader_nonce, member_nonce)):
        raise RendezvousRefused("the process listening on the leader's address did not prove the replica's key: "
                                "it is not this replica's leader")


def send_request(sock: socket.socket, op: int, *args: bytes) -> None:
    parts = [_REQUEST.pack(op, len(args))]
    for a in args:
        parts += [_LENGTH.pack(len(a)), a]
    sock.sendall(b"".join(parts))


def read_answer(sock: socket.socket) -> tuple[int, bytes]:
    status, length = _ANSWER.unpack(recv_exact(sock, _ANSWER.size))
    return status, recv_exact(sock, length)


class RendezvousServer:
    """Rank 0's store, served to the connections that prove ``key`` on the listening socket ``listener``."""

    def __init__(self, listener: socket.socket, key: bytes):
        self.key = key
        self.listener = listener
        self.refused = 0
        self.last_refused = ""
        self.proved = 0                         # connections that proved the key
        self.data: dict[str, bytes] = {}
        self.changed = threading.Condition()
        self.pending = threading.BoundedSemaphore(MAX_PENDING)
        self.closed = False
        self.connections: list[socket.socket] = []
        listener.settimeout(0.2)
        threading.Thread(target=self._accept, name="rendezvous-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, peer = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return                          # closed
            if not self.pending.acquire(blocking=False):
                self._refuse(peer, "too many connections are proving the key at once")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="rendezvous-conn", daemon=True).start()

    def _refuse(self, peer, why: str) -> None:
        self.refused += 1
        self.last_refused = f"{peer[0]}:{peer[1]}"
        log.warning("rendezvous: refused the connection from %s: %s", self.last_refused, why)

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            conn.settimeout(HANDSHAKE_S)
            try:
                proved = check_member(conn, self.key)
            except (OSError, ConnectionError):
                proved = False
            finally:
                self.pending.release()
            if not proved:
                self._refuse(peer, "it did not prove the replica's key")
                return
            conn.settimeout(None)
            self.connections.append(conn)
            with self.changed:
                self.proved += 1
                self.changed.notify_all()
            while not self.closed:
                op, args = self._read_request(conn)
                status, value = self._answer(op, args)
                conn.sendall(_ANSWER.pack(status, len(value)) + value)
        except Exception as e:  # noqa: BLE001 - a broken connection of a member breaks its join, which says why
            if not self.closed and not isinstance(e, ConnectionError):
                log.warning("rendezvous: closed the connection from %s:%s: %s: %s", peer[0], peer[1],
                            type(e).__name__, e)
        finally:
            conn.close()

    @staticmethod
    def _read_request(conn: socket.socket) -> tuple[int, list[bytes]]:
        op, count = _REQUEST.unpack(recv_exact(conn, _REQUEST.size))
        if count > MAX_KEYS:
            raise ValueError(f"a request with {count} arguments")
        args = []
        for _ in range(count):
            (length,) = _LENGTH.unpack(recv_exact(conn, _LENGTH.size))
            if length > MAX_ARG_BYTES:
                raise ValueError(f"an argument of {length} bytes")
            args.append(recv_exact(conn, length))
        return op, args

    def _answer(self, op: int, args: list[bytes]) -> tuple[int, bytes]:
        data = self.data
        with self.changed:
            if op == WAIT:
                deadline = time.monotonic() + int(args[0]) / 1000
                keys = [a.decode() for a in args[1:]]
                while not all(k in data for k in keys):
                    left = deadline - time.monotonic()
                    if left <= 0 or self.closed:
                        return TIMEOUT, b""
                    self.changed.wait(left)
                return OK, b""
            key = args[0].decode() if args else ""
            if op in (SET, ADD, COMPARE_SET) and key not in data and len(data) >= MAX_KEYS:
                raise ValueError(f"more than {MAX_KEYS} keys")
            if op == SET:
                data[key] = args[1]
            elif op == GET:
                return (OK, data[key]) if key in data else (MISSING, b"")
            elif op == ADD:
                data[key] = str(int(data.get(key, b"0")) + int(args[1])).encode()
                value = data[key]
            elif op == CHECK:
                return OK, b"1" if all(a.decode() in data for a in args) else b"0"
            elif op == COMPARE_SET:
                current = data.get(key)
                if (current is None and args[1] == b"") or current == args[1]:
                    data[key] = args[2]
                return OK, data.get(key, args[1])
            elif op == DELETE:
                return OK, b"1" if data.pop(key, None) is not None else b"0"
            elif op == NUM_KEYS:
                return OK, str(len(data)).encode()
            else:
                raise ValueError(f"unknown operation {op}")
            self.changed.notify_all()
            return OK, value if op == ADD else b""

    def wait_for(self, connections: int, timeout_s: float) -> None:
        """Return once ``connections`` connections have proved the key; TimeoutError after ``timeout_s``. (The
        leader forms the group only then: a failed ``init_process_group`` leaves torch's count of groups behind
        the members', so the leader must not start it before every member is there.)"""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while self.proved < connections:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    raise TimeoutError(f"{self.proved} of {connections} ranks joined")
                self.changed.wait(left)

    def close(self) -> None:
        self.closed = True
        with self.changed:
            self.changed.notify_all()
        self.listener.close()
        for conn in self.connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class RendezvousStore(dist.Store):
    """A member's connection to the replica's store (rank 0's own too), for ``init_process_group``: it connects
    (again and again while the leader is not listening yet, until ``timeout``), proves the key, then serves
    torch's store calls. RendezvousRefused when the key does not match; TimeoutError when the leader never
    answers."""

    def __init__(self, host: str, port: int, key: bytes, timeout: datetime.timedelta):
        super().__init__()
        self.address = f"{host}:{port}"
        self.lock = threading.Lock()
        self.wait_timeout = timeout
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=min(HANDSHAKE_S, timeout.total_seconds()))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no leader answered at {self.address}") from None
                time.sleep(0.2)
        try:
            prove_member(sock, key)
        except (RendezvousRefused, OSError):
            sock.close()
            raise
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def _call(self, op: int, *args: bytes) -> tuple[int, bytes]:
        with self.lock:
            send_request(self.sock, op, *args)
            return read_answer(self.sock)

    @staticmethod
    def _bytes(value) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key, value) -> None:
        self._call(SET, key.encode(), self._bytes(value))

    def get(self, key) -> bytes:
        self.wait([key])
        status, value = self._call(GET, key.encode())
        if status != OK:
            raise dist.DistStoreError(f"rendezvous at {self.address}: key {key} vanished")
        return value

    def add(self, key, amount) -> int:
        return int(self._call(ADD, key.encode(), str(int(amount)).encode())[1])

    def check(self, keys) -> bool:
        return self._call(CHECK, *(k.encode() for k in keys))[1] == b"1"

    def wait(self, keys, timeout=None) -> None:
        limit = timeout if timeout is not None else self.wait_timeout
        status, _ = self._call(WAIT, str(int(limit.total_seconds() * 1000)).encode(), *(k.encode() for k in keys))
        if status != OK:
            raise dist.DistStoreError(f"rendezvous at {self.address}: timed out after {limit.total_seconds():g}s "
                                      f"waiting for {', '.join(keys)}")

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call(COMPARE_SET, key.encode(), self._bytes(expected), self._bytes(desired))[1]

    def delete_key(self, key) -> bool:
        return self._call(DELETE, key.encode())[1] == b"1"

    def num_keys(self) -> int:
        return int(self._call(NUM_KEYS)[1])

    def close(self) -> None:
        self.sock.close()
