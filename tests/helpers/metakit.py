"""What the metadata tests share (tests/test_metadata*.py): the peers they describe, standalone
``kvbridge metadata-server`` processes, and a *peer* process that runs :class:`MetadataClient` calls sent
to it as JSON lines and answers with results or kvbridge exception names."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from typing import Any

from kvbridge import errors
from kvbridge.layout import LayoutFingerprint
from kvbridge.metadata.types import PeerInfo

FP = LayoutFingerprint("float16", 2, 4, 64, 16, 16384, "blocks_first")
PRODUCER = PeerInfo("prefill-0", 0, FP, {"ucx_worker_address": b"\x00\xffworker", "ucx_listener": b"127.0.0.1:1"})
CONSUMER = PeerInfo("decode-0", 1, FP, {"ucx_worker_address": b"\x01consumer"})
MAX_HASHES = 64  # the standalone servers' --max-hashes: small, so the fuzzer reaches the limit cheaply
MAX_MESSAGE = 1 << 16

# ---- the peer process: MetadataClient calls over JSON lines -----------------------------------------

PEER_SCRIPT = r"""
import json, sys
from kvbridge import errors
from kvbridge.layout import LayoutFingerprint
from kvbridge.metadata.client import MetadataClient
from kvbridge.metadata.types import DirectoryEntry, PeerInfo
from kvbridge.metadata.wire import ClientTLS

def decode(d):
    if set(d) == {"b"}:
        return bytes.fromhex(d["b"])
    if set(d) == {"peer"}:
        p = d["peer"]
        return PeerInfo(p["engine_id"], p["rank"], LayoutFingerprint.from_json(p["fingerprint"]),
                        p["transport"], p["protocol_version"])
    return d

def encode(v):
    if isinstance(v, PeerInfo):
        return {"peer": {"engine_id": v.engine_id, "rank": v.rank, "fingerprint": v.fingerprint.to_json(),
                         "transport": {k: {"b": x.hex()} for k, x in v.transport.items()},
                         "protocol_version": v.protocol_version}}
    if isinstance(v, DirectoryEntry):
        return [v.holder, v.num_blocks, v.address]
    raise TypeError(type(v))

print("ready", flush=True)
for line in sys.stdin:
    cmd = json.loads(line, object_hook=decode)
    tls = None if cmd["tls"] is None else ClientTLS(**cmd["tls"])
    try:
        with MetadataClient(cmd["address"], token=cmd["token"], tls=tls, timeout=cmd["timeout"],
                            retries=cmd["retries"]) as client:
            out = {"ok": getattr(client, cmd["method"])(*cmd["args"], **cmd["kwargs"])}
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out, default=encode), flush=True)
"""


def _encode(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"b": v.hex()}
    if isinstance(v, PeerInfo):
        return {"peer": {"engine_id": v.engine_id, "rank": v.rank, "fingerprint": v.fingerprint.to_json(),
                         "transport": {k: {"b": x.hex()} for k, x in v.transport.items()},
                         "protocol_version": v.protocol_version}}
    raise TypeError(type(v))


def _decode(d: dict[str, Any]) -> Any:
    if set(d) == {"b"}:
        return bytes.fromhex(d["b"])
    if set(d) == {"peer"}:
        p = d["peer"]
        return PeerInfo(p["engine_id"], p["rank"], LayoutFingerprint.from_json(p["fingerprint"]), p["transport"],
                        p["protocol_version"])
    return d


class Peer:
    """A client in another process: ``peer.call(address, "lookup", hashes)`` returns or raises like MetadataClient."""

    def __init__(self, proc: subprocess.Popen[str]):
        self.proc = proc
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        assert self._next(120) == "ready"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def _next(self, timeout: float) -> str:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"peer process silent for {timeout} s") from None

    def call(self, target: str, method: str, /, *args: Any, token: str | None = None, tls: dict[str, Any] | None = None,
             timeout: float = 5.0, retries: int = 0, **kwargs: Any) -> Any:
        cmd = {"address": target, "method": method, "args": list(args), "kwargs": kwargs, "token": token,
               "tls": tls, "timeout": timeout, "retries": retries}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd, default=_encode) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self._next(60), object_hook=_decode)
        if "error" in out:
            raise getattr(errors, out["error"], RuntimeError)(out["message"])
        return out["ok"]


def spawn(*args: str, **env_vars: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_vars}
    return subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def server_cmd(*extra: str) -> tuple[str, ...]:
    return ("-m", "kvbridge.cli", "metadata-server", "--listen", "127.0.0.1:0", "--max-hashes", str(MAX_HASHES),
            "--max-message-bytes", str(MAX_MESSAGE), "--grace", "2", *extra)


def listening(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()  # the contract: the first stdout line names the address
    assert line.startswith("listening on 127.0.0.1:"), line
    return line.removeprefix("listening on ")



def hashes_of(*names: str) -> list[bytes]:
    return [n.encode() for n in names]
