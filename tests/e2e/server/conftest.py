"""Fixtures: a live server on loopback serving the tiny checkpoint (tests/conftest.py)."""
from __future__ import annotations

import pytest

from harness.server import ThreadServer, server_config


@pytest.fixture(scope="module")
def live_server(tiny_model):
    srv = ThreadServer(server_config(tiny_model))
    yield srv
    srv.stop()
