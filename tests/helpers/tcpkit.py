"""The tcp lane's peers as processes, for tests/test_tcplane*.py: :class:`Peer` (a tcp_peer.py process, on an
emulated host or here, one JSON line per command), a producer and reader pair, and a read checked both ways."""

from __future__ import annotations

import json
import queue
import secrets
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbridge.testing.hosts import Host

PEER = Path(__file__).parent / "tcp_peer.py"
BLOCK = 64 << 10
TIMEOUT_S = 2.0

# kvbridge/csrc/tcp.h's wire, for the tests that speak it by hand: a change there is made here once
WIRE_VERSION = 2
REPLY = struct.Struct("<IIQ48x")  # a reply's header: status, 0, total, then zeros to 64 bytes


def hello(secret: bytes, version: int = WIRE_VERSION) -> bytes:
    """A consumer's hello: magic "KVBT", the wire version, the producer's secret."""
    return struct.pack("<II", 0x5442564B, version) + secret


def request(seal_address: int, descs: Sequence[tuple[int, int]]) -> bytes:
    """A request: magic "KVBR", how many descriptors, the seal word's address, then each (address, length)."""
    return struct.pack("<IIQ", 0x5242564B, len(descs), seal_address) + b"".join(struct.pack("<QQ", *d) for d in descs)


class Peer:
    """A tcp_peer.py process (on a host, or here): one JSON line per command."""

    def __init__(self, *args: str, host: Host | None = None):
        argv = [sys.executable, str(PEER), *args]
        kw: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
        self.proc = host.popen(argv, **kw) if host is not None else subprocess.Popen(argv, **kw)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def line(self, timeout: float = 30.0) -> dict[str, Any]:
        try:
            return dict(json.loads(self._lines.get(timeout=timeout)))
        except queue.Empty:
            raise AssertionError(f"tcp_peer said nothing for {timeout}s (exit {self.proc.poll()})") from None

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, timeout: float = 30.0, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.line(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def pair(nbytes: int, a: Host | None = None, b: Host | None = None, *, local: bool = False, sigpipe_default: bool = False,
         **kw: Any) -> tuple[Peer, Peer, dict[str, Any]]:
    """A producer (on ``a``, else here) and a reader (on ``b``) of ``nbytes``; ``local``: the producer also serves
    the local medium (its name in ``info["name"]``) and the reader dials that, its data through pipes."""
    host = a.address if a is not None else "127.0.0.1"
    name = f"kvbridge-test-{secrets.token_hex(8)}" if local else ""
    extra = [*(["--local", name] if local else []), *(["--sigpipe-default"] if sigpipe_default else [])]
    producer = Peer("serve", "--bytes", str(nbytes), "--host", host, "--timeout", str(TIMEOUT_S),
                    "--sndbuf", str(kw.get("sndbuf", 0)), *extra, host=a)
    info = {**producer.line(), "name": name}
    reader = Peer("read", "--host", "@" + name if local else host, "--port", str(info["port"]), "--secret",
                  kw.get("secret", info["secret"]), "--streams", str(kw.get("streams", 4)), "--timeout", str(TIMEOUT_S),
                  host=b)
    return producer, reader, info


def read_all(producer: Peer, reader: Peer, info: dict[str, Any], blocks: int, seal: int = 0) -> dict[str, Any]:
    order = list(range(blocks))[::-1]
    got = reader.ask(address=info["address"], block=BLOCK, order=order, seal=seal, timeout=60)
    assert "error" not in got, got
    want = producer.ask(op="sha", offset=0, block=BLOCK, order=order)["sha"]
    assert got["bytes"] == blocks * BLOCK and got["exact"] and got["sha"] == want, got
    return got
