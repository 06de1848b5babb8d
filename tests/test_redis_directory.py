"""The block directory in a real Redis (``redis-server``, which ``.ci/run`` installs): the same answers as the
in-process one, shared by several metadata servers, and a Redis that dies and comes back."""

from __future__ import annotations

import time

import pytest

from kvbridge import errors
from kvbridge.metadata import MetadataClient
from kvbridge.metadata.redis_directory import RedisDirectory, check_url
from kvbridge.metadata.server import MetadataServer
from kvbridge.metadata.types import DirectoryEntry
from kvbridge.testing.services import REDIS
from kvbridge.testing.services import RedisServer as Redis

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")


def _h(*names: str) -> list[bytes]:
    return [n.encode().ljust(16, b"\0") for n in names]


def test_same_answers_as_the_in_process_directory(redis: Redis) -> None:
    d = RedisDirectory(redis.url, max_hashes_per_holder=3)
    d.publish("a", _h("1", "2", "3"), ttl_s=10, address="10.0.0.1:7")
    d.publish("a", _h("1", "4"), ttl_s=10)  # "1" republished is newest; "2" now the oldest, evicted past 3
    assert d.holders() == {"a": 3}
    assert d.lookup(_h("1", "2")) == [DirectoryEntry("a", 1, "10.0.0.1:7")], "the address is kept"
    assert d.lookup(_h("3", "4")) == [DirectoryEntry("a", 2, "10.0.0.1:7")]
    d.publish("b", _h("3"), ttl_s=10, address="b:1")
    assert d.lookup(_h("3", "4")) == [DirectoryEntry("a", 2, "10.0.0.1:7"), DirectoryEntry("b", 1, "b:1")]
    d.unpublish("a", _h("3"))
    assert d.lookup(_h("3", "4")) == [DirectoryEntry("b", 1, "b:1")]
    d.unpublish("a")
    d.unpublish("nobody")
    assert d.holders() == {"b": 1} and not d.heartbeat("a", ttl_s=1) and d.heartbeat("b", ttl_s=1)
    assert d.lookup([]) == []


def test_a_silent_holder_expires_by_redis_ttl(redis: Redis) -> None:
    d = RedisDirectory(redis.url)
    d.publish("mortal", _h("e1", "e2"), ttl_s=0.4)
    d.publish("kept", _h("e1"), ttl_s=0.4)
    time.sleep(0.25)
    assert d.heartbeat("kept", ttl_s=0.4)
    time.sleep(0.3)
    assert d.lookup(_h("e1", "e2")) == [DirectoryEntry("kept", 1, "")]
    assert not d.heartbeat("mortal", ttl_s=0.4), "the holder learns that it must publish again"
    assert d.holders() == {"kept": 1}


def test_metadata_servers_share_one_redis_directory(redis: Redis) -> None:
    """What one machine's server learns, another's answers (and it outlives the first)."""
    a = MetadataServer("127.0.0.1:0", directory=RedisDirectory(redis.url))
    b = MetadataServer("127.0.0.1:0", directory=RedisDirectory(redis.url))
    a.start()
    b.start()
    try:
        with MetadataClient(a.address) as ca:
            ca.publish("engine-1", _h("x1", "x2"), ttl_s=30, address="10.0.0.2:9")
        a.stop(0)
        with MetadataClient(b.address) as cb:
            assert cb.lookup(_h("x1", "x2", "x3")) == [DirectoryEntry("engine-1", 2, "10.0.0.2:9")]
    finally:
        a.stop(0)
        b.stop(0)


def test_a_redis_that_dies_and_comes_back(redis: Redis) -> None:
    """Down: calls fail fast with PeerUnreachable (over gRPC too), never hang. Back (empty: no persistence):
    a holder's heartbeat says publish again, and then everything answers as before."""
    d = RedisDirectory(redis.url, timeout_s=0.5)
    server = MetadataServer("127.0.0.1:0", directory=d)
    server.start()
    try:
        d.publish("e", _h("k1"), ttl_s=30)
        redis.kill()
        t0 = time.monotonic()
        with pytest.raises(errors.PeerUnreachable, match="lookup"):
            d.lookup(_h("k1"))
        with MetadataClient(server.address) as client:
            with pytest.raises(errors.PeerUnreachable):
                client.lookup(_h("k1"))
        assert time.monotonic() - t0 < 20
        redis.start()
        assert not d.heartbeat("e", ttl_s=30)
        d.publish("e", _h("k1"), ttl_s=30)
        assert d.lookup(_h("k1")) == [DirectoryEntry("e", 1, "")]
    finally:
        server.stop(0)


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://127.0.0.1", "redis://127.0.0.1:99999/0", "redis://h:1/x"])
def test_a_bad_directory_url_is_a_config_error(url: str) -> None:
    with pytest.raises(errors.ConfigError):
        check_url(url)


def test_metadata_server_cli_refuses_a_bad_directory_url(capsys: pytest.CaptureFixture[str]) -> None:
    from kvbridge.cli import main

    assert main(["metadata-server", "--directory", "http://nope:1"]) == 2
    assert "directory URL" in capsys.readouterr().err
