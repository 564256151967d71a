"""Warm restart: ``tokenfleet serve`` processes that keep their prefix cache in their disk tier (the store) and
a replacement that starts on it.

A replacement that finds its predecessor's blocks hits on the shared prefix with its first request and
generates what the predecessor did (float32, greedy); one that finds blocks of another model, revision or
dtype, or corrupt ones, starts cold and says why in its log."""
from __future__ import annotations

import json
import signal

import pytest

from harness.server import API_KEY, MODEL_NAME, ProcessServer, http, metric_values, wait_until

pytestmark = pytest.mark.slow

SHARED = ("the fleet serves tokens from a cache of prefix blocks so that every replica of the model "
          "answers the first request of a shared system prompt at once ") * 3


def serve(model, store, name="replica-0", *extra):
    return ProcessServer(model, "--api-key", API_KEY, "--kv-cache-mb", "8", "--prefix-checkpoint-dir", str(store),
                         "--prefix-checkpoint-name", name, *extra)


def complete(srv, prompt):
    status, _, body = http("POST", f"{srv.base_url}/v1/completions",
                           {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                            "ignore_eos": True}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200, body
    out = json.loads(body)
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def drain(srv) -> str:
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    wait_until(lambda: "drained" in "".join(srv.log), 10, what="the drain's log")
    return "".join(srv.log)


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """A replica that served the shared prefix and drained: its checkpoint, and what it answered."""
    store = tmp_path_factory.mktemp("store")
    srv = serve(tiny_model, store)
    try:
        answers = {q: complete(srv, SHARED + q)[0] for q in ("one", "two")}
        log = drain(srv)
    finally:
        srv.close()
    assert "saved" in log and list((store / "replica-0").glob("*.tfkv"))
    return {"store": store, "answers": answers}


def test_a_replacement_starts_warm_and_answers_as_its_predecessor(tiny_model, saved):
    srv = serve(tiny_model, saved["store"])
    try:
        loaded = metric_values(srv.base_url)["tokenfleet:prefix_checkpoint_loaded_blocks"]
        assert loaded > 0 and "warm restart: loaded" in "".join(srv.log)
        text, cached = complete(srv, SHARED + "one")
        assert cached >= 16 * (len(SHARED) // 40)          # most of the shared prompt, from the first request on
        assert text == saved["answers"]["one"]
        phases = {k: v for k, v in metric_values(srv.base_url).items() if k.startswith("tokenfleet:startup_phase")}
        assert set(phases) == {f"tokenfleet:startup_phase_seconds{{phase={p}}}"
                               for p in ("weights_loaded", "kernels_ready", "prefix_cache_loaded", "first_token")}
        assert 0 < phases["tokenfleet:startup_phase_seconds{phase=weights_loaded}"] <= \
            phases["tokenfleet:startup_phase_seconds{phase=first_token}"]
    finally:
        srv.close()


def test_a_killed_replica_leaves_its_periodic_checkpoint(tiny_model, tmp_path):
    srv = serve(tiny_model, tmp_path, "replica-1", "--prefix-checkpoint-interval", "0.5")
    try:
        expected, _ = complete(srv, SHARED + "three")
        wait_until(lambda: "saved" in "".join(srv.log), 60, what="a periodic save")
    finally:
        srv.close()                                        # SIGKILL: no drain, no last save
    srv = serve(tiny_model, tmp_path, "replica-1")
    try:
        text, cached = complete(srv, SHARED + "three")
        assert cached > 0 and text == expected
    finally:
        srv.close()


@pytest.mark.parametrize("case", ["other-weights", "dtype", "truncated", "flipped"])
def test_a_checkpoint_it_must_not_use_is_refused_and_the_replica_starts_cold(tiny_model, saved, tmp_path,
                                                                             tmp_path_factory, case):
    from tokenfleet_serving.testing_models import create_random_checkpoint

    model, extra, says = tiny_model, (), ""
    (tmp_path / "replica-0").mkdir()
    for f in (saved["store"] / "replica-0").glob("*.tfkv"):
        data = f.read_bytes()
        if case == "truncated":
            data = data[: len(data) // 2]
        elif case == "flipped":
            data = bytes(data[:-1000]) + bytes([data[-1000] ^ 1]) + data[-999:]
        (tmp_path / "replica-0" / f.name).write_bytes(data)
    if case == "other-weights":       # same architecture and config, other training: another revision
        model = create_random_checkpoint(tmp_path_factory.mktemp("other") / "tiny", max_position_embeddings=512,
                                         seed=99)
        says = "of another model, revision, dtype, KV dtype or block size"
    elif case == "dtype":
        extra, says = ("--dtype", "bfloat16"), "of another model, revision, dtype, KV dtype or block size"
    elif case == "truncated":         # never read: its size is not a block's (it is not indexed)
        says = "not the size of a block of this engine: never read"
    else:
        says = "refused (corrupt)"
    srv = serve(model, tmp_path, "replica-0", *extra)
    try:
        log = "".join(srv.log)
        assert says in log
        assert metric_values(srv.base_url)["tokenfleet:prefix_checkpoint_loaded_blocks"] == 0
        _, cached = complete(srv, SHARED + "one")
        assert cached == 0
    finally:
        srv.close()
