"""Tiny random-weight checkpoints written by transformers, shared by the engine tests."""
from __future__ import annotations

import pytest
import torch

from tokenfleet_serving.testing_models import create_random_checkpoint

from harness.engine_checkpoints import CHECKPOINTS


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: create_random_checkpoint(root / name, **kw) for name, kw in CHECKPOINTS.items()}


@pytest.fixture(scope="session")
def llama_dir(checkpoints):
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def hf_models(checkpoints) -> dict:
    from transformers import AutoModelForCausalLM

    models = {}
    for name, path in checkpoints.items():
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
        models[name] = m
    return models
