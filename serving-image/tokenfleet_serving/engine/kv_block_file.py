"""The disk tier's block files: their format, their authentication, and how they are opened.

A block file (``<config hash, 16 hex>-<block hash, 64 hex>.tfkv``), little endian::

    b"TFKVBLK2"  config hash [32]  block hash [32]  parent hash [32]  uint32 n  token ids [n x uint32]
    uint64 kv bytes  KV (the block's part of each pool tensor: PoolIO)
    HMAC-SHA256(tier key, everything before it) [32]

**Authenticated.** Anyone who can write the directory (the warm-restart volume) could otherwise plant a block
whose KV the replica serves as the model's: a checksum proves nothing against them. The tag is keyed with the
*tier key* (``tier_key``), derived from a per-service secret: ``$TOKENFLEET_KV_TIER_KEY`` when set, else the
server's API key (the operator gives every replica of a service the same one, from its replica-key Secret, as
``$TOKENFLEET_API_KEY``), else a random key made at process start. A file whose tag does not verify is refused
and deleted (reason ``corrupt``: a flipped bit, a truncation, a plant and another key look alike). So a server
without a secret cannot read its own tier after a restart, and a new replica key (the Secret deleted and
remade) starts every replica of the service cold.

**Sized before read.** A file's size is checked (``fstat`` on the opened file) against the only sizes a block of
this engine can have, before a byte is read: a 2 GiB file planted under a block's name costs a stat, not a
9 s read on the step thread.

**No links followed.** The tier's directory is opened once, component by component with ``O_NOFOLLOW`` (a
symbolic link anywhere in its path refuses the tier), and every file is opened, created, renamed and deleted
relative to that directory's descriptor, with ``O_NOFOLLOW``; a file that is not a regular file (a link, a
FIFO, a device) is refused. Directories the tier creates are 0700 and its files 0600.

The files hold the prompts' token ids in clear (a block's hash chain needs them): whoever can read the volume
can read the cached prompts' tokens.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
import struct
from dataclasses import dataclass

import torch

from .block_pool import hash_block

MAGIC = b"TFKVBLK2"
TAG_BYTES = 32
FIXED_BYTES = len(MAGIC) + 96 + 4 + 8 + TAG_BYTES       # everything but the token ids and the KV
TIER_KEY_ENV = "TOKENFLEET_KV_TIER_KEY"
_KEY_LABEL = b"tokenfleet kv tier key v1"
_PROCESS_KEY = secrets.token_bytes(32)                   # without a secret: this process's own, lost at exit
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK     # NONBLOCK: a planted FIFO never waits
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class BlockRecord:
    """One block leaving or entering the accelerator tier."""

    hash: bytes
    parent: bytes
    tokens: tuple[int, ...]
    data: torch.Tensor | None = None     # the block's bytes (PoolIO) on the host


def tier_key(secret: str | None) -> bytes:
    """The key that authenticates block files: derived from ``secret`` (the same secret, the same key, in any
    process), or this process's random key when there is none."""
    if not secret:
        return _PROCESS_KEY
    return hmac.new(secret.encode(), _KEY_LABEL, hashlib.sha256).digest()


class BlockFileError(Exception):
    """A disk block that must not be loaded; ``reason`` is the metric label (corrupt, foreign, forged)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class LinkRefused(OSError):
    """A symbolic link where the disk tier's directory or a block file should be."""


def kv_bytes(block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    size = torch.tensor([], dtype=dtype).element_size()
    for d in block_shape:
        size *= d
    return size


def plausible_size(size: int, kv: int, max_tokens: int) -> bool:
    """Whether ``size`` is that of a block file of 1..max_tokens tokens and ``kv`` KV bytes."""
    tokens_bytes = size - FIXED_BYTES - kv
    return tokens_bytes % 4 == 0 and 1 <= tokens_bytes // 4 <= max_tokens


def encode_block(config_hash: bytes, record: BlockRecord, data: torch.Tensor, *, key: bytes) -> bytes:
    tokens = struct.pack(f"<I{len(record.tokens)}I", len(record.tokens), *record.tokens)
    kv = memoryview(data.contiguous().view(torch.uint8).numpy().data).cast("B")
    head = b"".join([MAGIC, config_hash, record.hash, record.parent, tokens, struct.pack("<Q", kv.nbytes)])
    tag = hmac.new(key, head, hashlib.sha256)
    tag.update(kv)
    return b"".join([head, kv, tag.digest()])


def decode_block(raw: bytes, config_hash: bytes, expected_hash: bytes, block_shape: tuple[int, ...],
                 dtype: torch.dtype, *, key: bytes) -> BlockRecord:
    """The block in ``raw``, or BlockFileError: corrupt (its tag does not verify under ``key``, or its size),
    foreign (another config hash) or forged (its hash is not sha256(parent, tokens), or not the one it was filed
    under)."""
    view = memoryview(raw)                  # no copies of the block's bytes but the tensor's own
    if len(raw) < FIXED_BYTES or not hmac.compare_digest(
            hmac.new(key, view[:-TAG_BYTES], hashlib.sha256).digest(), raw[-TAG_BYTES:]):
        raise BlockFileError("corrupt", "its tag does not verify: corrupt, truncated, or not written with this "
                                        "service's key")
    if raw[:len(MAGIC)] != MAGIC:
        raise BlockFileError("corrupt", "not a KV block file")
    o = len(MAGIC)
    theirs, h, parent = raw[o:o + 32], raw[o + 32:o + 64], raw[o + 64:o + 96]
    if theirs != config_hash:
        raise BlockFileError("foreign", f"written for config {theirs.hex()[:16]}, this engine is {config_hash.hex()[:16]}")
    o += 96
    (n,) = struct.unpack_from("<I", raw, o)
    if o + 4 + 4 * n + 8 > len(raw):
        raise BlockFileError("corrupt", f"claims {n} tokens, more than the file holds")
    tokens = struct.unpack_from(f"<{n}I", raw, o + 4)
    o += 4 + 4 * n
    (kv_len,) = struct.unpack_from("<Q", raw, o)
    o += 8
    expected = kv_bytes(block_shape, dtype)
    if kv_len != expected or o + kv_len + TAG_BYTES != len(raw):
        raise BlockFileError("corrupt", f"holds {kv_len} KV bytes for {n} tokens, expected {expected}")
    if h != expected_hash or hash_block(parent, tokens) != h:
        raise BlockFileError("forged", "its hash does not match its parent and tokens")
    data = torch.frombuffer(bytearray(view[o:o + kv_len]), dtype=torch.uint8).view(dtype).view(block_shape)
    return BlockRecord(h, parent, tuple(tokens), data)


def open_directory(path: str) -> int:
    """A descriptor of directory ``path``, each missing component made (0700), reached without following a
    symbolic link at any component: LinkRefused naming the one that is a link."""
    absolute = os.path.abspath(path)
    fd = os.open("/", DIR_FLAGS)
    walked = ""
    try:
        for part in [p for p in absolute.split("/") if p]:
            walked += "/" + part
            try:
                child = _open_or_make(fd, part)
            except OSError as exc:
                if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(fd, part)):
                    raise LinkRefused(errno.ELOOP, f"{walked} is a symbolic link; the disk tier follows no link "
                                                   "(give the directory's real path)") from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_or_make(parent: int, name: str) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass                       # made by another process meanwhile: open it (or refuse its link)
        return os.open(name, DIR_FLAGS, dir_fd=parent)


def _is_link(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def read_block_file(directory: int, name: str, kv: int, max_tokens: int) -> bytes:
    """The bytes of block file ``name`` in ``directory`` (a descriptor), once it is known to be a regular file of
    a size a block can have; BlockFileError otherwise (FileNotFoundError when it is gone)."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BlockFileError("corrupt", "a symbolic link, not a block file") from None
        raise
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise BlockFileError("corrupt", "not a regular file")
        if not plausible_size(st.st_size, kv, max_tokens):
            raise BlockFileError("corrupt", f"{st.st_size} bytes, not the size of a block of this engine "
                                            f"(at most {FIXED_BYTES + 4 * max_tokens + kv})")
        raw = f.read(st.st_size + 1)           # one more: a file that grew since the stat is refused, not read on
    if len(raw) != st.st_size:
        raise BlockFileError("corrupt", "its size changed while it was read")
    return raw


def write_block_file(directory: int, name: str, raw: bytes) -> None:
    """Write ``raw`` as ``name`` in ``directory`` (a descriptor): a fresh 0600 file under a temporary name, then
    renamed over ``name`` (a link planted at either name is replaced or refused, never followed)."""
    tmp = f".{name}.tmp"
    try:
        fd = os.open(tmp, WRITE_FLAGS, 0o600, dir_fd=directory)
    except FileExistsError:                   # a leftover of a killed writer, or a plant: not ours to follow
        os.unlink(tmp, dir_fd=directory)
        fd = os.open(tmp, WRITE_FLAGS, 0o600, dir_fd=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
    except OSError:
        try:
            os.unlink(tmp, dir_fd=directory)
        except OSError:
            pass
        raise
