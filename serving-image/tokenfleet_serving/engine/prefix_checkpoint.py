"""Prefix-cache checkpoints: the hottest cached KV blocks on disk, so a replacement replica starts warm.

A checkpoint holds, for each block, its chained hash, its parent's hash, its token ids and its KV tensors
(every layer's keys and values), blocks ordered hottest first with every parent before its children. It is
tied to what produced it (``identity``): the sha256 of the model's ``config.json``, the model's revision
(given, or a fingerprint of the weight files), the dtype, the KV cache's dtype (``auto`` or ``int8``), the
block size and the per-block KV shape. A
checkpoint whose identity differs in any of these is refused with a reason that names them; one whose
checksum does not match (corrupt, truncated) is ignored. Loading re-checks every block's hash against its
parent and token ids, so no block can enter the cache under a hash it does not have.

File layout (little endian)::

    b"TFPREFIX"  uint32 version  uint64 header length  header (JSON, UTF-8)
    hashes [n x 32 bytes]  parents [n x 32 bytes]  token ids [n x block_size x uint32]
    KV [n x layers x 2 x kv_heads x block_size x head_dim, in the dtype, or int8 with kv_cache_dtype int8]
    (kv_cache_dtype int8 only) scales [n x layers x 2 x kv_heads x block_size, bfloat16]
    sha256 of everything before it [32 bytes]

Files are written to a temporary name, flushed to disk and renamed, so a reader sees the old file or the
new one, never half of one (a crash leaves at worst a stray ``.tmp`` file).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .block_pool import ROOT_HASH, hash_block

if TYPE_CHECKING:
    from .engine import LLMEngine

MAGIC = b"TFPREFIX"
VERSION = 1
HASH_SCHEME = "sha256-chain-uint32le"
SUFFIX = ".tfprefix"
_SAMPLES, _SAMPLE_BYTES = 16, 64 * 1024


class CheckpointUnusable(Exception):
    """A checkpoint this replica must not load; the message says why (one line, for the log)."""


def config_sha256(model_dir: str | Path) -> str:
    """sha256 of config.json with its keys sorted, so formatting does not matter."""
    data = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def weights_fingerprint(model_dir: str | Path) -> str:
    """A cheap identity of the weights: every safetensors file's name, size and header, plus 16 samples of
    64 KiB spread over its data. Two trainings of one architecture differ in every sample; a file that was
    not rewritten reads the same (about 1 MiB per file is read)."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            head = f.read(8)
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            digest.update(head + f.read(min(header_len, 100 * 2**20)))
            start = 8 + header_len
            span = max(size - start - _SAMPLE_BYTES, 0)
            for i in range(_SAMPLES):
                f.seek(start + span * i // max(_SAMPLES - 1, 1))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:32]


def engine_identity(engine: LLMEngine, revision: str | None = None) -> dict[str, Any]:
    """What a checkpoint of ``engine`` must match to be loaded by it."""
    model_dir = engine.config.model
    pool = engine.runner.kv_pool
    return {
        "kv_cache_dtype": engine.runner.kv_cache_dtype,
        "format": VERSION,
        "hash_scheme": HASH_SCHEME,
        "model_config_sha256": config_sha256(model_dir),
        "revision": revision or f"weights:{weights_fingerprint(model_dir)}",
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "block_size": engine.kv.block_size,
        "kv_block_shape": [pool.shape[0], pool.shape[1], pool.shape[2], pool.shape[4], pool.shape[5]],
    }


@dataclass
class Snapshot:
    """Blocks of a prefix cache, hottest first, parents before children."""

    hashes: list[bytes]
    parents: list[bytes]
    tokens: list[tuple[int, ...]]
    kv: torch.Tensor                 # [n, layers, 2, kv_heads, block_size, head_dim] on the CPU
    scales: torch.Tensor | None = None   # int8 KV: [n, layers, 2, kv_heads, block_size] bf16

    def __len__(self) -> int:
        return len(self.hashes)


def _closed_under_parents(pool, order: list[int], limit: int) -> list[int]:
    """Up to ``limit`` blocks of ``order`` whose whole chain of parents is cached, each after its parents."""
    chosen: list[int] = []
    seen: set[int] = set()
    for b in order:
        if len(chosen) >= limit:
            break
        chain: list[int] = []
        cur: int | None = b
        while cur is not None and cur not in seen:
            origin = pool.block_origin[cur]
            if origin is None:
                chain = []          # a block cached without its origin (or an orphan): not exportable
                break
            chain.append(cur)
            parent = origin[0]
            if parent == ROOT_HASH:
                break
            cur = pool.lookup(parent)
            if cur is None:
                chain = []          # its parent was evicted: no lookup can reach it
                break
        if chain and len(chosen) + len(chain) <= limit:
            for block in reversed(chain):
                seen.add(block)
                chosen.append(block)
    return chosen


def export_snapshot(engine: LLMEngine, max_blocks: int) -> Snapshot:
    """Copy the hottest ``max_blocks`` cached blocks (under the engine's lock, between steps)."""
    pool_tensor, scale_tensor = engine.runner.kv_pool, engine.runner.kv_scales
    scales = None
    with engine.lock:
        pool = engine.kv.pool
        blocks = _closed_under_parents(pool, pool.hottest_cached(), max_blocks)
        index = torch.tensor(blocks, dtype=torch.long, device=pool_tensor.device)
        kv = pool_tensor.index_select(3, index).permute(3, 0, 1, 2, 4, 5).contiguous().cpu()
        if scale_tensor is not None:
            scales = scale_tensor.index_select(3, index).permute(3, 0, 1, 2, 4).contiguous().cpu()
        hashes = [pool.block_hash[b] for b in blocks]
        origins = [pool.block_origin[b] for b in blocks]
    return Snapshot(hashes, [o[0] for o in origins], [o[1] for o in origins], kv,  # type: ignore[arg-type,index]
                    scales)


def import_snapshot(engine: LLMEngine, snap: Snapshot) -> int:
    """Put the snapshot's blocks into the prefix cache as free cached blocks; returns how many were added.
    A block whose hash is not sha256(parent, tokens), or whose parent is not cached, is skipped (and so are
    its children). Refused (ValueError) while requests run."""
    pool_tensor = engine.runner.kv_pool
    bs = engine.kv.block_size
    with engine.lock:
        if engine.requests:
            raise ValueError("a prefix checkpoint is loaded only into an idle engine")
        if not engine.kv.enable_prefix_caching:
            return 0
        pool = engine.kv.pool
        keep: list[int] = []
        known = set(pool.cached)
        for i, (h, parent, tokens) in enumerate(zip(snap.hashes, snap.parents, snap.tokens)):
            if len(keep) >= pool.num_free:
                break
            if h in known or len(tokens) != bs:
                continue
            if (parent != ROOT_HASH and parent not in known) or hash_block(parent, tokens) != h:
                continue
            keep.append(i)
            known.add(h)
        if not keep:
            return 0
        blocks = pool.allocate(len(keep))
        index = torch.tensor(blocks, dtype=torch.long, device=pool_tensor.device)
        data = snap.kv[torch.tensor(keep, dtype=torch.long)].to(pool_tensor.device)
        pool_tensor.index_copy_(3, index, data.permute(1, 2, 3, 0, 4, 5))
        if engine.runner.kv_scales is not None:
            assert snap.scales is not None, "an int8 KV checkpoint carries its scales"
            scales = snap.scales[torch.tensor(keep, dtype=torch.long)].to(pool_tensor.device)
            engine.runner.kv_scales.index_copy_(3, index, scales.permute(1, 2, 3, 0, 4))
        for b, i in zip(blocks, keep):
            pool.cache(b, snap.hashes[i], (snap.parents[i], tuple(snap.tokens[i])))
        pool.release(blocks)          # free and cached: the first blocks of the file are evicted last
        return len(keep)


def write_checkpoint(path: str | Path, snap: Snapshot, identity: dict[str, Any], **info: Any) -> int:
    """Write ``snap`` atomically; returns the file's size in bytes."""
    path = Path(path)
    n = len(snap)
    header = {"identity": identity, "num_blocks": n, "created": time.time(), **info}
    header_bytes = json.dumps(header, sort_keys=True).encode()
    start = len(MAGIC) + 12
    header_bytes += b" " * (-(start + len(header_bytes)) % 64)       # the arrays start 64-byte aligned
    width = len(snap.tokens[0]) if n else identity["block_size"]
    tokens = torch.tensor([list(t) for t in snap.tokens], dtype=torch.int64).reshape(n, width)
    parts = [MAGIC, struct.pack("<IQ", VERSION, len(header_bytes)), header_bytes, b"".join(snap.hashes),
             b"".join(snap.parents), tokens.to(torch.int32).numpy().astype("<u4").tobytes(),
             snap.kv.contiguous().view(torch.uint8).numpy().tobytes()]
    if snap.scales is not None:
        parts.append(snap.scales.contiguous().view(torch.uint8).numpy().tobytes())
    digest = hashlib.sha256()
    for p in parts:
        digest.update(p)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("wb") as f:
        for p in parts:
            f.write(p)
        f.write(digest.digest())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return path.stat().st_size


def identity_mismatch(theirs: Any, ours: dict[str, Any]) -> str | None:
    """Why a checkpoint of identity ``theirs`` must not be loaded here, or None."""
    if not isinstance(theirs, dict):
        return "it carries no identity"
    names = {"model_config_sha256": "model (config.json)", "revision": "revision", "dtype": "dtype",
             "block_size": "KV block size", "kv_block_shape": "KV layout", "format": "format",
             "hash_scheme": "block hash scheme", "kv_cache_dtype": "KV cache dtype"}
    defaults = {"kv_cache_dtype": "auto"}      # checkpoints from before int8 KV caches hold the model dtype
    diffs = [f"{names.get(k, k)} {theirs.get(k, defaults.get(k))!r} here {v!r}" for k, v in ours.items()
             if theirs.get(k, defaults.get(k)) != v]
    if not diffs:
        return None
    return "it was written by another model, revision or dtype: " + "; ".join(diffs)


def read_checkpoint(path: str | Path, identity: dict[str, Any]) -> tuple[Snapshot, dict[str, Any]]:
    """(the snapshot, its header), or CheckpointUnusable saying why not: corrupt or truncated (the checksum
    does not match), or written by another model, revision or dtype."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    if len(data) < len(MAGIC) + 12 + 32:
        raise CheckpointUnusable(f"{path}: truncated ({len(data)} bytes)")
    if hashlib.sha256(memoryview(data)[:-32]).digest() != bytes(data[-32:]):
        raise CheckpointUnusable(f"{path}: corrupt or truncated (checksum mismatch); ignored")
    if bytes(data[:len(MAGIC)]) != MAGIC:
        raise CheckpointUnusable(f"{path}: not a prefix-cache checkpoint")
    version, header_len = struct.unpack_from("<IQ", data, len(MAGIC))
    if version != VERSION:
        raise CheckpointUnusable(f"{path}: format version {version}, this replica reads {VERSION}")
    start = len(MAGIC) + 12
    try:
        header = json.loads(bytes(data[start:start + header_len]))
    except ValueError as exc:
        raise CheckpointUnusable(f"{path}: unreadable header ({exc})") from None
    why = identity_mismatch(header.get("identity"), identity)
    if why:
        raise CheckpointUnusable(f"{path}: {why}")
    n = int(header.get("num_blocks", -1))
    shape = identity["kv_block_shape"]
    int8 = identity.get("kv_cache_dtype") == "int8"
    dtype = torch.int8 if int8 else getattr(torch, identity["dtype"])
    per_block = 32 + 32 + 4 * identity["block_size"]
    kv_bytes = n * int(torch.tensor(shape).prod()) * torch.tensor([], dtype=dtype).element_size()
    scale_bytes = n * int(torch.tensor(shape[:-1]).prod()) * 2 if int8 else 0
    offset = start + header_len
    if n < 0 or offset + n * per_block + kv_bytes + scale_bytes + 32 != len(data):
        raise CheckpointUnusable(f"{path}: its size does not match its {n} blocks")
    hashes = [bytes(data[offset + 32 * i:offset + 32 * (i + 1)]) for i in range(n)]
    offset += 32 * n
    parents = [bytes(data[offset + 32 * i:offset + 32 * (i + 1)]) for i in range(n)]
    offset += 32 * n
    bs = identity["block_size"]
    ids = torch.frombuffer(data, dtype=torch.int32, count=n * bs, offset=offset) if n else torch.empty(0)
    tokens = [tuple(row) for row in ids.view(n, bs).tolist()] if n else []
    offset += 4 * bs * n
    kv = (torch.frombuffer(data, dtype=torch.uint8, count=kv_bytes, offset=offset).view(dtype).view(n, *shape)
          if n else torch.empty((0, *shape), dtype=dtype))
    scales = None
    if int8:
        offset += kv_bytes
        scales = (torch.frombuffer(data, dtype=torch.uint8, count=scale_bytes, offset=offset).view(torch.bfloat16)
                  .view(n, *shape[:-1]) if n else torch.empty((0, *shape[:-1]), dtype=torch.bfloat16))
    return Snapshot(hashes, parents, tokens, kv, scales), header
