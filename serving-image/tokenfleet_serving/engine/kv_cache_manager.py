"""Per-request block tables on top of the block pool, with prefix-cache lookups."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .block_pool import BlockPool
from .request import Request


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

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Longest run of cached full blocks of ``req``'s tokens (at least one token is left to compute)."""
        if not self.enable_prefix_caching:
            return []
        req.update_block_hashes(self.block_size)
        limit = (req.num_tokens - 1) // self.block_size
        blocks = []
        for h in req.block_hashes[:limit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

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
