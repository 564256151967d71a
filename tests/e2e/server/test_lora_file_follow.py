"""--lora-modules-file: the server follows the adapters file the operator renders, with the official openai
client: a hot adapter is servable at start, an entry added while serving becomes a model, a removed one a
404, a refused one is reported on /metrics with its file and field, and the start never fails for it."""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace

import openai
import pytest

from tokenfleet_serving.contract.lora_adapters import ADAPTER_ERROR_METRIC, AdapterEntry, adapters_json
from tokenfleet_serving.engine.lora_manager import LoRAConfig
from tokenfleet_serving.testing_adapters import create_random_adapter

from harness.server import API_KEY, ThreadServer, metric_values, server_config


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-volume")
    for i, name in enumerate(("sql", "poem")):
        create_random_adapter(tiny_model, root / name, r=8, target_modules=["q_proj", "v_proj"], seed=i, scale=0.3)
    bad = root / "too-big"
    shutil.copytree(root / "poem", bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["r"] = 64
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    return root


def until(what, check, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := check()):
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_server_follows_its_adapters_file(tiny_model, adapters, tmp_path):
    listing = tmp_path / "adapters.json"
    listing.write_text(adapters_json([AdapterEntry("sql", "sql", root="vol", hot=True),
                                      AdapterEntry("bad", str(adapters / "too-big"))]))
    config = server_config(tiny_model)
    config = replace(config, engine=replace(config.engine, lora=LoRAConfig(max_loras=2, max_lora_rank=8)),
                     lora_modules_file=str(listing), lora_roots=(("vol", str(adapters)),))
    srv = ThreadServer(config)
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

        def models() -> set[str]:
            return {m.id for m in client.models.list().data}

        assert "sql" in models() and "bad" not in models()       # the refused one did not stop the start
        out = client.completions.create(model="sql", prompt="a token", max_tokens=4, temperature=0)
        assert out.model == "sql" and out.usage.completion_tokens == 4

        errors = [k for k in metric_values(srv.base_url) if k.startswith(ADAPTER_ERROR_METRIC)]
        assert len(errors) == 1 and "adapter=bad," in errors[0] and "too-big/adapter_config.json," in errors[0] \
            and "field=r," in errors[0] and "--max-lora-rank" in errors[0], errors

        # added while serving: registered (not in memory) and served on first use
        listing.write_text(adapters_json([AdapterEntry("sql", "sql", root="vol", hot=True),
                                          AdapterEntry("poem", "poem", root="vol")]))
        until("poem to be a model", lambda: "poem" in models())
        # /metrics shows it without waiting for a step (the engine idles here)
        values = until("poem on /metrics", lambda: (v := metric_values(srv.base_url))
                       and "tokenfleet:lora_adapter_loaded{adapter=poem}" in v and v, timeout=3.0)
        assert values["tokenfleet:lora_adapter_loaded{adapter=poem}"] == 0.0       # registered, read on use
        assert values["tokenfleet:lora_adapter_loaded{adapter=sql}"] == 1.0        # hot
        assert not [k for k in values if k.startswith(ADAPTER_ERROR_METRIC)]        # "bad" left the file
        poem = client.completions.create(model="poem", prompt="a token", max_tokens=4, temperature=0)
        assert poem.model == "poem" and poem.choices[0].text != out.choices[0].text

        # removed: a 404 in OpenAI's shape
        listing.write_text(adapters_json([AdapterEntry("poem", "poem", root="vol")]))
        until("sql to go", lambda: "sql" not in models())
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="sql", prompt="a token", max_tokens=4)
        # a broken file changes nothing
        listing.write_text("{not json")
        time.sleep(1.5)
        assert "poem" in models()
    finally:
        srv.stop()
