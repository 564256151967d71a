"""The hostile-input layer, adapters family (issue 48): LoRA adapters whose files or requests come from someone
who means harm, against one ``tokenfleet serve --enable-lora`` process (and one that follows an adapters file).

Asserted: a backtracking ``target_modules`` regex, an oversized safetensors header, NaN or infinite weights
and a NaN ``lora_alpha`` are each a 400 naming the field, in bounded time, while ``/health`` and other
clients' requests keep being answered; an adapters file listing such an adapter leaves the server Ready
with the adapter's error on /metrics; a reload under the same name never serves the old weights' KV; an
adapter whose finite weights overflow the activations fails its request with an error instead of a 200
with empty text; ``lora_name`` follows the served-model-name rule and a 10,000-character ``lora_path`` is a
400; an unloaded adapter's metrics go with it.
"""
from __future__ import annotations

import json
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tokenfleet_serving.testing_adapters import create_random_adapter

from harness.server import MODEL_NAME, ProcessServer, http, metric_values, wait_until

pytestmark = pytest.mark.slow

KEY = "hostile-adapters-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = list(range(10, 74))            # four full blocks of 16
BACKTRACKING = "((.+)+)+Z"
LOG_ALARMS = ("Traceback", "engine step loop stopped", "unhandled error", "engine stalled")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-adapters")
    dirs = {name: create_random_adapter(tiny_model, root / name, r=8, target_modules="all-linear", seed=seed,
                                        scale=0.3)
            for name, seed in (("one", 1), ("two", 2))}
    evil = shutil.copytree(dirs["one"], root / "evil")
    _set_config(evil, target_modules=BACKTRACKING)
    return dirs | {"evil": evil, "root": root}


def _set_config(directory: Path, raw: str | None = None, **values) -> None:
    """Change adapter_config.json; ``raw``: JSON text put in place of ``lora_alpha``'s value."""
    cfg = json.loads((directory / "adapter_config.json").read_text())
    cfg.update(values)
    text = json.dumps(cfg)
    if raw is not None:
        text = text.replace(f'"lora_alpha": {json.dumps(cfg["lora_alpha"])}', f'"lora_alpha": {raw}')
    (directory / "adapter_config.json").write_text(text)


@pytest.fixture(scope="module")
def server(tiny_model, adapter_dirs):
    srv = ProcessServer(tiny_model, "--api-key", KEY, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                        "--block-size", "16")
    yield srv
    srv.close()
    log = "".join(srv.log)
    # the one request failed on purpose (the overflowing adapter) is logged with its traceback; nothing else
    failed_on_purpose = log.count("failed in the engine: SamplingError")
    assert failed_on_purpose == 1 and log.count("Traceback") == failed_on_purpose, log
    assert not [a for a in LOG_ALARMS if a != "Traceback" and a in log], log


def load(srv: ProcessServer, name: str, path: str | Path) -> tuple[int, dict]:
    status, _, body = http("POST", f"{srv.base_url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                           AUTH, timeout=60)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, {"text": body.decode()}


def complete(srv: ProcessServer, model: str) -> tuple[int, dict]:
    status, _, body = http("POST", f"{srv.base_url}/v1/completions",
                           {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                           AUTH, timeout=60)
    return status, json.loads(body)


class Watch:
    """/health polled from a thread while something runs: the slowest answer."""

    def __init__(self, srv: ProcessServer):
        self.srv, self.slowest, self.failures = srv, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                status, _, _ = http("GET", f"{self.srv.base_url}/health", timeout=10)
            except OSError:
                status = 0
            self.slowest = max(self.slowest, time.monotonic() - t0)
            self.failures += status != 200
            time.sleep(0.05)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15)


def assert_refused(status: int, body: dict, param: str, *words: str) -> str:
    assert status == 400, body
    err = body["error"]
    assert err["param"] == param and err["code"] == 400, err
    for word in words:
        assert word in err["message"], err["message"]
    return err["message"]


def test_a_backtracking_target_modules_regex_is_a_400_and_the_replica_keeps_answering(server, adapter_dirs):
    with Watch(server) as watch:
        t0 = time.monotonic()
        status, body = load(server, "evil", adapter_dirs["evil"])
        took = time.monotonic() - t0
        assert complete(server, MODEL_NAME)[0] == 200
    assert_refused(status, body, "lora_path", "target_modules", "backtracks")
    assert took < 10, f"refusing the pattern took {took:.1f} s"
    assert watch.failures == 0 and watch.slowest < 1.0, f"/health slowest {watch.slowest:.2f} s"


def test_an_oversized_safetensors_header_is_a_400_naming_the_limit_without_stalling_requests(server, adapter_dirs):
    big = shutil.copytree(adapter_dirs["one"], adapter_dirs["root"] / "big-header")
    claimed = 36 << 20
    with open(big / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", claimed) + b"{" + b" " * (claimed - 2) + b"}")
    with Watch(server) as watch:
        t0 = time.monotonic()
        status, body = load(server, "big", big)
        took = time.monotonic() - t0
    assert_refused(status, body, "lora_path", "adapter_model.safetensors", "at most")
    assert took < 2 and watch.failures == 0 and watch.slowest < 1.0


@pytest.mark.parametrize("case", ["nan-weight", "inf-weight", "nan-alpha"])
def test_non_finite_weights_or_alpha_are_a_400_naming_the_adapter(case, server, adapter_dirs):
    bad = shutil.copytree(adapter_dirs["one"], adapter_dirs["root"] / case)
    if case == "nan-alpha":
        _set_config(bad, raw="NaN")
    else:
        tensors = load_file(str(bad / "adapter_model.safetensors"))
        key = sorted(k for k in tensors if "lora_A" in k)[0]
        tensors[key][0, 0] = float("nan") if case == "nan-weight" else float("inf")
        save_file(tensors, str(bad / "adapter_model.safetensors"))
    status, body = load(server, case, bad)
    message = assert_refused(status, body, "lora_path", repr(case))
    assert ("lora_alpha" in message) if case == "nan-alpha" else ("NaN or infinite" in message)
    assert complete(server, case)[0] == 404


def test_activations_an_adapter_overflows_fail_the_request_instead_of_an_empty_200(server, adapter_dirs):
    loud = shutil.copytree(adapter_dirs["one"], adapter_dirs["root"] / "loud")
    _set_config(loud, lora_alpha=1e30)            # finite weights, infinite activations
    assert load(server, "loud", loud)[0] == 200
    status, body = complete(server, "loud")
    assert status == 500 and "NaN or infinity" in body["error"]["message"], (status, body)
    assert complete(server, MODEL_NAME)[0] == 200
    assert http("POST", f"{server.base_url}/v1/unload_lora_adapter", {"lora_name": "loud"}, AUTH)[0] == 200


def test_a_reload_under_the_same_name_never_serves_the_old_weights_kv(server, adapter_dirs):
    assert load(server, "fresh-two", adapter_dirs["two"])[0] == 200
    expected = complete(server, "fresh-two")[1]["choices"][0]["text"]
    assert load(server, "x", adapter_dirs["one"])[0] == 200
    old = complete(server, "x")[1]["choices"][0]["text"]
    again = complete(server, "x")[1]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert load(server, "x", adapter_dirs["two"])[0] == 200
    status, new = complete(server, "x")
    assert status == 200 and new["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, new["usage"]
    assert new["choices"][0]["text"] == expected != old
    for name in ("fresh-two", "x"):
        assert http("POST", f"{server.base_url}/v1/unload_lora_adapter", {"lora_name": name}, AUTH)[0] == 200


@pytest.mark.parametrize("name", ["has space", "-flag", "x" * 129, "new\nline"])
def test_lora_name_follows_the_served_model_name_rule(name, server, adapter_dirs):
    assert_refused(*load(server, name, adapter_dirs["one"]), "lora_name", "not a valid model name")


def test_a_ten_thousand_character_lora_path_is_a_400_naming_the_field(server):
    assert_refused(*load(server, "long", "/" + "a" * 10_000), "lora_path", "4096")
    assert_refused(*load(server, "deep", "/x" * 2000), "lora_path")        # short enough, but not a directory


def test_an_unloaded_adapters_metrics_go_with_it(server, adapter_dirs):
    assert load(server, "metered", adapter_dirs["one"])[0] == 200
    assert complete(server, "metered")[0] == 200
    wait_until(lambda: metric_values(server.base_url).get("tokenfleet:lora_generation_tokens_total{adapter=metered}"),
               10, what="the adapter's token counter")
    assert http("POST", f"{server.base_url}/v1/unload_lora_adapter", {"lora_name": "metered"}, AUTH)[0] == 200
    wait_until(lambda: not any("adapter=metered" in k for k in metric_values(server.base_url)), 10,
               what="the unloaded adapter's series to go")


def test_an_adapters_file_listing_a_backtracking_adapter_leaves_the_replica_ready(tiny_model, adapter_dirs, tmp_path):
    adapters_file = tmp_path / "adapters.json"
    adapters_file.write_text(json.dumps({"adapters": [{"name": "evil", "path": str(adapter_dirs["evil"]), "hot": True},
                                                      {"name": "good", "path": str(adapter_dirs["two"])}]}))
    srv = ProcessServer(tiny_model, "--api-key", KEY, "--enable-lora", "--max-lora-rank", "8",
                        "--lora-modules-file", str(adapters_file))
    try:
        def refused_on_metrics():
            return [k for k in metric_values(srv.base_url)
                    if k.startswith("tokenfleet:lora_adapter_error_info{") and "adapter=evil" in k]

        [series] = wait_until(refused_on_metrics, 30, what="the evil adapter's error on /metrics")
        assert "field=target_modules" in series
        assert http("GET", f"{srv.base_url}/health")[0] == 200 and http("GET", f"{srv.base_url}/ready")[0] == 200
        wait_until(lambda: complete(srv, "good")[0] == 200, 30, what="the good adapter served")
        assert srv.proc.poll() is None
    finally:
        srv.close()
