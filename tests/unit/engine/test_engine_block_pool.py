"""Block pool and KV cache manager: ref counts, hash chain spec, LRU eviction, prefix lookups."""
from __future__ import annotations

import hashlib
import struct

import pytest

from tokenfleet_serving.engine.block_pool import ROOT_HASH, BlockPool, hash_block, hash_prefix_blocks
from tokenfleet_serving.engine.kv_cache_manager import KVCacheManager
from tokenfleet_serving.engine.request import Request
from tokenfleet_serving.engine.sampling_params import SamplingParams


def test_hash_chain_follows_the_documented_spec():
    tokens = [1, 2, 3, 70000, 5, 6, 7, 8, 9]
    h0 = hashlib.sha256(bytes(32) + struct.pack("<4I", 1, 2, 3, 70000)).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert hash_prefix_blocks(tokens, 4) == [h0, h1]          # the partial block [9] is not hashed
    assert hash_block(ROOT_HASH, [1, 2, 3, 70000]) == h0
    # known vector, so any change to the spec is caught even if both sides change together
    assert h0.hex()[:16] == hashlib.sha256(bytes(32) + bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0x70, 0x11, 1, 0])
                                           ).hexdigest()[:16]


def test_hash_depends_on_the_whole_prefix():
    a = hash_prefix_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_prefix_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]


def test_allocate_release_and_ref_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free == 1 and pool.usage == 0.75
    pool.touch([blocks[0]])
    pool.release(blocks)
    assert pool.ref_cnt[blocks[0]] == 1 and pool.num_free == 3
    pool.release([blocks[0]])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.release([blocks[0]])
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_lru_eviction_order_and_unhashed_blocks_reused_first():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache(a, b"A" * 32)
    pool.cache(b, b"B" * 32)
    pool.release([a])          # oldest freed cached block
    pool.release([b])
    pool.release([c])          # unhashed: goes to the head
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [a] and pool.lookup(b"A" * 32) is None and pool.num_evictions == 1
    assert pool.lookup(b"B" * 32) == b
    pool.touch([b])            # a cache hit revives a free cached block
    assert pool.num_free == 0 and pool.ref_cnt[b] == 1


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_manager_reuses_cached_prefix_and_keeps_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r1 = _req("a", list(range(12)))
    assert kv.get_computed_blocks(r1) == []
    assert kv.allocate_slots(r1, 12)
    table = kv.block_table("a")
    assert len(table) == 3 and len(kv.pool.cached) == 3
    r2 = _req("b", list(range(12)))       # identical prompt: last block must be recomputed
    hit = kv.get_computed_blocks(r2)
    assert hit == table[:2]
    assert kv.allocate_slots(r2, 4, hit)
    assert kv.block_table("b")[:2] == table[:2] and kv.pool.ref_cnt[table[0]] == 2
    kv.free(r1)
    kv.free(r2)
    assert kv.pool.num_free == 10
    assert set(kv.pool.cached_hashes()) == {h.hex() for h in hash_prefix_blocks(list(range(12)), 4)}


def test_manager_refuses_when_pool_is_short_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = _req("a", list(range(13)))
    assert not kv.allocate_slots(r, 13)
    assert kv.pool.num_free == 3 and "a" not in kv.block_tables


def test_manager_without_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    r1 = _req("a", list(range(12)))
    assert kv.allocate_slots(r1, 12)
    assert kv.get_computed_blocks(_req("b", list(range(12)))) == [] and not kv.pool.cached
