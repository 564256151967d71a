"""Prefix-cache checkpoints (``engine/prefix_checkpoint.py``): a fresh engine that loads one hits at once and
generates exactly what the engine that wrote it would (float32); a corrupt, truncated or foreign file is
never loaded."""
from __future__ import annotations

import json

import pytest

from tokenfleet_serving.engine import LLMEngine, SamplingParams
from tokenfleet_serving.engine.block_pool import ROOT_HASH
from tokenfleet_serving.engine.prefix_checkpoint import (
    CheckpointUnusable,
    Snapshot,
    engine_identity,
    export_snapshot,
    import_snapshot,
    read_checkpoint,
    write_checkpoint,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SHARED = [(i * 37 + 11) % 400 + 20 for i in range(40)]      # 10 blocks of 4


def new_engine(model, **kw):
    return LLMEngine.from_pretrained(model, dtype="float32", kv_cache_bytes=1 << 20, block_size=4, **kw)


def serve_shared_prefix(eng, n=3):
    return eng.generate([SHARED + [300 + i, 301 + i] for i in range(n)], GREEDY)


@pytest.fixture(scope="module")
def written(llama_dir, tmp_path_factory):
    eng = new_engine(llama_dir)
    outs = serve_shared_prefix(eng)
    snap = export_snapshot(eng, max_blocks=1000)
    path = tmp_path_factory.mktemp("prefix") / "replica-0.tfprefix"
    write_checkpoint(path, snap, engine_identity(eng), written_by="test")
    return {"engine": eng, "snap": snap, "path": path, "outputs": outs}


def test_a_fresh_engine_that_loads_the_checkpoint_hits_and_generates_the_same_tokens(llama_dir, written):
    eng = new_engine(llama_dir)
    snap, header = read_checkpoint(written["path"], engine_identity(eng))
    assert header["written_by"] == "test" and len(snap) == len(written["snap"]) >= 10
    assert import_snapshot(eng, snap) == len(snap)
    assert set(eng.cached_block_hashes()) >= {h.hex() for h in written["snap"].hashes}
    assert eng.stats().kv_cache_usage == 0                      # loaded blocks are free until used
    prompt = SHARED + [390, 391, 392]
    [warm] = eng.generate([prompt], GREEDY)
    assert warm.num_cached_tokens == 40                         # every shared block came from the file
    [cold] = new_engine(llama_dir).generate([prompt], GREEDY)
    assert cold.num_cached_tokens == 0
    assert warm.new_token_ids == cold.new_token_ids
    # the served prompts themselves (whose last blocks are in the file too) give the writer's tokens
    again = eng.generate([SHARED + [300, 301]], GREEDY)
    assert again[0].new_token_ids == written["outputs"][0].new_token_ids


def test_the_export_is_hottest_first_bounded_and_every_parent_comes_first(written):
    eng = written["engine"]
    for limit in (1, 5, 12):
        snap = export_snapshot(eng, max_blocks=limit)
        assert 0 < len(snap) <= limit
        seen = {ROOT_HASH}
        for h, parent in zip(snap.hashes, snap.parents):
            assert parent in seen
            seen.add(h)
        assert tuple(snap.kv.shape[:1]) == (len(snap),)
    # the shared prompt's blocks, reused by every later request, come before any request's own tail
    from tokenfleet_serving.engine.block_pool import hash_prefix_blocks

    shared = set(hash_prefix_blocks(SHARED, 4))
    assert set(export_snapshot(eng, max_blocks=len(shared)).hashes) == shared


def test_a_corrupt_or_truncated_file_is_ignored(llama_dir, written, tmp_path):
    eng = new_engine(llama_dir)
    data = written["path"].read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40                             # one bit in the KV tensors
    for name, content in (("flipped", bytes(flipped)), ("truncated", data[: len(data) - 100]),
                          ("header-only", data[:40]), ("empty", b"")):
        path = tmp_path / f"{name}.tfprefix"
        path.write_bytes(content)
        with pytest.raises(CheckpointUnusable, match="truncated|corrupt"):
            read_checkpoint(path, engine_identity(eng))
    assert eng.cached_block_hashes() == []


@pytest.mark.parametrize("change, says", [
    ({"model_config_sha256": "0" * 64}, "model (config.json)"),
    ({"revision": "v2"}, "revision"),
    ({"dtype": "bfloat16"}, "dtype"),
    ({"block_size": 16}, "KV block size"),
])
def test_a_checkpoint_of_another_model_revision_or_dtype_is_refused_naming_what_differs(llama_dir, written, tmp_path,
                                                                                      change, says):
    eng = new_engine(llama_dir)
    theirs = engine_identity(eng) | change
    path = tmp_path / "other.tfprefix"
    write_checkpoint(path, written["snap"], theirs)
    with pytest.raises(CheckpointUnusable, match="another model, revision or dtype") as err:
        read_checkpoint(path, engine_identity(eng))
    assert says in str(err.value)


def test_another_checkpoint_directory_is_another_model(checkpoints, written):
    other = new_engine(checkpoints["qwen2"])
    with pytest.raises(CheckpointUnusable, match="model \\(config.json\\)"):
        read_checkpoint(written["path"], engine_identity(other))


def test_a_block_whose_hash_does_not_match_its_tokens_is_not_loaded_nor_are_its_children(llama_dir, written,
                                                                                          tmp_path):
    snap = written["snap"]
    bad = 2                                                     # a block with children in the file
    assert any(p == snap.hashes[bad] for p in snap.parents)
    tokens = list(snap.tokens)
    tokens[bad] = tuple(t + 1 for t in tokens[bad])
    forged = Snapshot(snap.hashes, snap.parents, tokens, snap.kv)
    eng = new_engine(llama_dir)
    path = tmp_path / "forged.tfprefix"
    write_checkpoint(path, forged, engine_identity(eng))       # a valid checksum over a wrong block
    loaded, _ = read_checkpoint(path, engine_identity(eng))
    added = import_snapshot(eng, loaded)
    cached = set(eng.cached_block_hashes())
    assert snap.hashes[bad].hex() not in cached
    descendants = {snap.hashes[bad]}
    for h, p in zip(snap.hashes, snap.parents):
        if p in descendants:
            descendants.add(h)
    assert not {h.hex() for h in descendants} & cached
    assert added == len(snap) - len(descendants)


def test_loading_is_refused_while_requests_run(llama_dir, written):
    eng = new_engine(llama_dir)
    eng.add_request("busy", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="idle engine"):
        import_snapshot(eng, written["snap"])


def test_the_header_is_json_with_the_identity(written):
    data = written["path"].read_bytes()
    assert data[:8] == b"TFPREFIX"
    length = int.from_bytes(data[12:20], "little")
    header = json.loads(data[20:20 + length])
    assert header["identity"]["dtype"] == "float32" and header["num_blocks"] == len(written["snap"])
