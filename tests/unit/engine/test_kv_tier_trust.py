"""Issue 48: the KV disk tier (and warm restart's store) no longer trusts its directory. Blocks are authenticated
with a key from a per-service secret, a file's size is checked before a byte is read, and no link is followed
(``kv_block_file.py``)."""
from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path

import pytest
import torch

from tokenfleet_serving.engine.block_pool import ROOT_HASH, hash_block
from tokenfleet_serving.engine.kv_block_file import FIXED_BYTES, BlockFileError, BlockRecord, decode_block, encode_block, tier_key
from tokenfleet_serving.engine.kv_offload import DiskTier, TierCounters

CONFIG = b"\x05" * 32
SHAPE = (256,)
TOKENS = 4
KEY = tier_key("the service's replica key")


def records(n: int) -> list[BlockRecord]:
    return [BlockRecord(hash_block(ROOT_HASH, [i] * TOKENS), ROOT_HASH, (i,) * TOKENS,
                        torch.full(SHAPE, i, dtype=torch.uint8)) for i in range(n)]


def tier(path: Path, key: bytes = KEY, counters: TierCounters | None = None) -> DiskTier:
    return DiskTier(str(path), 1 << 20, CONFIG, SHAPE, torch.uint8, counters or TierCounters(), key=key,
                    max_tokens=TOKENS)


def written(path: Path, n: int = 3) -> list[BlockRecord]:
    t = tier(path)
    recs = records(n)
    t.store(recs)
    assert t.wait_written()
    t.close()
    return recs


def file_of(path: Path, r: BlockRecord) -> Path:
    return path / f"{CONFIG.hex()[:16]}-{r.hash.hex()}.tfkv"


def test_the_key_comes_from_the_secret_and_without_one_is_the_process_own():
    assert tier_key("s") == tier_key("s") != tier_key("t")
    assert tier_key("s") != b"s" and len(tier_key("s")) == 32            # derived, not the secret itself
    assert tier_key(None) == tier_key("") != tier_key("s")


def test_a_block_planted_without_the_key_is_refused_and_deleted(tmp_path):
    """Someone who can write the volume but does not hold the service's secret: a block with the right name,
    hash chain and an (unkeyed) sha256, or a tag under another key, is never served."""
    [r] = written(tmp_path, 1)
    path = file_of(tmp_path, r)
    raw = path.read_bytes()
    evil = torch.full(SHAPE, 0xEE, dtype=torch.uint8)
    head = raw[:FIXED_BYTES - 32 + 4 * TOKENS]                        # the header, tokens in clear, the KV length
    unkeyed = head + evil.numpy().tobytes()
    for plant in (unkeyed + hashlib.sha256(unkeyed).digest(),
                  encode_block(CONFIG, BlockRecord(r.hash, r.parent, r.tokens), evil, key=tier_key("a guess"))):
        path.write_bytes(plant)
        counters = TierCounters()
        t = tier(tmp_path, counters=counters)
        assert r.hash in t.hashes() and t.load(r.hash) is None
        assert counters.errors == {"corrupt": 1} and not path.exists()
        t.close()
        with pytest.raises(BlockFileError, match="not written with this service's key"):
            decode_block(plant, CONFIG, r.hash, SHAPE, torch.uint8, key=KEY)


def test_the_same_secret_reads_the_tier_after_a_restart_and_another_does_not(tmp_path):
    recs = written(tmp_path)
    same = tier(tmp_path, tier_key("the service's replica key"))
    got = same.load(recs[1].hash)
    assert got is not None and got.data is not None and torch.equal(got.data, recs[1].data)
    same.close()
    other = tier(tmp_path, tier_key("a new replica key"))
    assert other.load(recs[1].hash) is None and other.c.errors == {"corrupt": 1}
    other.close()


def test_a_file_of_the_wrong_size_is_never_read(tmp_path):
    """A 2 GiB file under a block's name was read whole on the step thread (9 s); now a stat refuses it, both
    when the tier indexes its directory and when a file indexed earlier is swapped for it."""
    recs = written(tmp_path, 2)
    counters = TierCounters()
    t = tier(tmp_path, counters=counters)
    assert set(t.hashes()) == {r.hash for r in recs}
    with open(file_of(tmp_path, recs[0]), "r+b") as f:                 # sparse: costs no disk
        f.truncate(2 << 30)
    started = time.monotonic()
    assert t.load(recs[0].hash) is None
    assert time.monotonic() - started < 1.0 and counters.errors == {"corrupt": 1}
    t.close()
    with open(file_of(tmp_path, recs[1]), "r+b") as f:
        f.truncate(FIXED_BYTES + 4 * TOKENS + 256 + 1)                 # off by one byte
    again = tier(tmp_path)
    assert again.hashes() == [] and again.c.errors == {"corrupt": 1}
    again.close()


def test_a_symlinked_directory_switches_the_tier_off_and_nothing_is_written_through_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "replica-0").symlink_to(elsewhere)
    for path in (tmp_path / "store" / "replica-0", tmp_path / "store" / "replica-0" / "below"):
        counters = TierCounters()
        t = tier(path, counters=counters)
        assert not t.enabled and counters.errors == {"symlink": 1}
        t.store(records(2))
        t.close()
    assert list(elsewhere.iterdir()) == []


def test_a_symlinked_block_file_is_neither_indexed_nor_read(tmp_path):
    outside = tmp_path / "outside"
    recs = written(outside, 1)
    store = tmp_path / "store"
    store.mkdir()
    file_of(store, recs[0]).symlink_to(file_of(outside, recs[0]))     # a valid block, through a link
    counters = TierCounters()
    t = tier(store, counters=counters)
    assert t.hashes() == [] and counters.errors == {"corrupt": 1}
    with t.lock:
        t.index[recs[0].hash] = 1                                      # even if it were indexed
    assert t.load(recs[0].hash) is None
    t.close()


def test_block_files_and_directories_are_the_owners_only(tmp_path):
    recs = written(tmp_path / "made" / "here", 1)
    assert stat.S_IMODE(os.stat(file_of(tmp_path / "made" / "here", recs[0])).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "made").st_mode) == 0o700
