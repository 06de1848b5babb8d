"""kvbridge._core's tcp lane with real sockets, between real processes: on loopback and across emulated hosts
(kvbridge.testing.hosts; those tests need root and skip, saying why, without).

Every read is scattered (blocks in reverse order into consecutive slots) and checked both ways: the reader
compares every word with the producer's pattern, and its sha256 with the one the producer computes over
the same blocks. Refusals (ranges outside the registered KV, a wrong secret) serve no byte. Faults (the
producer killed, the link down or dropped by nftables, the reader killed) end the read within its
timeout_s without counting anything, and the same reader loads again once the link is back. A link that
keeps trickling bytes (every socket wait succeeds) ends the read at its start + timeout_s all the same,
and a consumer that reads at a trickle costs the producer its serving threads by the producer's own
timeout_s: on loopback through a throttling relay, and across hosts with the link capped.

Peers: tests/helpers/tcp_peer.py; the relay: tests/helpers/throttle.py.
"""

from __future__ import annotations

import errno
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import pytest

from kvbridge import native

if native.load_core()[0] is None or not hasattr(native.load_core()[0], "TcpServer"):
    pytest.skip(f"kvbridge._core with the tcp lane: {native.load_core()[1]}", allow_module_level=True)

import tcpkit  # noqa: E402 - tests/helpers, on sys.path by conftest
from tcp_peer import pattern  # noqa: E402 - tests/helpers, on sys.path by conftest
from tcpkit import BLOCK, TIMEOUT_S, Peer, pair, read_all  # noqa: E402 - tests/helpers, on sys.path by conftest
from throttle import Throttle  # noqa: E402 - tests/helpers, on sys.path by conftest

from kvbridge.testing.hosts import Host  # noqa: E402


# sndbuf: the kernel's, the lane's default, and one so small that every request refills it many times
@pytest.mark.parametrize(("streams", "sndbuf"), [(1, 0), (4, 0), (4, 512 << 10), (4, 64 << 10)])
def test_loopback_reads_are_bit_exact(streams: int, sndbuf: int) -> None:
    producer, reader, info = pair(256 * BLOCK, streams=streams, sndbuf=sndbuf)
    try:
        for blocks in (1, 17, 256):  # one stream below 1 MiB, then cut between `streams`
            read_all(producer, reader, info, blocks)
        conns, requests, _, refused = producer.ask(op="stats")["stats"]
        assert refused == 0 and requests >= 3 and conns <= streams  # connections kept between reads
    finally:
        reader.close()
        producer.close()


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "pipes"])
def test_reads_whose_parts_do_not_end_on_64_bytes_are_bit_exact(local: bool) -> None:
    """Blocks of 1 MiB + 8 bytes: the read's parts are cut on 64-byte boundaries and the last one is not a
    multiple of 64, so its reply ends in padding after the seal word (tcp.h's wire)."""
    block = (1 << 20) + 8
    producer, reader, info = pair(4 * block, local=local)
    try:
        assert producer.ask(op="seal", slot=2, word=0x5EA1)["ok"]
        for order in ([2, 0, 3], [1, 3, 0, 2], [3]):  # 3 and 4 streams, then one
            got = reader.ask(address=info["address"], block=block, order=order, seal=info["seals"] + 16)
            want = producer.ask(op="sha", offset=0, block=block, order=order)["sha"]
            assert got["bytes"] == len(order) * block and got["exact"] and got["sha"] == want, got
            assert got["word"] == 0x5EA1  # every stream's word, after its part's data (and padding)
    finally:
        reader.close()
        producer.close()


def _hello(port: int, secret: bytes, version: int = tcpkit.WIRE_VERSION) -> tuple[socket.socket, int]:
    """A consumer's TCP hello by hand (tcp.h): the connected socket and the server's status."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(tcpkit.hello(secret, version))
    return sock, struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))[0]


def test_the_wire_keeps_every_replys_data_on_64_byte_boundaries() -> None:
    """tcp.h's reply by hand: a 64-byte header, the data, the seal word and zeros up to the next multiple of 64,
    so that on a kept connection every reply's data starts 64-byte aligned in the stream, as the KV's pieces
    start, whatever the lengths before it. Nothing follows a reply."""
    producer, reader, info = pair(16 * BLOCK)
    reader.close()
    sock, status = _hello(info["port"], bytes.fromhex(info["secret"]))
    try:
        assert status == 0 and producer.ask(op="seal", slot=3, word=0xABCD)["ok"]
        for length in (BLOCK, 104, 8, 1000, 56, 64):  # every padding from 0 to 56 bytes
            offset = 64 + 8 * length  # a word of the pattern: word i is i * PATTERN_K
            sock.sendall(tcpkit.request(info["seals"] + 24, [(info["address"] + offset, length)]))
            head = sock.recv(tcpkit.REPLY.size, socket.MSG_WAITALL)
            assert tcpkit.REPLY.unpack(head) == (0, 0, length) and head[16:] == bytes(48)
            data = sock.recv(length, socket.MSG_WAITALL)
            assert data == pattern(offset // 8, -(-length // 8)).tobytes()[:length]
            pad = -(length + 8) % 64  # header + data + word + pad: a multiple of 64, so the next data is aligned
            tail = sock.recv(8 + pad, socket.MSG_WAITALL)
            assert struct.unpack("<Q", tail[:8])[0] == 0xABCD and tail[8:] == bytes(pad)
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(1)  # the reply ended where its padding said
    finally:
        sock.close()
        producer.close()


def test_a_consumer_of_another_wire_version_is_told_so() -> None:
    """A hello with the right secret and an older version: its own status (5, TCP_BAD_VERSION), not a claim
    that the secret was wrong, and the connection closes with no byte served."""
    producer, reader, info = pair(16 * BLOCK)
    reader.close()
    sock, status = _hello(info["port"], bytes.fromhex(info["secret"]), version=1)
    try:
        assert status == 5 and sock.recv(1) == b""
        assert producer.ask(op="stats")["stats"][1:] == [0, 0, 1]  # no request, no byte, one refusal
        bad, status = _hello(info["port"], b"x" * 32, version=1)
        bad.close()
        assert status == 1  # a stranger learns nothing about versions
    finally:
        sock.close()
        producer.close()


_CLOSE_TWICE = """
import socket, threading
import numpy as np
import kvbridge._core as core

buf = np.zeros(1 << 16, dtype=np.uint8)
for _ in range(300):
    server = core.TcpServer("127.0.0.1", 0, [(buf.ctypes.data, buf.nbytes)], b"s" * 32)
    conn = socket.create_connection(("127.0.0.1", server.port))  # a serving thread waits for its hello
    together, got = threading.Barrier(2), []

    def close():
        together.wait()
        got.append(server.close(5.0))

    threads = [threading.Thread(target=close) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.close()
    assert got == [True, True], got
print("ok")
"""


def test_two_threads_closing_one_server_at_once_free_it_once() -> None:
    """close() from two threads at once, a connection open: both wait for the server's threads, both say they
    ended, and only the last frees the server (freed twice, the process aborts: so the loop runs in a child)."""
    done = subprocess.run([sys.executable, "-c", _CLOSE_TWICE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


_CLOSE_LATE = """
import os, socket
import numpy as np
import kvbridge._core as core

def serving():  # this process's threads of a TcpServer (tcp_serve.c names them)
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sorted(n for n in names if n in ("kvbridge-accept", "kvbridge-serve"))

buf = np.zeros(1 << 16, dtype=np.uint8)
for _ in range(50):
    server = core.TcpServer("127.0.0.1", 0, [(buf.ctypes.data, buf.nbytes)], b"s" * 32)
    conn = socket.create_connection(("127.0.0.1", server.port))  # a serving thread waits for its hello
    assert server.close(0.0) is False  # no time to wait: its threads were still there
    assert server.close(5.0) is True  # so this close waits for them, rather than answering at once
    assert serving() == [], serving()
    conn.close()
print("ok")
"""


def test_a_close_that_timed_out_leaves_the_wait_to_the_next_close() -> None:
    """A close() whose threads outlive its timeout says so (False) and keeps the server; the next close()
    waits for them, and its True means no thread of the server reads the KV any more (in a child: the
    server's threads are counted by name in /proc)."""
    done = subprocess.run([sys.executable, "-c", _CLOSE_LATE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def _served_sndbufs(port: int) -> list[int]:
    """The send buffers (``ss``'s skmem ``tb``: the kernel's doubled SO_SNDBUF) of the connections served from
    ``port`` on this host."""
    out = subprocess.run(["ss", "-tmnH", "state", "established", f"( sport = :{port} )"], capture_output=True,
                         text=True, check=True).stdout
    return [int(w.split(",tb")[1].split(",")[0]) for w in out.split() if w.startswith("skmem:(")]


@pytest.mark.skipif(subprocess.run(["ss", "-V"], capture_output=True).returncode != 0, reason="needs ss (iproute2)")
@pytest.mark.parametrize("sndbuf", [0, 256 << 10])
def test_the_server_caps_each_connections_send_buffer(sndbuf: int) -> None:
    producer, reader, info = pair(64 * BLOCK, streams=4, sndbuf=sndbuf)
    try:
        read_all(producer, reader, info, 64)  # 4 MiB: four streams, their connections kept open after
        got = _served_sndbufs(info["port"])
        assert 1 <= len(got) <= 4, got  # a stream done first may hand its connection to the next
        if sndbuf:
            assert got == [2 * sndbuf] * len(got)  # the kernel doubles what it is asked for (its bookkeeping)
        else:  # the kernel's own: sized at the handshake from loopback's 64 KiB segments, far above the cap
            assert all(tb > 2 * (256 << 10) for tb in got), got
    finally:
        reader.close()
        producer.close()


def test_a_negative_send_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="sndbuf >= 0"):
        native.load_core()[0].TcpServer("127.0.0.1", 0, [], b"s" * 32, sndbuf=-1)


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "pipes"])
def test_ranges_outside_the_registered_kv_are_refused(local: bool) -> None:
    producer, reader, info = pair(16 * BLOCK, local=local)
    try:
        for address in (info["address"] + info["length"] - 8, info["address"] - BLOCK, 4096):
            got = reader.ask(address=address, block=BLOCK, order=[0])
            assert "refused ranges outside" in got["error"] and got["errno"] == 14, got  # EFAULT
        assert producer.ask(op="stats")["stats"][3] == 3
        read_all(producer, reader, info, 16)  # the refusal closed that connection only
    finally:
        reader.close()
        producer.close()


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "pipes"])
def test_a_wrong_secret_is_refused(local: bool) -> None:
    producer, reader, info = pair(16 * BLOCK, secret="00" * 32, local=local)
    try:
        got = reader.ask(address=info["address"], block=BLOCK, order=[0])
        assert got["error"].startswith("PermissionError") and "secret" in got["error"], got
        conns, requests, sent, refused = producer.ask(op="stats")["stats"]
        assert (requests, sent, refused) == (0, 0, 1)
    finally:
        reader.close()
        producer.close()


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "pipes"])
def test_the_seal_word_comes_after_the_data_or_is_zero(local: bool) -> None:
    """Over TCP the server reads the word after the data is in the socket; through pipes it goes in by
    reference after the data, so the reader copies it last (tcp_local.c)."""
    producer, reader, info = pair(64 * BLOCK, local=local)
    try:
        assert producer.ask(op="seal", slot=5, word=0x1234)["ok"]
        slot5 = info["seals"] + 8 * 5
        assert read_all(producer, reader, info, 64, seal=slot5)["word"] == 0x1234  # every stream agrees
        assert producer.ask(op="seal", slot=5, word=0)["ok"]  # the hold ended: the read must not count
        assert read_all(producer, reader, info, 64, seal=slot5)["word"] == 0
        assert read_all(producer, reader, info, 64, seal=slot5 + 3)["word"] == 0  # not a word of the table
        assert read_all(producer, reader, info, 64, seal=info["address"])["word"] == 0  # KV, not the table
    finally:
        reader.close()
        producer.close()


def test_across_hosts_reads_are_bit_exact(hosts: list[Host]) -> None:
    a, b = hosts
    producer, reader, info = pair(512 * BLOCK, a, b)
    try:
        assert producer.ask(op="seal", slot=1, word=99)["ok"]
        for blocks in (3, 512):
            assert read_all(producer, reader, info, blocks, seal=info["seals"] + 8)["word"] == 99
    finally:
        reader.close()
        producer.close()


RATE = "40mbit"  # 256 blocks of 64 KiB (16 MiB) take over 3 s: a fault lands mid-read
FAIL_WITHIN_S = TIMEOUT_S + 1.5  # no progress for timeout_s, plus a loaded machine's slack


@pytest.mark.parametrize("fault", ["producer-killed", "link-down", "nft-drop"])
def test_a_fault_mid_read_fails_it_in_time_and_the_reader_goes_on(hosts: list[Host], fault: str) -> None:
    a, b = hosts
    a.set_rate(RATE)
    producer, reader, info = pair(256 * BLOCK, a, b)
    try:
        read_all(producer, reader, info, 2)  # connected
        reader.send(address=info["address"], block=BLOCK, order=list(range(256))[::-1])
        time.sleep(0.5)
        t0 = time.monotonic()
        {"producer-killed": producer.proc.kill, "link-down": a.link_down, "nft-drop": a.drop}[fault]()
        got = reader.line(timeout=FAIL_WITHIN_S + 30)
        assert "error" in got and time.monotonic() - t0 < FAIL_WITHIN_S, got  # failed, nothing counted
        if fault == "producer-killed":
            producer.close()
            return
        a.link_up() if fault == "link-down" else a.undrop()
        a.set_rate(None)
        read_all(producer, reader, info, 256)  # the same reader, on fresh connections
    finally:
        reader.close()
        producer.close()


def test_a_reader_killed_mid_read_costs_the_producer_a_socket(hosts: list[Host]) -> None:
    a, b = hosts
    a.set_rate(RATE)
    producer, reader, info = pair(256 * BLOCK, a, b)
    try:
        reader.send(address=info["address"], block=BLOCK, order=list(range(256)))
        time.sleep(0.5)
        reader.close()
        deadline = time.monotonic() + TIMEOUT_S + 5
        while producer.ask(op="stats")["serving"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert producer.ask(op="stats")["serving"] == 0  # its threads ended with their sockets
        a.set_rate(None)
        other = Peer("read", "--host", a.address, "--port", str(info["port"]), "--secret", info["secret"], host=b)
        try:
            read_all(producer, other, info, 64)
        finally:
            other.close()
    finally:
        producer.close()


TRICKLE_BLOCKS = 1024  # 64 MiB: through the throttled relay (16 KiB per 10 ms per stream) over 10 s
SLACK_S = 1.5  # a loaded machine's lateness past a deadline


def _serving_ends(producer: Peer, within_s: float) -> float:
    """Seconds until the producer has no serving thread left; fails past ``within_s``."""
    t0 = time.monotonic()
    while producer.ask(op="stats")["serving"]:
        assert time.monotonic() - t0 < within_s, f"the producer still serves after {within_s}s"
        time.sleep(0.05)
    return time.monotonic() - t0


def _relayed(reader_timeout: float, producer_timeout: float) -> tuple[Peer, Throttle, Peer, dict[str, Any]]:
    producer = Peer("serve", "--bytes", str(TRICKLE_BLOCKS * BLOCK), "--timeout", str(producer_timeout))
    info = producer.line()
    relay = Throttle(("127.0.0.1", info["port"]))
    reader = Peer("read", "--port", str(relay.port), "--secret", info["secret"], "--timeout", str(reader_timeout))
    return producer, relay, reader, info


def test_a_trickling_link_fails_the_read_at_its_deadline() -> None:
    """timeout_s bounds the whole read, not each wait: bytes keep arriving, yet the read fails at its start +
    timeout_s, its connections are dropped (the producer's threads end with them), and the next read of the
    same source opens fresh ones and is bit-exact. The producer's own deadline is far off here."""
    producer, relay, reader, info = _relayed(TIMEOUT_S, 120.0)
    try:
        read_all(producer, reader, info, 4)  # connected at full speed (one stream)
        relay.trickle = True
        got = reader.ask(address=info["address"], block=BLOCK, order=list(range(TRICKLE_BLOCKS))[::-1], timeout=60)
        assert got.get("errno") == errno.ETIMEDOUT and "deadline" in got["error"], got
        assert TIMEOUT_S - 0.1 < got["seconds"] < TIMEOUT_S + SLACK_S, got  # at the deadline, not per wait
        _serving_ends(producer, 5.0)  # the reader closed them: never given back mid-message
        relay.trickle = False
        before = relay.accepted
        read_all(producer, reader, info, TRICKLE_BLOCKS)
        assert relay.accepted == before + 4  # every stream on a fresh connection
    finally:
        reader.close()
        relay.close()
        producer.close()


def test_a_trickling_consumer_costs_the_producer_its_threads_by_its_deadline() -> None:
    """The producer answers each request by its arrival + its own timeout_s: a consumer that reads at a
    trickle (with a far deadline of its own) does not keep a serving thread past that."""
    producer, relay, reader, info = _relayed(120.0, TIMEOUT_S)
    try:
        relay.trickle = True
        reader.send(address=info["address"], block=BLOCK, order=list(range(TRICKLE_BLOCKS)))
        deadline = time.monotonic() + 30
        while producer.ask(op="stats")["serving"] < 4:  # the reader process is up and its requests are in
            assert time.monotonic() < deadline, "the reader's streams never reached the producer"
            time.sleep(0.02)
        assert _serving_ends(producer, TIMEOUT_S + SLACK_S) > 0
        got = reader.line(timeout=60)  # what was in flight trickles out, then the streams end short
        assert "error" in got and got["seconds"] < 30, got
        relay.trickle = False
        read_all(producer, reader, info, 64)
    finally:
        reader.close()
        relay.close()
        producer.close()


TRICKLE_RATE = "2mbit"  # 512 blocks of 64 KiB (32 MiB) would take over two minutes


def test_across_hosts_a_trickling_link_fails_the_read_at_its_deadline(hosts: list[Host]) -> None:
    a, b = hosts
    producer, reader, info = pair(512 * BLOCK, a, b)
    try:
        read_all(producer, reader, info, 2)  # connected
        a.set_rate(TRICKLE_RATE)
        got = reader.ask(address=info["address"], block=BLOCK, order=list(range(512))[::-1], timeout=60)
        assert got.get("errno") == errno.ETIMEDOUT and got["seconds"] < TIMEOUT_S + SLACK_S, got
        _serving_ends(producer, TIMEOUT_S + 5)
        a.set_rate(None)
        read_all(producer, reader, info, 512)  # the same reader, bit-exact
    finally:
        reader.close()
        producer.close()
