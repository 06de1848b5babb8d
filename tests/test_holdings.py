"""What engines publish for routers: :class:`~kvbridge.metadata.holdings.Holdings` keeping a holder's route
keys in a real directory (a real ``redis-server``, and a real metadata server's gRPC directory), through a
Redis killed and restarted empty. The proxy routing by them is in ``tests/test_proxy.py``; real vLLM
replicas publishing their own prefix caches in ``tests/vllm/test_routing.py``.
"""

from __future__ import annotations

import time

import pytest

from kvbridge.errors import ConfigError
from kvbridge.keys import ROUTE_TOKENS, route_keys
from kvbridge.metadata.holdings import Holdings, check_directory_url, open_directory
from kvbridge.metadata.server import MetadataServer
from kvbridge.testing.services import REDIS, RedisServer, eventually, held_depth

needs_redis = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")


def tokens(text: str) -> list[int]:
    return list(text.encode())  # what the stand-ins' /tokenize answers


# ---- Holdings ----------------------------------------------------------------------------------------


@needs_redis
def test_holdings_publish_bound_and_drop(redis: RedisServer) -> None:
    reader = open_directory(redis.url)
    keys = route_keys(tokens("x" * 160), "m")  # 10 chunks
    held = Holdings(open_directory(redis.url), "http://a:1", address="http://a:1", ttl_s=5, capacity=8)
    try:
        held.hold(keys)
        # the bound keeps the 8 most recent: the prefix's first two chunks are gone, so nothing leads
        assert eventually(lambda: reader.holders().get("http://a:1") == 8)
        assert held_depth(reader, "http://a:1", keys) == 0
        held.hold(keys[:4])
        assert eventually(lambda: held_depth(reader, "http://a:1", keys) == 4)
        held.drop(keys[2:3])
        assert eventually(lambda: held_depth(reader, "http://a:1", keys) == 2)
    finally:
        held.close()
    assert "http://a:1" not in reader.holders(), "close takes the holder out"


@needs_redis
def test_a_redis_restarted_empty_gets_everything_again(redis: RedisServer) -> None:
    keys = route_keys(tokens("y" * 320), "m")
    held = Holdings(open_directory(redis.url, timeout_s=0.5), "eng", ttl_s=0.9, flush_s=0.01)
    try:
        held.hold(keys)
        assert eventually(lambda: held_depth(open_directory(redis.url), "eng", keys) == len(keys))
        redis.kill()
        t0 = time.monotonic()
        held.hold(route_keys(tokens("z" * 64), "m"))  # the caller never waits on a dead directory
        held.drop(keys[-1:])
        assert time.monotonic() - t0 < 0.1
        time.sleep(0.5)  # a few failed attempts
        redis.start()
        reader = open_directory(redis.url)
        # a heartbeat (or the retry) finds the holder unknown and republishes what it holds now
        assert eventually(lambda: held_depth(reader, "eng", keys) == len(keys) - 1), reader.holders()
    finally:
        held.close()


def test_holdings_in_a_metadata_servers_directory() -> None:
    server = MetadataServer("127.0.0.1:0")
    server.start()
    try:
        url = f"grpc://127.0.0.1:{server.port}"
        keys = route_keys(tokens("q" * 96), "m")
        held = Holdings(open_directory(url), "http://e:2", address="http://e:2", ttl_s=5)
        held.hold(keys)
        reader = open_directory(url)
        assert eventually(lambda: held_depth(reader, "http://e:2", keys) == len(keys))
        assert reader.lookup(keys)[0].address == "http://e:2"
        held.close()
        assert eventually(lambda: not reader.lookup(keys))
    finally:
        server.stop()


@pytest.mark.parametrize("url", ["redis:/x", "http://h:1", "grpc://nohost", "grpc://h:99999", "h:1", ""])
def test_a_bad_directory_url_is_named(url: str) -> None:
    with pytest.raises(ConfigError, match="directory"):
        check_directory_url(url)


def test_route_keys_are_the_chunks_of_a_prompt() -> None:
    ids = list(range(100))
    keys = route_keys(ids, "m")
    assert len(keys) == 100 // ROUTE_TOKENS
    assert route_keys(ids[:48], "m") == keys[:3], "a prefix's keys are the prompt's first keys"
    assert route_keys(ids[48:], "m", parent=keys[2]) == keys[3:], "a chain continues from a parent"
    assert route_keys(ids, "other")[0] != keys[0] and route_keys(ids, "m", salt="s")[0] != keys[0]
