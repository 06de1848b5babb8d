"""Children of the cross-host bench (:mod:`kvbridge.bench.hosts`), each run on an emulated host.

    python -m kvbridge.bench._host_child kvb-consumer POINT_JSON REPS PROGRESS_MODE SHA256 [LANE]
    python -m kvbridge.bench._host_child tcp-send NBYTES STREAMS
    python -m kvbridge.bench._host_child tcp-recv HOST PORT NBYTES STREAMS REPS

Every line for the parent starts with ``@@`` (UCX may write its own lines to stdout).

- ``kvb-consumer``: the consumer half of :func:`kvbridge.bench.ucx_baselines.consume`; each time it needs
  the producer's requests handed off again it prints ``{"offer": rid}`` and reads the params line the
  parent relays from the producer (``ucx_baselines producer``, on the other host). Ends with
  ``{"samples": [...]}``.
- ``tcp-send``: listens on every address, prints ``{"port": p}``, accepts STREAMS connections and, per
  byte ``g`` on a connection, sends that connection's slice of NBYTES of a seeded pattern.
- ``tcp-recv``: connects STREAMS sockets to the sender, and per repetition evicts the CPU caches (untimed,
  as every row does), asks every stream at once and receives each slice in its own thread (timed: the
  first ask to the last byte); the warm-up's bytes are compared with the pattern. Ends with ``{"samples": [...]}``.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from kvbridge.bench.cold import evict

SEED = 7


def _say(msg: dict[str, Any]) -> None:
    print("@@" + json.dumps(msg), flush=True)


def _pattern(nbytes: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 256, nbytes, dtype=np.uint8)


def _slices(nbytes: int, streams: int) -> list[tuple[int, int]]:
    cuts = [nbytes * i // streams for i in range(streams + 1)]
    return list(zip(cuts, cuts[1:]))


def kvb_consumer(point_json: str, reps: int, progress_mode: str, digest: str, lane: str = "auto") -> None:
    from kvbridge.bench.core import SHAPES, Point
    from kvbridge.bench.ucx_baselines import consume

    raw = json.loads(point_json)
    point = Point(**{**raw, "shape": SHAPES[raw["shape"]]})

    def offer(rid: str) -> list[Any]:
        _say({"offer": rid})
        return list(json.loads(sys.stdin.readline())["params"])

    parts: dict[str, list[float]] = {}
    timing = consume(point, reps, offer, digest, progress_mode, lane, parts)
    _say({"samples": list(timing.samples), "parts": parts})


def tcp_send(nbytes: int, streams: int) -> None:
    src = _pattern(nbytes)
    listener = socket.create_server(("0.0.0.0", 0))
    _say({"port": listener.getsockname()[1]})
    conns = [listener.accept()[0] for _ in range(streams)]
    listener.close()

    def serve(conn: socket.socket, lo: int, hi: int) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ask = bytearray(1)
        view = src.data[lo:hi]
        while conn.recv_into(ask) == 1 and ask[0] == ord("g"):
            conn.sendall(view)
        conn.close()

    threads = [threading.Thread(target=serve, args=(c, lo, hi)) for c, (lo, hi) in zip(conns, _slices(nbytes, streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def tcp_recv(host: str, port: int, nbytes: int, streams: int, reps: int) -> None:
    dst = np.zeros(nbytes, dtype=np.uint8)
    conns = [socket.create_connection((host, port), timeout=120) for _ in range(streams)]
    for c in conns:  # the 1-byte asks go out at once, not behind Nagle
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    slices = _slices(nbytes, streams)
    errors: list[str] = []

    def take(conn: socket.socket, lo: int, hi: int) -> None:
        view = dst.data[lo:hi]
        got = 0
        while got < hi - lo:
            n = conn.recv_into(view[got:])
            if not n:
                errors.append("sender went away")
                return
            got += n

    samples = []
    for i in range(reps + 1):
        dst[:] = 0xA5
        evict()  # untimed: every row of the bench starts with the caches cold (kvbridge.bench.cold)
        threads = [threading.Thread(target=take, args=(c, lo, hi)) for c, (lo, hi) in zip(conns, slices)]
        t0 = time.perf_counter()
        for c in conns:
            c.sendall(b"g")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        if errors:
            _say({"error": errors[0]})
            return
        if i == 0 and not np.array_equal(dst, _pattern(nbytes)):
            _say({"error": "received bytes differ from the sender's"})
            return
        if i:
            samples.append(dt)
    for c in conns:
        c.sendall(b"q")
        c.close()
    _say({"samples": samples})


def main() -> None:
    role, args = sys.argv[1], sys.argv[2:]
    try:
        if role == "kvb-consumer":
            kvb_consumer(args[0], int(args[1]), args[2], args[3], *args[4:5])
        elif role == "tcp-send":
            tcp_send(int(args[0]), int(args[1]))
        elif role == "tcp-recv":
            tcp_recv(args[0], int(args[1]), int(args[2]), int(args[3]), int(args[4]))
        else:
            raise SystemExit(f"unknown role {role!r}")
    except Exception as exc:  # noqa: BLE001 - the parent's row says why
        _say({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
