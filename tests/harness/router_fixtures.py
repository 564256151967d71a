"""Fixtures: the router's tests use a tiny checkpoint with a 1,024-token context."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from tokenfleet_serving.testing_models import create_random_checkpoint

    return create_random_checkpoint(tmp_path_factory.mktemp("models") / "tiny1k", max_position_embeddings=1024)
