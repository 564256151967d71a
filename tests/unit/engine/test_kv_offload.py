"""KV offload tiers (``engine/kv_offload.py``): host and disk tiers under the accelerator's prefix cache.

Greedy output with tiers is token for token the output without them (float32), prefixes evicted from the
pool come back from the host or disk tier instead of being recomputed, each tier is an LRU, disk blocks that
are corrupt, foreign or forged are never loaded, and a disk that cannot be written switches its tier off while
serving goes on."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tokenfleet_serving.engine import LLMEngine, SamplingParams
from tokenfleet_serving.engine.block_pool import ROOT_HASH, hash_block
from tokenfleet_serving.engine.kv_block_file import BlockFileError, BlockRecord, decode_block, encode_block
from tokenfleet_serving.engine.kv_offload import HostTier, KVOffloadConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BS = 4
PREFIX_BLOCKS = 10
KEY = b"k" * 32                  # a tier key (kv_block_file.tier_key)


def prefix(i: int) -> list[int]:
    return [(j * 37 + 11 + 101 * i) % 400 + 20 for j in range(PREFIX_BLOCKS * BS)]


_BLOCK_BYTES: dict[str, int] = {}


def new_engine(model, num_blocks=24, host_blocks=0, disk=None, disk_mb=64, **kw):
    """An fp32 engine whose pool holds ``num_blocks`` blocks of 4 tokens, with a host tier of ``host_blocks``."""
    if str(model) not in _BLOCK_BYTES:
        probe = LLMEngine.from_pretrained(model, dtype="float32", kv_cache_bytes=1 << 20, block_size=BS)
        _BLOCK_BYTES[str(model)] = probe.runner.kv_block_bytes(BS)
    block_bytes = _BLOCK_BYTES[str(model)]
    offload = None
    if host_blocks or disk is not None:
        offload = KVOffloadConfig(host_blocks * block_bytes, str(disk) if disk is not None else None, disk_mb * 2**20)
    return LLMEngine.from_pretrained(model, dtype="float32", kv_cache_bytes=num_blocks * block_bytes, block_size=BS,
                                     kv_offload=offload, **kw)


def run_rounds(eng, rounds=2, n=4):
    """Each of ``n`` shared prefixes (10 blocks each, the pool holds 24 blocks: two prefixes) ``rounds`` times,
    one request at a time, with its own suffix."""
    outs = []
    for r in range(rounds):
        for i in range(n):
            [o] = eng.generate([prefix(i) + [300 + r, 301 + i, 302]], GREEDY)
            outs.append(o)
    return outs


@pytest.fixture(scope="module")
def baseline(llama_dir):
    return run_rounds(new_engine(llama_dir))


def test_host_tier_copies_evicted_prefixes_back_with_identical_greedy_tokens(llama_dir, baseline):
    eng = new_engine(llama_dir, host_blocks=100)
    outs = run_rounds(eng)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in baseline]
    # without tiers the second round recomputes every prefix (the pool holds two of four)
    assert [o.num_cached_tokens for o in baseline[4:]] == [0, 0, 0, 0]
    # with the host tier every prefix of the second round is served: 10 blocks of 4 tokens
    assert [o.num_cached_tokens for o in outs[4:]] == [40, 40, 40, 40]
    s = eng.stats().kv_offload
    assert s is not None
    assert s["host"].hits == 4 * 40 and s["host"].load_bytes > 0 and s["host"].store_bytes > 0
    assert s["accelerator"].queries == 8 * 43
    assert s["host"].queries == s["accelerator"].queries - s["accelerator"].hits
    tiers = eng.cached_block_hashes_by_tier()
    assert tiers["host"] and not tiers["disk"]
    # a block is never lost between tiers: every block of every prefix is in one of them
    every = {h.hex() for i in range(4) for h in _hashes(prefix(i))}
    assert every <= set(tiers["accelerator"]) | set(tiers["host"])


def _hashes(tokens):
    out, parent = [], ROOT_HASH
    for k in range(len(tokens) // BS):
        parent = hash_block(parent, tokens[k * BS:(k + 1) * BS])
        out.append(parent)
    return out


def test_disk_tier_serves_what_the_host_tier_pushed_out(llama_dir, baseline, tmp_path):
    eng = new_engine(llama_dir, host_blocks=4, disk=tmp_path / "kv")      # the host tier holds a few blocks
    assert eng.offload is not None and eng.offload.host is not None and eng.offload.host.capacity == 4
    outs = run_rounds(eng)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in baseline]
    assert [o.num_cached_tokens for o in outs[4:]] == [40, 40, 40, 40]
    s = eng.stats().kv_offload
    assert s["disk"].hits > 0 and s["disk"].store_bytes > 0 and s["disk"].load_bytes > 0
    assert eng.cached_block_hashes_by_tier()["disk"]
    eng.close()


def test_host_tier_is_an_lru():
    tier = HostTier(2, (1, 2, 1, 4, 2), torch.float32, pin=False)
    recs = [BlockRecord(bytes([i]) * 32, ROOT_HASH, (i,) * 4) for i in range(3)]
    data = torch.arange(3 * 16, dtype=torch.float32).view(3, 1, 2, 1, 4, 2)
    assert tier.store(recs[:2], data[:2]) == []
    tier.get([recs[0].hash])                               # block 0 is now the most recently used
    out = tier.store(recs[2:], data[2:])
    assert [r.hash for r in out] == [recs[1].hash]         # so block 1 goes down, with its KV
    assert out[0].data is not None and torch.equal(out[0].data, data[1])
    assert recs[0].hash in tier and recs[2].hash in tier and recs[1].hash not in tier
    _, got = tier.get([recs[2].hash, recs[0].hash])
    assert torch.equal(got, data[[2, 0]])


def test_a_replica_that_mounts_the_disk_tier_starts_with_it_filled(llama_dir, baseline, tmp_path):
    first = new_engine(llama_dir, host_blocks=100, disk=tmp_path / "kv")
    run_rounds(first, rounds=1)
    assert first.flush_kv_to_disk(10_000) > 0
    first.close()
    second = new_engine(llama_dir, disk=tmp_path / "kv")
    assert len(second.cached_block_hashes_by_tier()["disk"]) >= 4 * PREFIX_BLOCKS
    [o] = second.generate([prefix(2) + [300, 303, 302]], GREEDY)
    assert o.num_cached_tokens == 40
    assert o.new_token_ids == baseline[2].new_token_ids
    assert second.stats().kv_offload["disk"].hits == 40
    second.close()


def _block_file(tmp_path: Path) -> Path:
    files = sorted(tmp_path.glob("*.tfkv"))
    assert files
    return files[0]


def test_corrupt_foreign_and_forged_disk_blocks_are_never_loaded(llama_dir, baseline, tmp_path):
    first = new_engine(llama_dir, host_blocks=100, disk=tmp_path / "kv")
    run_rounds(first, rounds=1)
    first.flush_kv_to_disk(10_000)
    first.close()
    files = sorted((tmp_path / "kv").glob("*.tfkv"))
    # flip one KV byte in every file: all of them are corrupt now
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[-100] ^= 0x40
        f.write_bytes(bytes(raw))
    eng = new_engine(llama_dir, disk=tmp_path / "kv")
    [o] = eng.generate([prefix(1) + [300, 302, 302]], GREEDY)
    assert o.num_cached_tokens == 0 and o.new_token_ids == baseline[1].new_token_ids
    assert eng.stats().kv_offload["disk"].errors.get("corrupt", 0) >= 1
    eng.close()
    # a block of another model (another config hash), even under this model's file name, is refused
    raw = encode_block(b"\x01" * 32, BlockRecord(hash_block(ROOT_HASH, [1, 2, 3, 4]), ROOT_HASH, (1, 2, 3, 4)),
                       torch.zeros(2 * 2 * 2 * 4 * 8, dtype=torch.uint8), key=KEY)
    with pytest.raises(BlockFileError) as err:
        decode_block(raw, b"\x02" * 32, hash_block(ROOT_HASH, [1, 2, 3, 4]), (256,), torch.uint8, key=KEY)
    assert err.value.reason == "foreign"
    # a block whose hash is not its tokens' (forged), and one filed under another name
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    forged = encode_block(b"\x02" * 32, BlockRecord(h, ROOT_HASH, (1, 2, 3, 5)),
                          torch.zeros(2 * 2 * 2 * 4 * 8, dtype=torch.uint8), key=KEY)
    with pytest.raises(BlockFileError) as err:
        decode_block(forged, b"\x02" * 32, h, (256,), torch.uint8, key=KEY)
    assert err.value.reason == "forged"
    good = encode_block(b"\x02" * 32, BlockRecord(h, ROOT_HASH, (1, 2, 3, 4)),
                        torch.ones(2 * 2 * 2 * 4 * 8, dtype=torch.uint8), key=KEY)
    assert decode_block(good, b"\x02" * 32, h, (256,), torch.uint8, key=KEY).tokens == (1, 2, 3, 4)
    with pytest.raises(BlockFileError):
        decode_block(good, b"\x02" * 32, hash_block(ROOT_HASH, [9, 9, 9, 9]), (256,), torch.uint8, key=KEY)


def test_another_dtype_or_model_never_sees_the_blocks(llama_dir, checkpoints, tmp_path):
    first = new_engine(llama_dir, host_blocks=100, disk=tmp_path / "kv")
    run_rounds(first, rounds=1)
    first.flush_kv_to_disk(10_000)
    first.close()
    other = LLMEngine.from_pretrained(llama_dir, dtype="bfloat16", kv_cache_bytes=1 << 20, block_size=BS,
                                      kv_offload=KVOffloadConfig(0, str(tmp_path / "kv"), 64 << 20))
    assert other.cached_block_hashes_by_tier()["disk"] == []
    [o] = other.generate([prefix(0) + [1, 2, 3]], GREEDY)
    assert o.num_cached_tokens == 0
    other.close()


def test_an_unwritable_disk_path_switches_the_tier_off_and_serving_goes_on(llama_dir, baseline, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    eng = new_engine(llama_dir, host_blocks=100, disk=blocker / "kv")
    s = eng.stats().kv_offload
    assert not s["disk"].enabled and s["disk"].errors == {"unwritable": 1}
    assert sum("disk tier switched off" in r.message for r in caplog.records) == 1
    outs = run_rounds(eng)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in baseline]
    assert [o.num_cached_tokens for o in outs[4:]] == [40, 40, 40, 40]        # the host tier still serves


def _full_disk(tmp_path: Path):
    """A directory on a 64 KiB tmpfs where this process may mount one; else a file-size limit of 1 byte's
    worth (RLIMIT_FSIZE): either way a write of a block file fails as on a full disk."""
    target = tmp_path / "small"
    target.mkdir()
    if os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)],
                                            capture_output=True).returncode == 0:
        return target, lambda: subprocess.run(["umount", "-l", str(target)], check=False)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, old[1]))

    def undo():
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)
    return target, undo


def test_a_full_disk_switches_the_tier_off_and_serving_goes_on(llama_dir, baseline, tmp_path, caplog):
    where, undo = _full_disk(tmp_path)
    try:
        eng = new_engine(llama_dir, host_blocks=4, disk=where, disk_mb=64)
        outs = run_rounds(eng)
        assert eng.offload is not None and eng.offload.disk is not None
        eng.offload.disk.wait_written()
        s = eng.stats().kv_offload
        assert not s["disk"].enabled and s["disk"].errors.get("write") == 1
        assert sum("disk tier switched off" in r.message for r in caplog.records) == 1
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in baseline]
        assert eng.cached_block_hashes_by_tier()["disk"] == []
        more = run_rounds(eng, rounds=1)                                     # and it keeps serving
        assert [o.new_token_ids for o in more] == [o.new_token_ids for o in baseline[:4]]
        eng.close()
    finally:
        undo()


def test_tiers_are_refused_at_tensor_parallel_above_one_and_without_prefix_caching(llama_dir):
    with pytest.raises(ValueError, match="prefix caching"):
        LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=1 << 20, block_size=BS,
                                  enable_prefix_caching=False, kv_offload=KVOffloadConfig(1 << 20))


def test_disk_tier_is_an_lru_within_its_byte_budget(tmp_path):
    from tokenfleet_serving.engine.kv_offload import DiskTier, TierCounters

    data = torch.arange(256, dtype=torch.uint8)
    recs = [BlockRecord(hash_block(ROOT_HASH, [i] * 4), ROOT_HASH, (i,) * 4, data) for i in range(5)]
    size = len(encode_block(b"\x03" * 32, recs[0], data, key=KEY))
    counters = TierCounters()
    tier = DiskTier(str(tmp_path), 3 * size, b"\x03" * 32, (256,), torch.uint8, counters, key=KEY, max_tokens=4)
    tier.store(recs[:3])
    assert tier.wait_written()
    assert tier.load(recs[0].hash) is not None              # block 0 is now the most recently used
    tier.store(recs[3:])
    assert tier.wait_written()
    assert set(tier.hashes()) == {recs[0].hash, recs[3].hash, recs[4].hash}
    assert len(list(tmp_path.glob("*.tfkv"))) == 3 and counters.blocks == 3
    got = tier.load(recs[4].hash)
    assert got is not None and got.tokens == (4,) * 4 and got.data is not None and torch.equal(got.data, data)
    tier.close()
    again = DiskTier(str(tmp_path), 3 * size, b"\x03" * 32, (256,), torch.uint8, TierCounters(), key=KEY,
                     max_tokens=4)   # a restart
    assert set(again.hashes()) == {recs[0].hash, recs[3].hash, recs[4].hash}
    other = DiskTier(str(tmp_path), 3 * size, b"\x04" * 32, (256,), torch.uint8, TierCounters(), key=KEY,
                     max_tokens=4)   # another model
    assert other.hashes() == [] and other.c.errors == {"foreign": 3}
    again.close()
    other.close()


def test_a_replacement_loads_the_disk_tier_into_the_accelerator_before_its_first_request(llama_dir, baseline,
                                                                                           tmp_path):
    first = new_engine(llama_dir, host_blocks=100, disk=tmp_path / "kv")
    run_rounds(first, rounds=1)
    first.flush_kv_to_disk(10_000)
    first.close()
    second = new_engine(llama_dir, disk=tmp_path / "kv")
    loaded = second.load_from_disk_tier(10_000)
    assert 0 < loaded <= 24                                    # as many as the pool holds, parents first
    assert second.kv.pool.num_free == second.kv.pool.num_blocks    # loaded blocks are free cached blocks
    tiers = second.cached_block_hashes_by_tier()
    for h in tiers["accelerator"]:                            # every loaded block's parent is loaded or the root
        b = second.kv.pool.lookup(bytes.fromhex(h))
        assert b is not None
        origin = second.kv.pool.block_origin[b]
        assert origin is not None and (origin[0] == ROOT_HASH or origin[0].hex() in tiers["accelerator"])
    second.close()
