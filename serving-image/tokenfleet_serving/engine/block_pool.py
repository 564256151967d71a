"""The block pool: fixed-size KV blocks, reference counts, prefix hashes, LRU.

Block hash spec (stable across processes and machines, so a router can
recompute it without the engine)::

    ROOT = 32 zero bytes
    hash(block i) = sha256(hash(block i-1) or ROOT  ||  uint32_le(t0) || ... || uint32_le(t{B-1}))

where t0..t{B-1} are the token ids of block i (B = block size) and ``||`` is
byte concatenation. A request for a LoRA adapter chains from the adapter's root instead of ROOT::

    ROOT(adapter) = sha256(ROOT || "lora" || 0x00 || utf8(adapter name) || 0x00 || ascii(content digest))

where the content digest is the hex sha256 of the adapter's ``adapter_config.json`` followed by its
``adapter_model.safetensors`` (``lora_adapter.fingerprint``), so the same tokens under another adapter, the
base model, or another version of the adapter loaded under the same name never share a block. (A root
without a digest, ``ROOT || "lora" || 0x00 || utf8(name)``, is what a router computes for an adapter whose
digest it has not learnt.) Only full blocks are hashed, so a hash names the whole
prefix up to and including its block. Hex-encoded digests are what the engine
exposes.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence

ROOT_HASH = bytes(32)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _chain(parent: bytes, block_bytes: bytes) -> bytes:
    return hashlib.sha256(parent + block_bytes).digest()


def adapter_root_hash(adapter: str | None, digest: str | None = None) -> bytes:
    """The hash a request's first block chains from: ROOT for the base model, else the root of the adapter
    named ``adapter`` whose files' content digest (hex) is ``digest``."""
    if not adapter:
        return ROOT_HASH
    tail = b"" if digest is None else b"\x00" + digest.encode("ascii")
    return hashlib.sha256(ROOT_HASH + b"lora\x00" + adapter.encode("utf-8") + tail).digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return _chain(parent, _token_bytes(token_ids))


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, start: int = 0,
                       parent: bytes = ROOT_HASH) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` from block index ``start`` (``hash_block`` block by
    block, with the token bytes packed in one call: about half the time for a long prompt)."""
    end = max(len(token_ids) // block_size, start)
    data, width, hashes = _token_bytes(token_ids[start * block_size:end * block_size]), 4 * block_size, []
    for i in range(end - start):
        parent = _chain(parent, data[i * width:(i + 1) * width])
        hashes.append(parent)
    return hashes


class BlockPool:
    """Bookkeeping for ``num_blocks`` KV blocks (the tensors live in the model runner).

    Free blocks sit in an ordered queue: the head is evicted/reused first.
    Blocks without a hash go to the head (nothing to lose); hashed blocks go to
    the tail, so the least recently freed cached block is evicted first (LRU).
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        # (parent hash, token ids) of each cached block, for writing it to a disk tier (kv_offload.py)
        self.block_origin: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_blocks
        self.block_hits = [0] * num_blocks      # times a cached block was reused by a prefix hit
        self.num_evictions = 0
        # called with (block, hash, (parent, tokens)) of cached blocks about to be reused, while their KV is
        # still in the pool (kv_offload.py keeps it in a lower tier)
        self.on_evict: Callable[[list[tuple[int, bytes, tuple[bytes, tuple[int, ...]]]]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (free cached blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        return sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (removing free ones from the free queue)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1
            self.block_hits[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"cannot allocate {n} blocks, {len(self.free)} free")
        out = []
        evicted: list[tuple[int, bytes, tuple[bytes, tuple[int, ...]]]] = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            old = self.block_hash[b]
            if old is not None:
                origin = self.block_origin[b]
                if origin is not None:
                    evicted.append((b, old, origin))
                del self.cached[old]
                self.block_hash[b] = None
                self.block_origin[b] = None
                self.block_hits[b] = 0
                self.num_evictions += 1
            self.ref_cnt[b] = 1
            out.append(b)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def pin(self, block_ids: Sequence[int]) -> None:
        """Hold blocks (so an allocation cannot evict them) without counting a prefix hit; ``release`` undoes."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def cache(self, block_id: int, block_hash: bytes,
              origin: tuple[bytes, tuple[int, ...]] | None = None) -> None:
        """Register a full block under its hash (a duplicate of a cached hash stays anonymous); ``origin`` is
        its parent's hash and its token ids."""
        if block_hash not in self.cached and self.block_hash[block_id] is None:
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash
            self.block_origin[block_id] = origin

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; the last block is released first so it is evicted first."""
        for b in reversed(block_ids):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] < 0:
                raise RuntimeError(f"block {b} released more often than taken")
            if self.ref_cnt[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)

    def reset_cache(self) -> bool:
        """Forget every cached hash, so no later request hits; refused (False) while any block is in use."""
        if any(self.ref_cnt):
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_origin = [None] * self.num_blocks
        self.block_hits = [0] * self.num_blocks
        return True

    def forget_chains(self, root: bytes) -> int:
        """Uncache every block whose chain starts at ``root`` (an unloaded adapter's: its KV would be stale
        if an adapter of the same name came back with other weights); blocks in use stay cached. Returns how
        many were forgotten."""
        doomed, grown = {root}, True
        while grown:
            grown = False
            for h, b in self.cached.items():
                origin = self.block_origin[b]
                if h not in doomed and origin is not None and origin[0] in doomed:
                    doomed.add(h)
                    grown = True
        forgotten = 0
        for h in doomed - {root}:
            b = self.cached[h]
            if self.ref_cnt[b] == 0:
                del self.cached[h]
                self.block_hash[b] = self.block_origin[b] = None
                self.block_hits[b] = 0
                self.free.move_to_end(b, last=False)
                forgotten += 1
        return forgotten

    def cached_hashes(self) -> list[str]:
        return [h.hex() for h in self.cached]

    def hottest_cached(self) -> list[int]:
        """Cached blocks, hottest first: the most often reused by prefix hits first (shared prefixes), and
        among equals those held by running requests, then free ones from the most recently freed on."""
        held = [b for h, b in self.cached.items() if self.ref_cnt[b] > 0]
        free = [b for b in reversed(self.free) if self.block_hash[b] is not None]
        order = held + free
        return sorted(order, key=lambda b: -self.block_hits[b])      # stable: recency breaks ties
