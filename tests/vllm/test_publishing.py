"""An engine's prefix cache published for routers (:mod:`kvbridge.serving.publishing`), with vLLM's own classes:
the connector's options checked at start-up, each request's blocks published at its end, and vLLM's KV-cache
events — sent by vLLM's own ZMQ publisher — followed block by block, evictions included. The directory is a
real metadata server's; a real engine behind a real proxy is in ``test_routing.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace as NS
from typing import Any

import pytest
from test_adapter import KV_CACHE_CONFIG, config

from kvbridge.errors import ConfigError
from kvbridge.keys import route_keys
from kvbridge.metadata.holdings import Holdings, open_directory
from kvbridge.metadata.server import MetadataServer
from kvbridge.testing.services import eventually, free_port, held_depth


@pytest.fixture
def directory() -> Iterator[str]:
    server = MetadataServer("127.0.0.1:0")
    port = server.start()
    yield f"grpc://127.0.0.1:{port}"
    server.stop()


def test_a_finished_request_publishes_its_computed_blocks(vl: Any, directory: str) -> None:
    extra = {"backend": "memory", "name": "pub", "directory": directory, "advertise_url": "http://127.0.0.1:8101/"}
    cfg = config(vl, "kv_both", extra)
    cfg.model_config.served_model_name = "tiny"
    sched = vl.c.KVBridgeConnector(cfg, vl.Role.SCHEDULER, KV_CACHE_CONFIG)
    try:
        prompt = list(range(1000, 1100))  # 3 full blocks of 32, and 4 tokens
        req = NS(request_id="r", prompt_token_ids=prompt, all_token_ids=prompt + [7, 8], num_computed_tokens=101,
                 kv_transfer_params=None, cache_salt=None, lora_request=None)  # fmt: skip
        sched.request_finished(req, [1, 2, 3, 4])
        keys = route_keys(prompt, "tiny")
        # every chunk of the 3 computed full blocks, under the advertised URL (no trailing slash)
        assert eventually(lambda: held_depth(open_directory(directory), "http://127.0.0.1:8101", keys) == 3 * 32 // 16)
        assert open_directory(directory).lookup(keys)[0].address == "http://127.0.0.1:8101"
    finally:
        sched.shutdown()
    assert eventually(lambda: not open_directory(directory).lookup(route_keys(prompt, "tiny"))), "shutdown unpublishes"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"directory": "grpc://127.0.0.1:1"}, "needs 'advertise_url'"),
        ({"advertise_url": "http://a:1"}, "need 'directory'"),
        ({"directory": "redis:/x", "advertise_url": "http://a:1"}, "directory"),
        ({"directory": "grpc://127.0.0.1:1", "advertise_url": "ftp://a"}, "advertise_url"),
        ({"directory": "grpc://127.0.0.1:1", "advertise_url": "http://a:1", "directory_ttl_s": 0}, "directory_ttl_s"),
    ],
)
def test_publishing_options_are_checked_on_every_role(vl: Any, extra: dict, message: str) -> None:
    for role in (vl.Role.SCHEDULER, vl.Role.WORKER):
        with pytest.raises(ConfigError, match=message):
            vl.c.KVBridgeConnector(config(vl, "kv_both", {"backend": "memory", "name": "x", **extra}), role, KV_CACHE_CONFIG)


@contextlib.contextmanager
def _vllm_feed(directory: str) -> Iterator[tuple[Holdings, Callable[..., None]]]:
    """A :class:`KVEventFeed` on vLLM's own ZMQ publisher, publishing into ``directory`` as ``http://e:1``:
    its holdings, and ``send(*events)``, which returns once the feed has heard them."""
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    from kvbridge.serving.publishing import KVEventFeed

    port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", topic="kv")
    holdings = Holdings(open_directory(directory), "http://e:1", address="http://e:1", ttl_s=10)
    feed = KVEventFeed(f"tcp://127.0.0.1:{port}", "kv", holdings, "tiny")

    def send(*events: Any) -> None:
        before = feed.seen
        for _ in range(100):  # a SUB socket joins a moment after it connects: resend until it is heard
            publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))
            if eventually(lambda: feed.seen > before, 0.1):
                return
        raise AssertionError("the subscriber never heard vLLM's publisher")

    try:
        yield holdings, send
    finally:
        feed.close()
        holdings.close()
        publisher.shutdown()


def test_vllms_kv_events_are_followed_block_by_block(directory: str) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    tokens = list(range(500, 500 + 32 * 4))
    keys = route_keys(tokens, "tiny")

    def stored(hashes: list[int], parent: int | None, first: int, salt: str | None = None) -> BlockStored:
        extra = [("s1",) if salt else None for _ in hashes]
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens[first * 32 : (first + len(hashes)) * 32],
                           block_size=32, lora_id=None, medium="GPU", lora_name=None, extra_keys=extra)  # fmt: skip

    with _vllm_feed(directory) as (holdings, send):
        send(stored([11, 12], None, 0))  # two blocks, then a child of the second
        send(stored([13], 12, 2))
        assert eventually(lambda: held_depth(open_directory(directory), "http://e:1", keys) == 6)
        send(stored([99], 98, 3))  # a parent never seen: cannot be keyed, nothing published
        send(stored([14], 13, 3, salt="s1"))  # a salted block: a router cannot key it
        time.sleep(0.3)
        assert held_depth(open_directory(directory), "http://e:1", keys) == 6 and len(holdings.held()) == 6
        send(BlockRemoved(block_hashes=[12], medium="GPU"))  # evicted: its chunks are taken back
        assert eventually(lambda: held_depth(open_directory(directory), "http://e:1", keys) == 2)
        send(AllBlocksCleared())
        assert eventually(lambda: held_depth(open_directory(directory), "http://e:1", keys) == 0)
        assert holdings.held() == []


def test_kvbridge_publish_follows_an_engine_from_beside_it(directory: str) -> None:
    """``kvbridge publish``: vLLM's own publisher's events, kept in the directory by a separate process."""
    import subprocess
    import sys

    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    cmd = [sys.executable, "-m", "kvbridge.cli", "publish", "--kv-events", f"tcp://127.0.0.1:{port}", "--directory", directory,
           "--advertise-url", "http://127.0.0.1:8200", "--model", "tiny", "--ttl", "5"]  # fmt: skip
    sidecar = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tokens = list(range(64))
    keys = route_keys(tokens, "tiny")
    event = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens, block_size=32, lora_id=None,
                        medium="GPU", lora_name=None)  # fmt: skip
    try:
        assert sidecar.stdout is not None
        assert any("kvbridge publish:" in sidecar.stdout.readline() for _ in range(50)), "it never said it started"

        def published() -> bool:  # its SUB socket joins a moment after it starts: send until it is heard
            publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
            return held_depth(open_directory(directory), "http://127.0.0.1:8200", keys) == 4

        assert eventually(published, 30)
        sidecar.terminate()
        assert sidecar.wait(30) == 0
        assert eventually(lambda: held_depth(open_directory(directory), "http://127.0.0.1:8200", keys) == 0), "a stopped sidecar unpublishes"
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
        publisher.shutdown()


def test_kvbridge_publish_refuses_bad_input() -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvbridge.cli", "publish", "--kv-events", "tcp://127.0.0.1:1", "--directory", "nope",
           "--advertise-url", "http://a:1", "--model", "m"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "directory" in out.stderr and "Traceback" not in out.stderr


def test_a_block_stays_published_while_any_medium_holds_it(directory: str) -> None:
    """vLLM's GPU prefix cache and a kvbridge tier publish the same block under their own media (and vLLM
    names its KV-cache group where kvbridge's tier events name none): the GPU evicting it takes nothing back
    while the CPU tier holds it, and a removal from the CPU tier unpublishes only once no medium holds it."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    tokens = list(range(700, 700 + 32 * 2))
    keys = route_keys(tokens, "tiny")

    def stored(medium: str, group: int | None) -> BlockStored:
        return BlockStored(block_hashes=[21, 22], parent_block_hash=None, token_ids=tokens, block_size=32, lora_id=None,
                           medium=medium, lora_name=None, group_idx=group)  # fmt: skip

    def depth() -> int:
        return held_depth(open_directory(directory), "http://e:1", keys)

    with _vllm_feed(directory) as (holdings, send):
        for group in (0, None):  # the same group for both media, then vLLM's group 0 beside a tier's none
            send(stored("GPU", 0), stored("CPU", group))
            assert eventually(lambda: depth() == 4)
            send(BlockRemoved(block_hashes=[21, 22], medium="GPU", group_idx=0))  # the GPU cache evicts both
            time.sleep(0.3)
            assert depth() == 4 and len(holdings.held()) == 4, "the cpu tier still holds them"
            send(BlockRemoved(block_hashes=[22], medium="DISK", group_idx=group))  # a medium that never held it
            time.sleep(0.3)
            assert depth() == 4
            send(BlockRemoved(block_hashes=[22], medium="CPU", group_idx=group))  # the tier evicts the second
            assert eventually(lambda: depth() == 2)
            send(stored("GPU", 0), BlockRemoved(block_hashes=[21], medium="CPU", group_idx=group))  # back on the GPU
            time.sleep(0.3)
            assert depth() == 4, "held by the GPU again"
            send(BlockRemoved(block_hashes=[21, 22], medium="GPU", group_idx=0))
            assert eventually(lambda: depth() == 0) and holdings.held() == []


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(("bound", "dialled"), [
    ("tcp://*:{port}", "tcp://127.0.0.1:{port}"),
    ("tcp://0.0.0.0:{port}", "tcp://127.0.0.1:{port}"),
    ("tcp://[::]:{port}", "tcp://[::1]:{port}"),
    ("tcp://127.0.0.1:{port}", "tcp://127.0.0.1:{port}"),
    ("tcp://[::1]:{port}", "tcp://[::1]:{port}"),
])  # fmt: skip
def test_the_feed_hears_an_engine_bound_at_each_address_form(directory: str, bound: str, dialled: str) -> None:
    """The engine's ``--kv-events-config`` endpoint, as :func:`kv_events_endpoint` turns it into one to dial
    (a wildcard: the loopback of its family; ``::`` is IPv6 only), and a :class:`KVEventFeed` that hears a
    real ZMQ publisher bound there. The publisher is a plain PUB socket with ``IPV6`` on, sending vLLM's
    own encoded batches: vLLM 0.32's ``ZmqEventPublisher`` binds without ``IPV6``, so it cannot bind
    ``[::]`` at all (ENODEV); a publisher that can must still be followed."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from kvbridge.serving.publishing import KVEventFeed, kv_events_endpoint

    if "[" in bound and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.IPV6, 1)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(bound.format(port=port))
    cfg = NS(kv_events_config=NS(enable_kv_cache_events=True, publisher="zmq", endpoint=bound.format(port=port), topic="kv"),
             parallel_config=NS(data_parallel_rank=0))  # fmt: skip
    endpoint, topic = kv_events_endpoint(cfg) or ("", "")
    assert (endpoint, topic) == (dialled.format(port=port), "kv")
    holdings = Holdings(open_directory(directory), "http://e:1", address="http://e:1", ttl_s=10)
    feed = KVEventFeed(endpoint, topic, holdings, "tiny")
    tokens = list(range(32))
    batch = KVEventBatch(ts=time.time(), events=[BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=tokens, block_size=32,
                                                             lora_id=None, medium="GPU", lora_name=None)])  # fmt: skip
    try:
        for _ in range(100):  # a SUB socket joins a moment after it connects: resend until it is heard
            pub.send_multipart([b"kv", (0).to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
            if eventually(lambda: feed.seen > 0, 0.1):
                break
        assert feed.seen > 0, f"no event heard from {bound} at {endpoint}"
        assert eventually(lambda: held_depth(open_directory(directory), "http://e:1", route_keys(tokens, "tiny")) == 2)
    finally:
        feed.close()
        holdings.close()
        pub.close()


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557", "tcp://:5557",
                                      "tcp://::1:5557", "tcp://127.0.0.1:0", "tcp://127.0.0.1", "udp://1.2.3.4:5"])
def test_an_endpoint_a_subscriber_cannot_dial_is_refused_with_what_to_give(endpoint: str) -> None:
    """``kvbridge publish --kv-events`` (and :class:`KVEventFeed`): a wildcard names the fix (the engine's
    host; the loopback of that family on its machine), as do an unbracketed IPv6 address and a bad port."""
    from kvbridge.serving.publishing import subscriber_endpoint

    with pytest.raises(ConfigError) as caught:
        subscriber_endpoint(endpoint)
    message = str(caught.value)
    assert endpoint in message
    if endpoint in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://:5557"):
        assert "every interface" in message and "tcp://127.0.0.1:5557" in message
    if endpoint == "tcp://[::]:5557":
        assert "every interface" in message and "tcp://[::1]:5557" in message
    if endpoint == "tcp://::1:5557":
        assert "tcp://[::1]:5557" in message


def test_a_port_0_publisher_is_refused_at_start_up() -> None:
    """An engine bound at port 0 (the OS picks) cannot be followed from its config: refused, naming the fix."""
    from kvbridge.serving.publishing import kv_events_endpoint

    cfg = NS(kv_events_config=NS(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:0", topic=""),
             parallel_config=NS(data_parallel_rank=0))  # fmt: skip
    with pytest.raises(ConfigError, match="fixed port"):
        kv_events_endpoint(cfg)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://engine-0:5557", "ipc:///tmp/kv"])
def test_an_endpoint_to_dial_is_taken_as_given(endpoint: str) -> None:
    from kvbridge.serving.publishing import subscriber_endpoint

    assert subscriber_endpoint(endpoint) == endpoint


def test_kvbridge_publish_refuses_a_wildcard_before_it_starts(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from kvbridge.serving.publishing import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--kv-events", "tcp://[::]:5557", "--directory", "grpc://127.0.0.1:1", "--advertise-url",
                           "http://127.0.0.1:8000", "--model", "tiny"])  # fmt: skip
    assert exited.value.code == 2 and "tcp://[::1]:5557" in capsys.readouterr().err
