"""The adapters file as the server follows it (``server/lora_file.py``), against a real engine: parsing, roots,
a refused entry retried once fixed in place, a changed directory that is refused keeping the old one, and
only the file's own adapters unloaded by it."""
from __future__ import annotations

import json
import shutil

import pytest

from tokenfleet_serving.contract.lora_adapters import AdapterEntry, adapters_json, parse_adapters
from tokenfleet_serving.engine import LLMEngine
from tokenfleet_serving.engine.lora_manager import LoRAConfig
from tokenfleet_serving.server.lora_file import AdapterFile
from tokenfleet_serving.testing_adapters import create_random_adapter


@pytest.mark.parametrize("text, words", [
    ("{", "not JSON"), ('{"adapters": {}}', "must be a list"), ('{"adapters": [{"name": "a"}]}', "adapters[0]"),
    ('{"adapters": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]}', "twice"),
])
def test_a_bad_file_is_refused_naming_what(text, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_adapters(text)


def test_entries_round_trip_and_resolve_their_root():
    entries = [AdapterEntry("a", "x/y", "vol", True), AdapterEntry("b", "/abs")]
    assert parse_adapters(adapters_json(entries)) == entries
    assert entries[0].directory({"vol": "/mnt/v"}) == "/mnt/v/x/y" and entries[1].directory({}) == "/abs"
    assert parse_adapters("") == []


@pytest.fixture(scope="module")
def volume(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("volume")
    create_random_adapter(tiny_model, root / "good", r=4, target_modules=["q_proj"], seed=3)
    return root


def test_the_file_is_followed_refusals_are_retried_and_a_bad_new_directory_keeps_the_old(tiny_model, volume,
                                                                                         tmp_path):
    eng = LLMEngine.from_pretrained(tiny_model, dtype="float32", device="cpu", kv_cache_bytes=2 << 20,
                                    lora=LoRAConfig(max_loras=2, max_lora_rank=8))
    eng.load_lora_adapter("by-hand", volume / "good")            # not the file's: the file never unloads it
    listing = tmp_path / "adapters.json"
    follower = AdapterFile(eng, listing, {"vol": str(volume)}, retry_s=0.0)
    assert not follower.sync() and follower.file_error is not None          # no file yet: nothing changes

    fixable = volume / "fixable"
    shutil.copytree(volume / "good", fixable)
    (fixable / "adapter_config.json").write_text("{broken")
    listing.write_text(adapters_json([AdapterEntry("a", "good", "vol", hot=True), AdapterEntry("f", "fixable", "vol"),
                                      AdapterEntry("lost", "x", "nowhere")]))
    assert follower.sync()
    assert set(eng.lora_adapters()) == {"by-hand", "a"} and "a" in eng.lora.loaded
    assert follower.errors["f"].file.endswith("fixable/adapter_config.json") and follower.errors["f"].field == "(file)"
    assert follower.errors["lost"].field == "root"

    shutil.copy(volume / "good" / "adapter_config.json", fixable / "adapter_config.json")     # fixed in place
    assert follower.sync()
    assert "f" in eng.lora_adapters() and "f" not in eng.lora.loaded and "f" not in follower.errors

    # a new directory for "a" that is refused: "a" keeps serving the old one, the refusal is reported
    listing.write_text(adapters_json([AdapterEntry("a", str(tmp_path / "missing"), hot=True),
                                      AdapterEntry("f", "fixable", "vol")]))
    follower.sync()
    assert "a" in eng.lora_adapters() and eng.lora.paths["a"] == str(volume / "good") and "a" in follower.errors

    listing.write_text(json.dumps({"adapters": []}))
    follower.sync()
    assert eng.lora_adapters() == ["by-hand"] and follower.errors == {}
    listing.write_text("{not json")
    assert not follower.sync() and "not JSON" in (follower.file_error or "")
