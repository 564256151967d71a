"""A batch item the engine fails alone gets an error result; the round's other items get their text."""
from __future__ import annotations

from tokenfleet_serving.batch.job import Progress
from tokenfleet_serving.batch.main import EngineCompute
from tokenfleet_serving.engine import engine as engine_module
from tokenfleet_serving.engine.engine import LLMEngine


def test_an_item_the_engine_fails_gets_an_error_result_and_the_others_their_text(tiny_model, monkeypatch):
    engine = LLMEngine.from_pretrained(tiny_model, dtype="float32", kv_cache_bytes=2 << 20, num_threads=1)
    real_sample = engine_module.sample

    def sample(logits, reqs):            # seed 7 marks the item whose sampling fails
        if any(r.params.seed == 7 for r in reqs):
            raise RuntimeError("injected fault")
        return real_sample(logits, reqs)

    monkeypatch.setattr(engine_module, "sample", sample)
    items = [{"id": "a", "prompt_token_ids": [1, 2, 3]}, {"id": "b", "prompt_token_ids": [4, 5], "seed": 7},
             {"id": "c", "prompt_token_ids": [6, 7, 8, 9]}]
    results = EngineCompute(engine, 4, Progress())(items)
    assert [r["id"] for r in results] == ["a", "b", "c"]
    assert "injected fault" in results[1]["error"] and "text" not in results[1]
    assert all(r["completion_tokens"] >= 1 and "error" not in r for r in (results[0], results[2]))


def test_batch_runs_the_engine_on_the_device_it_is_given(tiny_model, tmp_path, caplog):
    """--device reaches the engine: cpu serves the items; a GPU the host lacks is a configuration error that
    says so (before, every batch ran on the CPU whatever the host had)."""
    import json

    import pytest
    import torch

    from tokenfleet_serving.batch.main import main

    items = tmp_path / "items.jsonl"
    items.write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    common = ["--model", str(tiny_model), "--input", str(items), "--port", "0", "--dtype", "float32",
              "--kv-cache-mb", "2", "--num-threads", "1"]
    assert main(common + ["--checkpoint-dir", str(tmp_path / "cpu"), "--device", "cpu"]) == 0
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the refusal below needs one without")
    assert main(common + ["--checkpoint-dir", str(tmp_path / "gpu"), "--device", "cuda"]) == 2
    assert "cuda" in caplog.text.lower() or "gpu" in caplog.text.lower()
