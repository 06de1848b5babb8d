"""The tcp lane's local medium (kvbridge/csrc/tcp_local.c): between processes of one network namespace the KV's
pages go through pipes by reference, handed over the producer's abstract Unix socket.

Real processes and sockets throughout: on this host, between two pods (own pid, IPC and mount namespaces,
one network) and across two emulated hosts, where the socket is not found and TCP carries the load. Every
read is scattered and compared word by word and by sha256 with the producer's bytes. A producer that stops
or dies fails the read, never counts it; a consumer that drops its pipe mid-request costs the producer a
thread, not its process (SIGPIPE), and at once. Refusals and the seal word over both media:
tests/test_tcplane.py.
"""

from __future__ import annotations

import errno
import os
import secrets
import select
import signal
import socket
import struct
import sys
import time
from pathlib import Path

import pytest
import tcpkit
from kvbridge.connectors.ucx import tcplane
from tcpkit import BLOCK, TIMEOUT_S, Peer, pair, read_all

from kvbridge import native
from kvbridge.testing.hosts import EmulatedHosts, Host, unavailable

SLACK_S = 1.5  # a loaded machine's lateness past a deadline


@pytest.mark.parametrize("streams", [1, 4])
def test_local_reads_are_bit_exact_and_through_pipes(streams: int) -> None:
    producer, reader, info = pair(256 * BLOCK, streams=streams, local=True)
    try:
        for blocks in (1, 17, 256):  # one stream below 1 MiB, then cut between `streams`; 16 MiB fills the pipes
            assert read_all(producer, reader, info, blocks)["local"] is True
        conns, requests, sent, refused = producer.ask(op="stats")["stats"]
        assert refused == 0 and requests >= 3 and conns <= streams and sent == (1 + 17 + 256) * BLOCK
    finally:
        reader.close()
        producer.close()


def _pods() -> EmulatedHosts:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    return EmulatedHosts(2, pods=True)


def _reachable_from(host: Host, name: str) -> bool:
    code = f"from kvbridge.connectors.ucx.tcplane import reachable_locally as r; print(r({name!r}))"
    out = host.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.strip() == "True"


def test_between_pods_the_kv_goes_through_pipes_bit_exact() -> None:
    with _pods() as (a, b):
        producer, reader, info = pair(512 * BLOCK, a, b, local=True)
        try:
            assert _reachable_from(b, info["name"])  # one network namespace: its abstract sockets cross
            assert producer.ask(op="seal", slot=2, word=42)["ok"]
            for blocks in (3, 512):
                got = read_all(producer, reader, info, blocks, seal=info["seals"] + 16)
                assert got["local"] is True and got["word"] == 42
        finally:
            reader.close()
            producer.close()


def test_across_hosts_the_local_socket_is_not_found_and_tcp_carries_it(hosts: list[Host]) -> None:
    a, b = hosts
    producer, reader, info = pair(64 * BLOCK, a, b, local=True)
    try:
        assert _reachable_from(a, info["name"]) and not _reachable_from(b, info["name"])
        got = reader.ask(address=info["address"], block=BLOCK, order=[0])  # dialled anyway: refused at once
        assert got["errno"] == errno.ECONNREFUSED and got["seconds"] < 1.0, got
        tcp = Peer("read", "--host", a.address, "--port", str(info["port"]), "--secret", info["secret"], host=b)
        try:
            assert read_all(producer, tcp, info, 64)["local"] is False
        finally:
            tcp.close()
    finally:
        reader.close()
        producer.close()


def test_a_producer_that_stops_fails_the_read_by_its_deadline_and_a_dead_one_at_once() -> None:
    producer, reader, info = pair(256 * BLOCK, local=True)
    try:
        read_all(producer, reader, info, 256)  # connected, pipes handed over
        os.kill(producer.proc.pid, signal.SIGSTOP)
        got = reader.ask(address=info["address"], block=BLOCK, order=list(range(256)), timeout=60)
        assert got.get("errno") == errno.ETIMEDOUT and got["seconds"] < TIMEOUT_S + SLACK_S, got
        reader.send(address=info["address"], block=BLOCK, order=list(range(256)))
        time.sleep(0.5)  # the read waits on a stopped producer's socket and pipes
        t0 = time.monotonic()
        producer.proc.kill()
        got = reader.line(timeout=30)
        assert "error" in got and time.monotonic() - t0 < 1.0, got  # its sockets closed: no wait for the deadline
    finally:
        reader.close()
        producer.close()


def _hello(name: str, secret: bytes) -> tuple[socket.socket, int]:
    """A consumer's side of the local hello by hand: the socket and the pipe's read end the server handed over."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + name)
    sock.sendall(tcpkit.hello(secret))
    msg, fds, _, _ = socket.recv_fds(sock, 4, 1)
    assert struct.unpack("<I", msg)[0] == 0 and len(fds) == 1
    return sock, fds[0]


def test_a_consumer_that_drops_its_pipe_costs_the_producer_a_thread_not_its_process() -> None:
    """SIGPIPE's default action kills; the producer's vmsplice into a pipe nobody reads must not: the server
    blocks it in its threads. The serving thread ends with the connection, well before the deadline."""
    producer, reader, info = pair(256 * BLOCK, local=True, sigpipe_default=True)
    reader.close()
    sock, pipe = _hello(info["name"], bytes.fromhex(info["secret"]))
    try:
        blocks = 256  # 16 MiB: the server fills the pipe and waits for room
        sock.sendall(tcpkit.request(0, [(info["address"] + k * BLOCK, BLOCK) for k in range(blocks)]))
        assert tcpkit.REPLY.unpack(sock.recv(tcpkit.REPLY.size, socket.MSG_WAITALL)) == (0, 0, blocks * BLOCK)
        assert select.select([pipe], [], [], 10)[0] and len(os.read(pipe, 1 << 16)) > 0  # data is flowing
        time.sleep(0.2)  # the pipe is full again: the server waits on it
        t0 = time.monotonic()
        os.close(pipe)  # gone: its next vmsplice meets EPIPE (and SIGPIPE)
        pipe = -1
        while producer.ask(op="stats")["serving"]:
            assert time.monotonic() - t0 < TIMEOUT_S - 0.5, "the serving thread waited for its deadline"
            time.sleep(0.02)
        assert producer.proc.poll() is None  # alive: SIGPIPE never reached the process
        again = Peer("read", "--host", "@" + info["name"], "--secret", info["secret"], "--timeout", str(TIMEOUT_S))
        try:
            read_all(producer, again, info, 64)
        finally:
            again.close()
    finally:
        if pipe >= 0:
            os.close(pipe)
        sock.close()
        producer.close()


def test_a_name_taken_by_another_server_is_refused() -> None:
    mod, _ = native.load_core()
    name = f"kvbridge-test-{secrets.token_hex(8)}"
    first = mod.TcpServer("127.0.0.1", 0, [], b"s" * 32, local=name)
    try:
        with pytest.raises(OSError) as exc:
            mod.TcpServer("127.0.0.1", 0, [], b"s" * 32, local=name)
        assert exc.value.errno == errno.EADDRINUSE
        assert tcplane.reachable_locally(name) and not tcplane.reachable_locally(name + "-none")
    finally:
        first.close()


def test_the_connectors_auto_lane_between_pods_loads_through_pipes(tmp_path: Path) -> None:
    pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")
    import hostpeer as hp  # tests/helpers, on sys.path by tests/conftest.py

    with _pods() as (a, b):
        producer = hp.HostPeer(a, "producer", tmp_path / "p", "--lease", "30", "--num-blocks", "256")
        consumer = hp.HostPeer(b, "consumer", tmp_path / "c", "--num-blocks", "256", "--timeout", "5")
        try:
            for i, tokens in enumerate([16 * 64, 16 * 200 + 1]):
                params, sent = producer.prefill(f"r{i}", tokens, seed=i)
                got = consumer.ask(op="pull", rid=f"c{i}", tokens=tokens, seed=i, params=params)
                assert got["failed"] == 0 and got["loaded"] == hp.full_blocks(tokens), got
                assert got["exact"] and got["sha"] == sent
            producer.wait_released(10)
            stats = consumer.ask(op="state")["stats"]
            assert stats["lane_tcp_local_loads"] == 2 and stats["lane_tcp_loads"] == 0, stats
        finally:
            assert consumer.close() == 0
            assert producer.close() == 0


@pytest.mark.parametrize("local", [True, False])
def test_the_option_tcp_local_picks_the_medium_and_both_are_bit_exact(tmp_path: Path, local: bool) -> None:
    pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")
    import torch
    from kvbridge.connectors.ucx import UcxBackend, UcxOptions

    from kvbridge.testing import MiniEngine

    options = UcxOptions(registry_dir=str(tmp_path / "reg"), timeout_s=5, lane="tcp", tcp_local=local)
    producer = MiniEngine(UcxBackend(options), engine_id="p", role="producer", seed=1)
    consumer = MiniEngine(UcxBackend(options), engine_id="c", role="consumer", seed=2)
    try:
        for i in range(2):  # the handshake's load, then one started from the step
            tokens = list(range(1000 * i, 1000 * i + 16 * 5 + 3))
            sent = producer.prefill(f"r{i}", tokens)
            got = consumer.prefill(f"r{i}-c", tokens, sent.finish.transfer_params)
            assert got.failed_blocks == [] and len(got.loaded_blocks) == 5
            assert torch.equal(got.snapshot[:, :5], sent.snapshot[:, :5])  # the bytes that left arrived
        stats = consumer.worker.stats  # type: ignore[attr-defined]
        assert (stats.lane_tcp_local_loads, stats.lane_tcp_loads) == ((2, 0) if local else (0, 2))
    finally:
        consumer.close()
        producer.close()
