"""The hostile layer's tiers family (issue 48): someone who can write a replica's KV disk tier or warm-restart
volume but does not hold the service's secret. Real ``tokenfleet serve`` processes on the same store; the
writer plants a block whose KV is not the model's, swaps a block for a 2 GiB file, or links the replica's
directory elsewhere. None of it is served, stalls the engine, or is followed."""
from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import signal
import struct
import time
from pathlib import Path

import pytest

from harness.server import API_KEY, MODEL_NAME, ProcessServer, http, metric_values, wait_until

pytestmark = pytest.mark.slow

SHARED = ("the fleet serves tokens from a cache of prefix blocks so that every replica of the model "
          "answers the first request of a shared system prompt at once ") * 3
HEAD = 8 + 96                                   # magic, config hash, block hash, parent hash


def serve(model: Path, *extra: str) -> ProcessServer:
    return ProcessServer(model, "--api-key", API_KEY, "--kv-cache-mb", "8", *extra)


def warm(store: Path, name: str = "replica-0") -> tuple[str, ...]:
    return "--prefix-checkpoint-dir", str(store), "--prefix-checkpoint-name", name


def complete(srv: ProcessServer, prompt: str) -> tuple[str, int, float]:
    t0 = time.monotonic()
    status, _, body = http("POST", f"{srv.base_url}/v1/completions",
                           {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                            "ignore_eos": True}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200, body
    out = json.loads(body)
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"], time.monotonic() - t0


def drain(srv: ProcessServer) -> str:
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    wait_until(lambda: "drained" in "".join(srv.log), 10, what="the drain's log")
    return "".join(srv.log)


def errors(srv: ProcessServer, reason: str) -> float:
    return sum(v for k, v in metric_values(srv.base_url).items()
               if k.startswith("tokenfleet:kv_offload_errors") and f"reason={reason}" in k)


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """A replica that served the shared prefix and drained into its store, and what it answered."""
    store = tmp_path_factory.mktemp("store")
    srv = serve(tiny_model, *warm(store))
    try:
        answer = complete(srv, SHARED + "one")[0]
        assert "saved" in drain(srv)
    finally:
        srv.close()
    files = sorted((store / "replica-0").glob("*.tfkv"))
    assert files
    return {"store": store, "answer": answer, "files": [f.name for f in files]}


def copy_store(saved, tmp_path: Path) -> Path:
    shutil.copytree(saved["store"], tmp_path / "store")
    return tmp_path / "store"


def planted(raw: bytes, how: str) -> bytes:
    """The block file ``raw`` with its KV replaced by bytes of the writer's choosing, its name, hashes and
    tokens kept, and a tag the writer can make: an unkeyed sha256 (the former format) or an HMAC under a key
    of their own."""
    (n,) = struct.unpack_from("<I", raw, HEAD)
    kv_at = HEAD + 4 + 4 * n + 8
    kv = bytes([0x3C]) * (len(raw) - 32 - kv_at)
    if how == "unkeyed":
        body = b"TFKVBLK1" + raw[8:kv_at] + kv
        return body + hashlib.sha256(body).digest()
    body = raw[:kv_at] + kv
    return body + hmac.new(b"a key the writer chose", body, hashlib.sha256).digest()


@pytest.mark.parametrize("how", ["unkeyed", "own-key"])
def test_a_planted_block_is_never_served(tiny_model, saved, tmp_path, how):
    """Each of the store's files rewritten with the writer's KV: the replacement loads none of them, deletes
    them, computes the prompt and answers as the model does."""
    store = copy_store(saved, tmp_path)
    for name in saved["files"]:
        path = store / "replica-0" / name
        path.write_bytes(planted(path.read_bytes(), how))
    srv = serve(tiny_model, *warm(store))
    try:
        assert metric_values(srv.base_url)["tokenfleet:prefix_checkpoint_loaded_blocks"] == 0
        text, cached, _ = complete(srv, SHARED + "one")
        assert (text, cached) == (saved["answer"], 0)
        assert errors(srv, "corrupt") >= 1
    finally:
        srv.close()


def test_a_block_swapped_for_a_2_gib_file_is_not_read(tiny_model, saved, tmp_path):
    """The replica indexed its disk tier at start; then every block file becomes a 2 GiB (sparse) file. The
    first request that hits them is answered at once: a stat refuses them, none is read on the step thread."""
    store = copy_store(saved, tmp_path)
    srv = serve(tiny_model, "--kv-offload-disk-path", str(store / "replica-0"))
    try:
        disk = metric_values(srv.base_url)['tokenfleet:kv_offload_blocks{tier=disk}']
        assert disk == len(saved["files"])
        _, _, cold = complete(srv, "an unrelated prompt of about the same length " * 12)
        for name in saved["files"]:
            with open(store / "replica-0" / name, "r+b") as f:
                f.truncate(2 << 30)
        text, cached, took = complete(srv, SHARED + "one")
        assert (text, cached) == (saved["answer"], 0)
        assert took < cold + 5.0, f"{took:.2f} s against {cold:.2f} s without the tier"
        assert errors(srv, "corrupt") >= 1
    finally:
        srv.close()


def test_a_symlinked_replica_directory_is_not_followed(tiny_model, tmp_path):
    """The writer links the replica's directory in the store to a directory of their choosing: the replica
    switches its disk tier off (and says why), serves, and writes nothing there when it drains."""
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store.mkdir()
    elsewhere.mkdir()
    (store / "replica-0").symlink_to(elsewhere)
    srv = serve(tiny_model, *warm(store))
    try:
        assert metric_values(srv.base_url)['tokenfleet:kv_offload_tier_enabled{tier=disk}'] == 0
        assert errors(srv, "symlink") == 1
        complete(srv, SHARED + "one")
        log = drain(srv)
    finally:
        srv.close()
    assert "symbolic link" in log
    assert list(elsewhere.iterdir()) == []
