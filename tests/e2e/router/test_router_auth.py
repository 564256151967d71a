"""Who may call what: clients authenticate at the router with keys from a mounted Secret; the router calls
the replicas with its own key, which clients never see; a replica's /cache/blocks answers only that key;
/metrics stays open and carries nothing derived from prompts (issue 19, defect 8)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenfleet_serving.engine.tokenizer import load_tokenizer
from tokenfleet_serving.router.prefix import block_hashes

from harness.router import MODEL_NAME, ROUTER_KEY, http, metric_samples, start_backend, start_router, wait_until, write_endpoints

pytestmark = pytest.mark.slow

CLIENT_KEY, OTHER_CLIENT_KEY, ROTATED_KEY = "client-key-alice-0123456789", "client-key-bob-9876543210", "rotated-key-01"
MARKER = "zebra quokka narwhal"                       # in prompts and session ids; must not show in /metrics


def write_secret(directory: Path, files: dict[str, str]) -> None:
    """A Secret volume as the kubelet lays it out: data in a timestamped dir, '..data' pointing at it,
    one symlink per key; an update swaps '..data' atomically."""
    directory.mkdir(exist_ok=True)
    stamp = directory / f"..{time.monotonic_ns()}"
    stamp.mkdir()
    for name, text in files.items():
        (stamp / name).write_text(text)
    tmp = directory / "..data_tmp"
    os.symlink(stamp.name, tmp)
    os.replace(tmp, directory / "..data")
    for name in files:
        link = directory / name
        if not link.is_symlink():
            os.symlink(f"..data/{name}", link)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(base_url: str, headers: dict, prompt: str = "hello there", **extra):
    return http("POST", f"{base_url}/v1/completions",
                {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}, headers)


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("auth")
    keys = d / "client-keys"
    write_secret(keys, {"alice": f"# alice's key\n{CLIENT_KEY}\n", "bob": OTHER_CLIENT_KEY})
    procs = []
    try:
        keyed = start_backend(tiny_model, "--api-key", ROUTER_KEY)
        procs.append(keyed)
        keyless = start_backend(tiny_model)
        procs.append(keyless)
        config = {"service": "tiny", "models": [MODEL_NAME], "policy": "prefix-aware", "kvBlockSize": 16,
                  "modelPath": str(tiny_model), "sessionAffinity": {"enabled": True, "header": "X-Session-Id"}}
        (d / "router.json").write_text(json.dumps(config))
        write_endpoints(d / "endpoints.json", {"tiny-0-0": keyed, "tiny-1-0": keyless})
        router = start_router(d / "router.json", "--client-keys", str(keys), "--backend-api-key", ROUTER_KEY)
        procs.append(router)
        wait_until(lambda: metric_samples(router.base_url).get("tokenfleet_router_backends{state=routable}") == 2,
                   60, what="both backends routable")
        yield {"router": router, "keyed": keyed, "keyless": keyless, "keys": keys, "model": tiny_model}
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("headers", [{}, bearer("wrong"), bearer(ROUTER_KEY), {"Authorization": CLIENT_KEY},
                                     {"Authorization": f"Basic {CLIENT_KEY}"}, bearer(CLIENT_KEY + "x"),
                                     bearer(CLIENT_KEY[:-1])],
                         ids=["none", "wrong", "the router's own key", "no scheme", "basic", "longer", "shorter"])
def test_clients_without_a_client_key_get_401(fleet, headers):
    router = fleet["router"]
    for method, path, body in [("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "hi"}),
                               ("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": []}),
                               ("GET", "/v1/models", None)]:
        status, hdrs, raw = http(method, router.base_url + path, body, headers)
        assert status == 401, raw
        err = json.loads(raw)["error"]
        assert err == {"message": err["message"], "type": "authentication_error", "param": None, "code": 401}
        assert hdrs.get("WWW-Authenticate") == "Bearer"


def test_probes_and_metrics_stay_open(fleet):
    router = fleet["router"]
    assert http("GET", f"{router.base_url}/health")[0] == 200
    assert http("GET", f"{router.base_url}/ready")[0] == 200
    assert http("GET", f"{router.base_url}/metrics")[0] == 200


def test_a_client_key_is_served_and_never_reaches_a_replica(fleet):
    router, keyed = fleet["router"], fleet["keyed"]
    for key in (CLIENT_KEY, OTHER_CLIENT_KEY):
        for _ in range(4):              # both backends, whichever the router picks
            status, _, raw = complete(router.base_url, bearer(key), prompt=f"request {time.monotonic_ns()}")
            assert status == 200, raw
    status, _, raw = http("GET", f"{router.base_url}/v1/models", None, bearer(CLIENT_KEY))
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == [MODEL_NAME]
    # the replica takes only the router's key: a client's key (or none) is refused there
    assert complete(keyed.base_url, bearer(CLIENT_KEY))[0] == 401
    assert complete(keyed.base_url, {})[0] == 401
    assert complete(keyed.base_url, bearer(ROUTER_KEY))[0] == 200
    # and so are its prefix-cache hashes
    assert http("GET", f"{keyed.base_url}/cache/blocks", None, bearer(CLIENT_KEY))[0] == 401
    assert http("GET", f"{keyed.base_url}/cache/blocks")[0] == 401
    assert http("GET", f"{keyed.base_url}/cache/blocks", None, bearer(ROUTER_KEY))[0] == 200


def test_a_replica_without_a_key_closes_its_cache_hashes_and_is_still_routed(fleet):
    router, keyless = fleet["router"], fleet["keyless"]
    status, _, raw = http("GET", f"{keyless.base_url}/cache/blocks", None, bearer(ROUTER_KEY))
    assert status == 403 and json.loads(raw)["error"]["type"] == "permission_error"
    assert http("GET", f"{keyless.base_url}/cache/blocks")[0] == 403
    # Sequential requests with new prompts go where the load is least; on a loaded host one replica can take
    # several in a row, so ask until both have served (or 40 requests).
    served: set[str] = set()
    for i in range(40):
        served.add(complete(router.base_url, bearer(CLIENT_KEY), prompt=f"{i} spread me {i}")[1]["x-tokenfleet-backend"])
        if len(served) == 2:
            break
    assert served == {"tiny-0-0", "tiny-1-0"}
    samples = metric_samples(router.base_url)
    assert samples["tokenfleet_router_backend_cached_blocks{backend=tiny-1-0}"] == 0


def test_metrics_expose_nothing_derived_from_prompts(fleet):
    """Scrape both layers after prompts with a marker: no prompt text, no token ids' block hashes, no session
    keys; every label is one of a fixed set of names, with values that never come from a request."""
    router, keyed, model = fleet["router"], fleet["keyed"], fleet["model"]
    prompts = [f"{MARKER} {i} " + "the same long shared prefix of words " * 8 for i in range(3)]
    for i, p in enumerate(prompts):
        assert complete(router.base_url, bearer(CLIENT_KEY) | {"X-Session-Id": f"{MARKER}-session-{i}"},
                        prompt=p, user=f"{MARKER}-user")[0] == 200
    tokenizer = load_tokenizer(model)
    hashes = {h for p in prompts for h in block_hashes(tuple(tokenizer.encode(p)), 16)}
    assert hashes
    allowed_labels = {"model_name", "engine", "finished_reason", "code", "le", "block_size", "num_gpu_blocks",
                      "enable_prefix_caching", "backend", "reason", "tier", "state", "currency", "result",
                      "phase"}      # tokenfleet:startup_phase_seconds: a fixed set of phase names
    from prometheus_client.parser import text_string_to_metric_families

    for base in (router.base_url, keyed.base_url):
        text = http("GET", f"{base}/metrics")[2].decode()
        for word in MARKER.split():
            assert word not in text, (base, word)
        assert not any(h in text or h[:16] in text for h in hashes), base
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                assert set(sample.labels) <= allowed_labels, (base, sample)
                assert MARKER not in "".join(sample.labels.values())


def test_rotated_keys_take_effect_without_a_restart(fleet):
    router, keys = fleet["router"], fleet["keys"]
    write_secret(keys, {"alice": ROTATED_KEY, "bob": OTHER_CLIENT_KEY})
    wait_until(lambda: complete(router.base_url, bearer(ROTATED_KEY))[0] == 200, 30, what="the new key accepted")
    assert complete(router.base_url, bearer(CLIENT_KEY))[0] == 401
    assert complete(router.base_url, bearer(OTHER_CLIENT_KEY))[0] == 200
    (keys / "..data").unlink()                  # a broken mount keeps the last good keys
    time.sleep(2.5)
    assert complete(router.base_url, bearer(ROTATED_KEY))[0] == 200


@pytest.mark.parametrize("layout", ["missing", "empty dir", "comments only"])
def test_unusable_client_keys_exit_2_naming_the_path(tmp_path, layout):
    cfg = tmp_path / "router.json"
    cfg.write_text("{}")
    keys = tmp_path / "keys"
    if layout == "empty dir":
        keys.mkdir()
    elif layout == "comments only":
        keys.write_text("# nothing here\n\n")
    log = tmp_path / "termination-log"
    r = subprocess.run([sys.executable, "-m", "tokenfleet_serving.router.main", "--config", str(cfg),
                        "--client-keys", str(keys)], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, TOKENFLEET_TERMINATION_LOG=str(log)))
    assert r.returncode == 2 and str(keys) in r.stderr
    assert log.read_text().startswith("tokenfleet route: ") and str(keys) in log.read_text()
