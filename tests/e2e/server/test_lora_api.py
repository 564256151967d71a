"""LoRA adapters through the API, with the official openai client: adapters as models, dynamic loading and
unloading with the router's key, 400/404 for bad adapters and unknown models, vLLM's LoRA metric."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import openai
import pytest

from tokenfleet_serving.engine.lora_manager import LoRAConfig
from tokenfleet_serving.testing_adapters import create_random_adapter

from harness.server import API_KEY, MODEL_NAME, ThreadServer, http, metric_values, server_config

KEY = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: create_random_adapter(tiny_model, root / name, r=8, target_modules="all-linear", seed=i, scale=0.3)
            for i, name in enumerate(("sql", "poem"))}


@pytest.fixture(scope="module")
def lora_server(tiny_model, adapter_dirs):
    config = server_config(tiny_model)
    config = replace(config, engine=replace(config.engine, lora=LoRAConfig(max_loras=2, max_lora_rank=8)),
                     lora_modules=(("sql", str(adapter_dirs["sql"])),))
    srv = ThreadServer(config)
    yield srv
    srv.stop()


@pytest.fixture
def client(lora_server):
    return openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt="the fleet serves a token", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_adapters_are_models_with_their_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL_NAME, "sql"}
    assert models["sql"].model_extra["parent"] == MODEL_NAME


def test_load_use_and_unload_an_adapter(client, lora_server, adapter_dirs):
    url = lora_server.base_url
    base_text = complete(client, MODEL_NAME)
    assert complete(client, "sql") != base_text
    status, _, _ = http("POST", f"{url}/v1/load_lora_adapter",
                        {"lora_name": "poem", "lora_path": str(adapter_dirs["poem"])}, KEY)
    assert status == 200
    poem = complete(client, "poem")
    chat = client.chat.completions.create(model="poem", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "poem" and chat.usage.completion_tokens >= 1
    assert poem not in (base_text,)
    values = metric_values(url)
    assert values['tokenfleet:lora_generation_tokens_total{adapter=poem}'] >= 8
    assert any(k.startswith("vllm:lora_requests_info{") and "max_lora=2" in k for k in values)
    status, _, _ = http("POST", f"{url}/v1/unload_lora_adapter", {"lora_name": "poem"}, KEY)
    assert status == 200
    with pytest.raises(openai.NotFoundError) as err:
        complete(client, "poem")
    assert err.value.body["code"] == 404 or err.value.status_code == 404


def test_the_adapter_endpoints_need_the_routers_key(lora_server, adapter_dirs):
    status, _, _ = http("POST", f"{lora_server.base_url}/v1/load_lora_adapter",
                        {"lora_name": "x", "lora_path": str(adapter_dirs["poem"])})
    assert status == 401
    status, _, _ = http("POST", f"{lora_server.base_url}/v1/unload_lora_adapter", {"lora_name": "sql"},
                        {"Authorization": "Bearer wrong"})
    assert status == 401


def test_a_bad_adapter_is_a_400_naming_file_and_field(lora_server, adapter_dirs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(adapter_dirs["poem"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["r"] = 64
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    status, _, body = http("POST", f"{lora_server.base_url}/v1/load_lora_adapter",
                           {"lora_name": "bad", "lora_path": str(bad)}, KEY)
    err = json.loads(body)["error"]
    assert status == 400 and "adapter_config.json" in err["message"] and ": r:" in err["message"]


def test_an_unknown_model_is_a_404_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as err:
        complete(client, "no-such-adapter")
    assert "no-such-adapter" in str(err.value)
