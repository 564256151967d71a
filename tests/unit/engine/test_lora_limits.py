"""LoRA adapters from whoever can write their directory (issue 48): bounded, checked and read off the engine's
lock; a reload's KV kept apart from the old version's; non-finite weights refused; adapter names under the
served-model-name rule; an adapter's metrics gone with it."""
from __future__ import annotations

import json
import math
import shutil
import struct
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenfleet_serving.engine import LLMEngine, SamplingParams
from tokenfleet_serving.engine.lora_adapter import MAX_CONFIG_BYTES, MAX_HEADER_BYTES, AdapterError, max_weights_bytes
from tokenfleet_serving.engine.lora_manager import LoRAConfig
from tokenfleet_serving.engine.lora_targets import MATCH_TIMEOUT_S, MAX_PATTERN_CHARS
from tokenfleet_serving.testing_adapters import create_random_adapter
from tokenfleet_serving.testing_models import create_random_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(20, 44))            # six full blocks of 4
BACKTRACKING = "((.+)+)+Z"              # Python's re takes minutes on a module name with it


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return create_random_checkpoint(tmp_path_factory.mktemp("lora-limits") / "base", initializer_range=0.2, seed=3)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-limits-adapters")
    return {name: create_random_adapter(base, root / name, r=4, target_modules=["q_proj", "v_proj"], seed=seed,
                                        scale=0.3)
            for name, seed in (("one", 1), ("two", 2))}


def engine(base) -> LLMEngine:
    return LLMEngine.from_pretrained(base, dtype="float32", device="cpu", kv_cache_bytes=4 << 20, block_size=4,
                                     lora=LoRAConfig(max_loras=2, max_lora_rank=8))


def generate(eng: LLMEngine, rid: str, lora: str | None) -> tuple[list[int], int]:
    """(tokens, prompt tokens served from the prefix cache) of one greedy request."""
    eng.add_request(rid, PROMPT, GREEDY, lora=lora)
    tokens, cached = [], -1
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
            assert out.finish_reason != "error", out.error
    return tokens, cached


def copy(src, dst, config: dict | None = None):
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def refused(eng: LLMEngine, directory) -> AdapterError:
    with pytest.raises(AdapterError) as err:
        eng.load_lora_adapter("bad", directory)
    assert "bad" not in eng.lora_adapters()
    return err.value


def test_a_backtracking_target_modules_pattern_is_refused_in_bounded_time_without_the_lock(base, adapters,
                                                                                        tmp_path):
    eng = engine(base)
    bad = copy(adapters["one"], tmp_path / "evil", {"target_modules": BACKTRACKING})
    result: dict = {}

    def load() -> None:
        try:
            eng.load_lora_adapter("bad", bad)
        except AdapterError as e:
            result["error"] = e

    started = time.monotonic()
    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    time.sleep(0.3)
    assert eng.lock.acquire(timeout=1.0), "the engine's lock is held while the adapter's pattern is matched"
    eng.lock.release()
    generate(eng, "meanwhile", None)                    # requests are served meanwhile
    loader.join(timeout=MATCH_TIMEOUT_S + 10)
    assert not loader.is_alive(), "matching the pattern never ended"
    assert time.monotonic() - started < MATCH_TIMEOUT_S + 5
    err = result["error"]
    assert err.field == "target_modules" and "backtracks" in err.why
    started = time.monotonic()             # an adapters file retries a refused entry: the answer is kept
    assert "backtracks" in refused(eng, bad).why and time.monotonic() - started < 1.0


def test_target_modules_patterns_in_peft_forms_still_select_their_projections(base, adapters, tmp_path):
    eng = engine(base)
    good = copy(adapters["one"], tmp_path / "re", {"target_modules": r".*\.(q_proj|v_proj)"})
    eng.load_lora_adapter("re", good)
    assert eng.lora.loaded["re"].target_modules == ("q_proj", "v_proj")
    err = refused(eng, copy(adapters["one"], tmp_path / "long", {"target_modules": "q_proj|" * MAX_PATTERN_CHARS}))
    assert err.field == "target_modules" and str(MAX_PATTERN_CHARS) in err.why
    err = refused(eng, copy(adapters["one"], tmp_path / "invalid", {"target_modules": "(q_proj"}))
    assert err.field == "target_modules" and "not a valid regular expression" in err.why


def test_oversized_files_are_refused_before_they_are_read(base, adapters, tmp_path):
    eng = engine(base)
    big_config = copy(adapters["one"], tmp_path / "config")
    cfg = json.loads((big_config / "adapter_config.json").read_text())
    cfg["padding"] = "x" * MAX_CONFIG_BYTES
    (big_config / "adapter_config.json").write_text(json.dumps(cfg))
    err = refused(eng, big_config)
    assert err.file.endswith("adapter_config.json") and str(MAX_CONFIG_BYTES) in err.why

    header = copy(adapters["one"], tmp_path / "header")           # a 36 MB header, as the probe sent
    claimed = 36 << 20
    with open(header / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", claimed) + b"{" + b" " * (claimed - 2) + b"}")
    started = time.monotonic()
    err = refused(eng, header)
    assert time.monotonic() - started < 1.0
    assert err.file.endswith("adapter_model.safetensors") and err.field == "(file)"   # more than r=8 can hold
    with open(header / "adapter_model.safetensors", "r+b") as f:
        f.truncate(MAX_HEADER_BYTES // 2)                # a file this model's adapter may fill, the same claim
    err = refused(eng, header)
    assert err.field == "(file)" and "header" in err.why and str(MAX_HEADER_BYTES) in err.why

    total = copy(adapters["one"], tmp_path / "total")
    limit = max_weights_bytes(eng.model_config, eng.lora.config.max_lora_rank)
    with open(total / "adapter_model.safetensors", "r+b") as f:
        f.truncate(limit + 1)
    err = refused(eng, total)
    assert err.field == "(file)" and str(limit) in err.why


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(value, base, adapters, tmp_path):
    eng = engine(base)
    bad = copy(adapters["one"], tmp_path / "nan")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = value
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    err = refused(eng, bad)
    assert err.field == key and "NaN or infinite" in err.why


@pytest.mark.parametrize("alpha", ["NaN", "Infinity", "1e300"])
def test_a_lora_alpha_that_is_not_finite_or_overflows_is_refused(alpha, base, adapters, tmp_path):
    eng = engine(base)
    bad = copy(adapters["one"], tmp_path / "alpha")
    text = (bad / "adapter_config.json").read_text()
    cfg = json.loads(text)
    (bad / "adapter_config.json").write_text(text.replace(f'"lora_alpha": {json.dumps(cfg["lora_alpha"])}',
                                                          f'"lora_alpha": {alpha}'))
    err = refused(eng, bad)
    assert err.field == "lora_alpha" if alpha != "1e300" else "layers.0" in err.field and "not finite" in err.why


def test_a_reloaded_adapter_never_reuses_the_old_versions_kv(base, adapters):
    fresh = engine(base)
    fresh.load_lora_adapter("x", adapters["two"])
    expected, _ = generate(fresh, "fresh", "x")

    eng = engine(base)
    eng.load_lora_adapter("x", adapters["one"])
    old, _ = generate(eng, "old", "x")
    _, cached = generate(eng, "old-again", "x")
    assert cached > 0
    eng.load_lora_adapter("x", adapters["two"])                  # same name, other weights
    new, cached = generate(eng, "new", "x")
    assert cached == 0, "the new weights were served the old weights' prefix-cache KV"
    assert new == expected != old


def test_a_request_admitted_before_a_reload_finishes_with_the_version_it_started_with(base, adapters):
    fresh = engine(base)
    fresh.load_lora_adapter("x", adapters["one"])
    expected, _ = generate(fresh, "fresh", "x")
    eng = engine(base)
    eng.load_lora_adapter("x", adapters["one"])
    eng.add_request("r", PROMPT, GREEDY, lora="x")
    got = eng.step()[0].new_token_ids
    eng.load_lora_adapter("x", adapters["two"])
    while eng.has_unfinished():
        got += sum((o.new_token_ids for o in eng.step()), [])
    assert got == expected


@pytest.mark.parametrize("name", ["has space", "-flag", "x" * 129, "tab\there", "bell\x07"])
def test_adapter_names_follow_the_served_model_name_rule(name, base, adapters):
    eng = engine(base)
    with pytest.raises(ValueError, match="not a valid model name"):
        eng.load_lora_adapter(name, adapters["one"])
    with pytest.raises(ValueError, match="not a valid model name"):
        eng.register_lora_adapter(name, adapters["one"])
    assert eng.lora_adapters() == []


def test_an_unloaded_adapters_token_counts_go_with_it(base, adapters):
    eng = engine(base)
    eng.load_lora_adapter("gone", adapters["one"])
    generate(eng, "r", "gone")
    assert eng.stats().lora.tokens["gone"][1] == GREEDY.max_tokens
    assert eng.unload_lora_adapter("gone") is True
    assert "gone" not in eng.stats().lora.tokens and "gone" not in eng.lora.load_seconds


def test_a_registered_adapter_is_read_off_the_lock_on_its_first_request(base, adapters):
    eng = engine(base)
    eng.register_lora_adapter("lazy", adapters["one"])
    assert "lazy" not in eng.lora.loaded
    read = eng.prepare_lora("lazy")
    assert read is not None and read.path == str(adapters["one"])
    eng.add_request("r", PROMPT, GREEDY, lora="lazy", lora_read=read)
    assert eng.lora.loaded["lazy"] is read and eng.prepare_lora("lazy") is None


def test_nan_logits_fail_a_greedy_request_instead_of_answering_empty(base, monkeypatch):
    eng = engine(base)
    forward = eng.runner.forward

    def poisoned(*args, **kwargs):
        logits = forward(*args, **kwargs)
        return torch.full_like(logits, math.nan)

    monkeypatch.setattr(eng.runner, "forward", poisoned)
    eng.add_request("r", PROMPT, GREEDY)
    outs = eng.step()
    assert outs[0].finished and outs[0].finish_reason == "error" and "NaN" in outs[0].error
    assert outs[0].new_token_ids == []


def test_the_router_hashes_an_adapters_request_as_the_engine_caches_it(base, adapters):
    from tokenfleet_serving.router.prefix import block_hashes

    eng = engine(base)
    eng.load_lora_adapter("x", adapters["one"])
    generate(eng, "r", "x")
    root = bytes.fromhex(eng.stats().lora.roots["x"])          # what /metrics tells the router
    assert set(block_hashes(PROMPT, 4, adapter="x", root=root)) <= set(eng.cached_block_hashes())
    eng.load_lora_adapter("x", adapters["two"])
    assert eng.stats().lora.roots["x"] != root.hex()


def test_a_read_that_went_stale_before_the_request_was_admitted_is_read_again(base, adapters):
    fresh = engine(base)
    fresh.load_lora_adapter("lazy", adapters["two"])
    expected, _ = generate(fresh, "fresh", "lazy")
    eng = engine(base)
    eng.register_lora_adapter("lazy", adapters["one"])
    stale = eng.prepare_lora("lazy")
    eng.register_lora_adapter("lazy", adapters["two"])          # moved elsewhere meanwhile
    eng.add_request("r", PROMPT, GREEDY, lora="lazy", lora_read=stale)
    got = []
    while eng.has_unfinished():
        got += sum((o.new_token_ids for o in eng.step()), [])
    assert got == expected and eng.lora.loaded["lazy"].path == str(adapters["two"])
