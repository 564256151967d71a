"""Fixtures: a tiny random-weight checkpoint and a live server on loopback."""
from __future__ import annotations

from pathlib import Path

import pytest

from server_harness import ThreadServer, server_config


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from tokenfleet_serving.testing_models import create_random_checkpoint

    return create_random_checkpoint(tmp_path_factory.mktemp("models") / "tiny", max_position_embeddings=512)


@pytest.fixture(scope="module")
def live_server(tiny_model):
    srv = ThreadServer(server_config(tiny_model))
    yield srv
    srv.stop()
