"""Fixtures every test module may use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.testing.services import REDIS, RedisServer


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private, empty redis-server (skips where Debian's redis-server is not installed)."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()
