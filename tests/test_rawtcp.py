"""The cross-host bench's raw media in C (``ctcp:N`` and ``pipe:N`` rows, one buffer or ``/scat``tered,
:mod:`kvbridge.bench.rawtcp`): they move real bytes over loopback and through pipes, and a receiver handed bytes that differ from the pattern says so instead of timing them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading

import pytest

from kvbridge.bench import hosts as bench_hosts
from kvbridge.bench import rawtcp
from kvbridge.bench.baselines import Unavailable


def _exe() -> str:
    try:
        return rawtcp.binary()
    except Unavailable as exc:
        pytest.skip(str(exc))


def _last(out: str) -> dict[str, object]:
    return dict(json.loads([line for line in out.splitlines() if line.startswith("@@")][-1][2:]))


# the kernel's buffers and blocking sends (ctcp:N); a capped buffer refilled by non-blocking sends
# (ctcp-sndbuf:N); pipes handed over an abstract Unix socket (pipe:N). The warm-up's bytes are compared.
# Each also with the bytes scattered (rows .../scat): pieces at random places of a buffer twice their size,
# each side its own layout, so that a wrong iovec on either side makes the compared bytes differ.
@pytest.mark.parametrize("piece", ["", "32768", "4093"])
@pytest.mark.parametrize("medium", ["0", str(64 << 10), "@kvbridge-rawtcp-test"])
def test_send_and_recv_over_loopback_time_every_rep(medium: str, piece: str) -> None:
    exe = _exe()
    nbytes = (3 << 20) + 5  # not a multiple of the stream count: the last slice is longer
    env = {**os.environ, "KVBRIDGE_RAWTCP_PIECE": piece}
    sender = subprocess.Popen([exe, "send", str(nbytes), "3", medium], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert sender.stdout is not None
        port = json.loads(sender.stdout.readline()[2:])["port"]
        host = medium if medium.startswith("@") else "127.0.0.1"
        got = subprocess.run([exe, "recv", host, str(port), str(nbytes), "3", "4", str(1 << 20)],
                             capture_output=True, text=True, timeout=60, env=env)
        msg = _last(got.stdout)
        samples = msg["samples"]
        assert isinstance(samples, list) and len(samples) == 4 and all(s > 0 for s in samples), msg
        assert float(msg["cpu"]) >= 0  # type: ignore[arg-type]
        assert "cpu" in _last(sender.communicate(timeout=30)[0])  # the sender ends once the receiver quits
    finally:
        sender.kill()
        sender.wait()


def test_receiver_refuses_bytes_that_differ() -> None:
    exe = _exe()
    nbytes = 1 << 20
    listener = socket.create_server(("127.0.0.1", 0))

    def wrong_sender() -> None:  # answers the ask with zeros, not the pattern
        conn = listener.accept()[0]
        with conn:
            if conn.recv(1) == b"g":
                conn.sendall(bytes(nbytes))
                conn.recv(1)

    t = threading.Thread(target=wrong_sender, daemon=True)
    t.start()
    got = subprocess.run([exe, "recv", "127.0.0.1", str(listener.getsockname()[1]), str(nbytes), "1", "2", "0"],
                         capture_output=True, text=True, timeout=60)
    listener.close()
    assert got.returncode != 0
    assert "differ" in str(_last(got.stdout)["error"])


@pytest.mark.parametrize(("row", "ok"), [("ctcp:4", True), ("tcp:8", True), ("ctcp:64", True), ("ctcp:0", False),
                                         ("ctcp:65", False), ("ctcp:x", False), ("udp:4", False),
                                         ("ctcp-sndbuf:4", True), ("ctcp-sndbuf:0", False),
                                         ("pipe:4", True), ("pipe:0", False), ("pipe:4/scat", True),
                                         ("ctcp-sndbuf:4/scat", True), ("tcp:4/scat", False), ("ctcp:4/x", False)])
def test_raw_rows_any_stream_count(row: str, ok: bool) -> None:
    assert bench_hosts._raw(row) is ok
