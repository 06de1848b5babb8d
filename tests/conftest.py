"""Fixtures every test module may use."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.testing.hosts import Host, emulated_hosts
from kvbridge.testing.hosts import unavailable as hosts_unavailable
from kvbridge.testing.services import REDIS, RedisServer

# modules the tests share (tests/helpers/pattern.py) import by name, as tests/vllm imports pdkit
sys.path.insert(0, str(Path(__file__).parent / "helpers"))


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private, empty redis-server (skips where Debian's redis-server is not installed)."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


def _emulated(n: int, pods: bool = False) -> Iterator[list[Host]]:
    reason = hosts_unavailable()
    if reason:
        pytest.skip(reason)
    with emulated_hosts(n, pods=pods) as made:
        yield made


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    """Two emulated hosts (kvbridge.testing.hosts), torn down even when the test fails; skips where they
    cannot be made (not root, no network namespaces), saying why."""
    yield from _emulated(2)


@pytest.fixture
def three_hosts() -> Iterator[list[Host]]:
    """Three emulated hosts on one bridge, as :func:`hosts`."""
    yield from _emulated(3)


@pytest.fixture
def pods() -> Iterator[list[Host]]:
    """Two pods on one node (one network namespace, each its own pid, uts, IPC and mount namespaces), as
    :func:`hosts`."""
    yield from _emulated(2, pods=True)


@pytest.fixture
def serve() -> Iterator[Callable[..., Any]]:
    """Start embedded metadata servers (:class:`kvbridge.metadata.server.MetadataServer`) in this process; all
    are stopped at the end of the test."""
    from kvbridge.metadata.server import MetadataServer

    started: list[MetadataServer] = []

    def start(**kwargs: Any) -> MetadataServer:
        server = MetadataServer(**kwargs)
        server.start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop(0)
