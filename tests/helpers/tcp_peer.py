"""Both ends of kvbridge._core's tcp lane as processes, for tests/test_tcplane.py (on loopback or on emulated hosts).

    python tcp_peer.py serve --bytes N [--host H] [--local NAME] [--sigpipe-default]
        With --local, also serves the local medium on the abstract Unix socket NAME; --sigpipe-default
        restores SIGPIPE's default action (Python ignores it), as a host process that does not ignore it.
        Prints one JSON line (port, secret, buffer address and length, seal table address and bytes), then
        answers commands on stdin, one JSON line each:
          {"op": "seal", "slot": i, "word": w}   sets seal word i
          {"op": "sha", "offset": o, "block": b, "order": [...]}  sha256 of the blocks at o + k * b, k in order
          {"op": "stats"}                         (connections, requests, bytes, refused) and its serving threads
    python tcp_peer.py read --host H --port P --secret HEX [--streams S] [--timeout T]
        Keeps one TcpSource; per JSON line on stdin {"address", "block", "order", "seal"} reads those blocks
        into a buffer of its own (block k of order to slot k, so the read is scattered) and prints
        {"bytes", "word", "sha", "exact", "seconds", "local"} or {"error", "errno", "seconds"}; --host @NAME reads
        over the local medium ("local": true); "exact" compares every
        word with the producer's pattern, computed here.

Word i of the producer's buffer is i * PATTERN_K (mod 2**64), as in native_peer.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

PATTERN_K = 0x9E3779B97F4A7C15


def pattern(first_word: int, words: int) -> np.ndarray:
    a = np.arange(first_word, first_word + words, dtype=np.uint64)
    a *= np.uint64(PATTERN_K)
    return a


def _say(msg: dict) -> None:
    print(json.dumps(msg), flush=True)


def serve(args: argparse.Namespace) -> None:
    import kvbridge._core as core

    if args.sigpipe_default:
        import signal

        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    buf = pattern(0, args.bytes // 8)
    seals = np.zeros(64, dtype=np.uint64)
    secret = os.urandom(32)
    server = core.TcpServer(args.host, 0, [(buf.ctypes.data, buf.nbytes)], secret,
                            seals=(seals.ctypes.data, seals.nbytes), timeout_s=args.timeout, sndbuf=args.sndbuf,
                            local=args.local)
    _say({"port": server.port, "secret": secret.hex(), "address": buf.ctypes.data, "length": buf.nbytes,
          "seals": seals.ctypes.data, "pid": os.getpid()})
    raw = buf.view(np.uint8)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "seal":
            seals[cmd["slot"]] = np.uint64(cmd["word"])
            _say({"ok": True})
        elif cmd["op"] == "sha":
            h = hashlib.sha256()
            for k in cmd["order"]:
                at = cmd["offset"] + k * cmd["block"]
                h.update(raw[at : at + cmd["block"]].tobytes())
            _say({"sha": h.hexdigest()})
        elif cmd["op"] == "stats":
            names = []
            for tid in os.listdir(f"/proc/{os.getpid()}/task"):
                try:
                    with open(f"/proc/{os.getpid()}/task/{tid}/comm") as f:
                        names.append(f.read().strip())
                except OSError:
                    pass
            _say({"stats": list(server.stats()), "serving": names.count("kvbridge-serve")})
    server.close(10.0)


def read(args: argparse.Namespace) -> None:
    import kvbridge._core as core

    source = core.TcpSource(args.host, args.port, bytes.fromhex(args.secret), streams=args.streams,
                            timeout_s=args.timeout)
    for line in sys.stdin:
        cmd = json.loads(line)
        order = np.asarray(cmd["order"], dtype=np.uint64)
        block = int(cmd["block"])
        dst = np.zeros(len(order) * block // 8, dtype=np.uint64)
        remote = np.uint64(cmd["address"]) + order * np.uint64(block)
        local = np.uint64(dst.ctypes.data) + np.arange(len(order), dtype=np.uint64) * np.uint64(block)
        t0 = time.monotonic()
        try:
            nbytes, word = source.start(remote, local, block, int(cmd.get("seal", 0))).result()
        except OSError as exc:
            _say({"error": f"{type(exc).__name__}: {exc}", "errno": exc.errno, "seconds": time.monotonic() - t0})
            continue
        seconds = time.monotonic() - t0
        words = block // 8
        first = int(cmd.get("first_word", 0))
        exact = all(np.array_equal(dst[j * words : (j + 1) * words], pattern(first + int(k) * words, words))
                    for j, k in enumerate(order))
        _say({"bytes": nbytes, "word": word, "sha": hashlib.sha256(dst.tobytes()).hexdigest(), "exact": exact,
              "seconds": seconds, "local": source.local})
    source.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["serve", "read"])
    ap.add_argument("--bytes", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--secret", default="")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--sndbuf", type=int, default=0, help="the server's SO_SNDBUF per connection (0: the kernel's)")
    ap.add_argument("--local", default="", help="also serve the local medium on this abstract Unix socket")
    ap.add_argument("--sigpipe-default", action="store_true", help="SIGPIPE kills, as in a host that does not ignore it")
    args = ap.parse_args()
    serve(args) if args.role == "serve" else read(args)


if __name__ == "__main__":
    main()
