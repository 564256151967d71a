"""Per-request block tables on top of the block pool, with prefix-cache lookups (and, with KV offload, the
copy back of blocks found in the host or disk tier: ``kv_offload.py``)."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .block_pool import BlockPool
from .request import Request

if TYPE_CHECKING:
    from .kv_offload import KVOffload

log = logging.getLogger("tokenfleet.engine.kv_cache")


@dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # prompt tokens found in cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self.offload: KVOffload | None = None

    def attach_offload(self, offload: KVOffload) -> None:
        """Keep evicted blocks in ``offload``'s tiers and copy lower-tier hits back."""
        self.offload = offload
        self.pool.on_evict = self._on_evict

    def _on_evict(self, evicted) -> None:
        assert self.offload is not None
        try:
            self.offload.on_evict(evicted)
        except Exception as exc:  # noqa: BLE001 - a lower tier must never fail a step: the blocks are just lost
            log.warning("KV offload: keeping %d evicted blocks failed (%s: %s)", len(evicted), type(exc).__name__, exc)

    def _accelerator_run(self, hashes: Sequence[bytes], blocks: list[int], limit: int) -> None:
        for h in hashes[len(blocks):limit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Longest run of cached full blocks of ``req``'s tokens (at least one token is left to compute).
        With KV offload, blocks of that run found in the host or disk tier are copied into free pool blocks
        first (as many as the pool has room for beside what the request still needs)."""
        if not self.enable_prefix_caching:
            return []
        req.update_block_hashes(self.block_size)
        limit = (req.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        self._accelerator_run(req.block_hashes, blocks, limit)
        while self.offload is not None and len(blocks) < limit:
            got = self._copy_back(req, len(blocks), limit, blocks)
            if not got:
                break
            blocks += got
            self._accelerator_run(req.block_hashes, blocks, limit)
        return blocks

    def _copy_back(self, req: Request, start: int, limit: int, held: list[int]) -> list[int]:
        """Copy the lower-tier run of ``req``'s blocks from ``start`` into new cached pool blocks."""
        assert self.offload is not None
        run = self.offload.lower_run(req.block_hashes[start:limit])
        if not run:
            return []
        rest = -(-max(req.num_tokens - (start + len(run)) * self.block_size, 1) // self.block_size)
        room = self.pool.num_free - self.pool.num_free_among(held) - rest
        run = run[:max(room, 0)]
        if not run:
            return []
        started = time.perf_counter()
        records, data, tiers = self.offload.fetch(run)
        if not records or data is None:
            return []
        self.pool.pin(held)
        try:
            new = self.pool.allocate(len(records))
            self.offload.io.write(new, data)
            for b, r in zip(new, records):
                self.pool.cache(b, r.hash, (r.parent, r.tokens))
            self.pool.release(new)
        finally:
            self.pool.release(held)
        self.offload.note_copied_in(tiers, time.perf_counter() - started)
        req.lower_tier_blocks["host"] = req.lower_tier_blocks.get("host", 0) + tiers.count("host")
        req.lower_tier_blocks["disk"] = req.lower_tier_blocks.get("disk", 0) + tiers.count("disk")
        return new

    def count_admission(self, req: Request) -> None:
        """A request's first admission: its prompt tokens as prefix-cache queries and hits (per tier)."""
        self.stats.queries += req.num_prompt_tokens
        self.stats.hits += req.num_cached_tokens
        if self.offload is not None:
            bs = self.block_size
            self.offload.count_admission(req.num_prompt_tokens, req.num_cached_tokens,
                                         req.lower_tier_blocks.get("host", 0) * bs,
                                         req.lower_tier_blocks.get("disk", 0) * bs)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req``; False if the pool is short."""
        table = self.block_tables.get(req.request_id, [])
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(table) - len(computed_blocks)
        available = self.pool.num_free - self.pool.num_free_among(computed_blocks)
        if needed > available:
            return False
        self.pool.touch(computed_blocks)
        table = table + list(computed_blocks) + self.pool.allocate(max(needed, 0))
        self.block_tables[req.request_id] = table
        if self.enable_prefix_caching:
            req.update_block_hashes(self.block_size)
            start = self._num_hashed.get(req.request_id, 0)
            full = min(total // self.block_size, len(req.block_hashes))
            bs = self.block_size
            for i in range(start, full):
                parent = req.block_hashes[i - 1] if i else req.root_hash
                self.pool.cache(table[i], req.block_hashes[i], (parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs])))
            self._num_hashed[req.request_id] = max(start, full)
        return True

    def free(self, req: Request) -> None:
        table = self.block_tables.pop(req.request_id, None)
        self._num_hashed.pop(req.request_id, None)
        if table:
            self.pool.release(table)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    @property
    def usage(self) -> float:
        return self.pool.usage
