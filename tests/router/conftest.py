"""Fixtures: a tiny random-weight checkpoint (shared by the prompt and end-to-end tests)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from tokenfleet_serving.testing_models import create_random_checkpoint

    return create_random_checkpoint(tmp_path_factory.mktemp("models") / "tiny", max_position_embeddings=1024)
