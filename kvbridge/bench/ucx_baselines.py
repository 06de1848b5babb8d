"""The ``ucx`` backend between two processes, beside raw ucxx and a plain TCP socket moving the same bytes.

    python -m kvbridge.bench.ucx_baselines [--tokens 2048] [--reps 5]

:func:`measure` runs, in one go and with the same byte count:

- ``kvbridge ucx`` (:func:`two_processes`, also what ``kvbridge bench`` times for ``ucx``): a producer
  engine in a child process holds the requests of a bench point (here ``tokens`` tokens of Llama-3-8B KV,
  32 layers x 8 KV heads x 128, bf16, 128 KiB/token, in *scattered* blocks); this process's consumer
  engine pulls them (timed: ``start_step`` until the last is reported), bytes checked once by sha256;
- ``raw ucxx``: one tag send of a single contiguous buffer of those bytes from a child process, over a
  worker-address endpoint with error handling off — the same UCX set-up (and ``UCX_TLS``) the backend
  uses, received through the backend's own runtime in this process;
- ``tcp``: a child process ``sendall``\\ s the bytes over a loopback socket per 1-byte request.

:func:`ucxx_worker_address` is the raw-ucxx figure as a :mod:`kvbridge.bench.baselines` baseline
(registered as ``"ucxx-wa"``; ``kvbridge.bench.cases`` lists it for ``ucx``). Nothing imports ucxx
until a measurement runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import torch

from kvbridge.bench.baselines import BASELINES, Unavailable
from kvbridge.bench.cold import evict
from kvbridge.bench.core import SHAPES, Point, Timing
from kvbridge.bench.pool import request_blocks

BLOCK_BYTES = 32 * 8 * 16 * 2 * 128 * 2  # one block of every layer: 2 MiB
PUMP_S = 0.1  # the producer child's idle engine pumps this often (see _producer)


def _child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvbridge.bench.ucx_baselines", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"})


def _line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise Unavailable(f"benchmark child exited (rc {proc.wait()})")
    return dict(json.loads(line))


def _say(proc: subprocess.Popen[str], **msg: Any) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(msg) + "\n")
    proc.stdin.flush()


def _stop(proc: subprocess.Popen[str]) -> None:
    try:
        _say(proc, op="quit")
        proc.wait(20)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


# ---- kvbridge: producer child, consumer here ---------------------------------------------------------
def _point_json(point: Point) -> str:
    return json.dumps({"shape": point.shape.name, "tokens": point.tokens, "block_size": point.block_size,
                       "ids": point.ids, "requests": point.requests})


def pool_blocks(point: Point) -> int:
    """The blocks of each engine's KV in the two-process case: room for the point's requests and a few more,
    so a scattered request's blocks are a permutation of nearly the whole cache (rawtcp's ``/scat`` rows lay
    their bytes out the same way)."""
    return point.requests * (point.blocks_per_request + 1) + 8


def _engine(point: Point, role: Literal["producer", "consumer"], seed: int, registry: str, progress_mode: str,
            lane: str = "auto") -> Any:
    """A MiniEngine of ``point``'s geometry (vLLM's layout: K and V planes per layer) with room for its requests."""
    from kvbridge.connectors.ucx import UcxBackend, UcxOptions
    from kvbridge.testing import MiniEngine

    shape = point.shape
    options = UcxOptions(registry_dir=registry, progress_mode=progress_mode, lane=lane)  # type: ignore[arg-type]
    return MiniEngine(UcxBackend(options), engine_id=f"bench-{role}", role=role, seed=seed,
                      num_blocks=pool_blocks(point), num_layers=shape.num_layers,
                      num_kv_heads=shape.num_kv_heads, head_size=shape.head_size, block_size=point.block_size,
                      dtype=shape.dtype)  # fmt: skip


def _producer(registry: str, point_json: str, progress_mode: str) -> None:
    from kvbridge.contract import RequestInfo

    point = Point(**{**json.loads(point_json), "shape": SHAPES[json.loads(point_json)["shape"]]})
    engine = _engine(point, "producer", 1, registry, progress_mode)
    for t in engine.kv.values():
        t.view(torch.int16).random_()  # random bits: nothing compresses, nothing is all-zero
    torch.set_num_threads(1)  # no OpenMP worker left spinning on the cores the pulls run on
    runs = request_blocks(point, engine.layout.num_blocks, 1)
    full = point.blocks_per_request
    digest = hashlib.sha256(b"".join(engine.read(ids[:full]).numpy().tobytes() for ids in runs)).hexdigest()
    print(json.dumps({"sha256": digest}), flush=True)
    tokens = tuple(range(full * point.block_size + 1))
    while True:
        # between commands the engine pumps ten times a second (takes releases, frees held requests): often
        # enough to free them before the next offer, rarely enough that few land on a timed pull's
        # cores (an engine steps when it has work; the raw rows' senders only wait)
        if not select.select([sys.stdin], [], [], PUMP_S)[0]:
            engine.pump()
            continue
        cmd = json.loads(sys.stdin.readline() or '{"op": "quit"}')
        if cmd["op"] == "quit":
            break
        params = [engine.scheduler.on_finished(RequestInfo(f"{cmd['rid']}-{i}", tokens, ()), ids).transfer_params
                  for i, ids in enumerate(runs)]  # fmt: skip
        engine.pump()  # the engine steps after its requests end: its worker learns (and seals) the holds
        print(json.dumps({"params": params}), flush=True)
    engine.close()


def two_processes(point: Point, reps: int, progress_mode: str = "thread") -> Timing:
    """The ``ucx`` backend as deployed: a producer engine in a child process holds ``point``'s requests
    (random bits in vLLM's KV layout), this process's consumer engine pulls them, all in one step (timed:
    ``start_step`` to the ``poll`` that reports the last); the first pull (a warm-up, with the handshake)
    is checked against the producer's sha256."""
    with tempfile.TemporaryDirectory(prefix="kvbridge-ucx-bench-") as registry:
        proc = _child("producer", registry, _point_json(point), progress_mode)
        try:
            digest = _line(proc)["sha256"]

            def offer(rid: str) -> list[Any]:
                _say(proc, op="offer", rid=rid)
                return list(_line(proc)["params"])

            return consume(point, reps, offer, digest, progress_mode)
        finally:
            _stop(proc)


PARTS = ("start", "read", "report")


def consume(point: Point, reps: int, offer: Callable[[str], list[Any]], digest: str, progress_mode: str = "thread",
            lane: str = "auto", parts: dict[str, list[float]] | None = None) -> Timing:
    """The consumer's half of :func:`two_processes`: ``offer(rid)`` has the producer hand off its requests
    again (their transfer params); a warm-up and ``reps`` timed pulls, each into a cleared KV and checked
    against ``digest``; ``lane``: the consumer's (the producer offers every lane it can). ``parts``: each
    timed pull's seconds appended under :data:`PARTS`: ``start`` (``start_step``, which starts the read
    natively where it can), ``read`` (until the engine's idle wait returns for the last time) and
    ``report`` (the polls after it): what an engine adds to the medium's own time."""
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="kvbridge-ucx-bench-c-") as registry:
        consumer = _engine(point, "consumer", 2, registry, progress_mode, lane)
        torch.set_num_threads(1)  # checking the bytes must leave no OpenMP worker spinning beside the next pull
        try:
            runs = request_blocks(point, consumer.layout.num_blocks, 2)
            full, tokens = point.blocks_per_request, list(range(point.blocks_per_request * point.block_size + 1))
            samples = []
            for i in range(reps + 1):
                reqs = [consumer.request(f"c{i}-{k}", tokens, p) for k, p in enumerate(offer(f"r{i}"))]
                for req, ids in zip(reqs, runs):
                    consumer.scheduler.on_allocated(req, ids, consumer.scheduler.lookup(req, 0).num_tokens)
                plan = consumer.scheduler.plan_step([])
                waiting, failed = {r.request_id for r in reqs}, set()
                for t in consumer.kv.values():
                    t.zero_()  # the last pull's bytes gone: a block this one does not write fails the check
                evict()
                t0 = time.perf_counter()
                consumer.worker.start_step(plan)
                t1 = time.perf_counter()
                consumer.worker.finish_step()
                while waiting:
                    consumer.worker.wait_idle(1.0)  # blocks, as an engine's idle step does: no polling thread beside the read
                    t2 = time.perf_counter()
                    report = consumer.worker.poll()
                    failed |= report.failed_blocks
                    waiting -= report.finished_loading
                    consumer.scheduler.on_report(report)
                t3 = time.perf_counter()
                dt = t3 - t0
                if failed:
                    raise Unavailable(f"{len(failed)} blocks failed to load")
                got = b"".join(consumer.read(ids[:full]).numpy().tobytes() for ids in runs)
                if hashlib.sha256(got).hexdigest() != digest:
                    raise Unavailable(f"pull {i}: the bytes differ from the producer's")
                for req, ids in zip(reqs, runs):
                    consumer.scheduler.on_finished(req, ids)
                if i:
                    samples.append(dt)
                    if parts is not None:
                        for name, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2)):
                            parts.setdefault(name, []).append(seconds)
            return Timing(tuple(samples))
        finally:
            torch.set_num_threads(threads)
            consumer.close()


# ---- raw ucxx: sender child, receiver through the backend's runtime here -------------------------------
def _ucxx_sender(nbytes: int, progress_mode: str) -> None:
    from kvbridge.connectors.ucx import runtime as rtmod

    rt = rtmod.runtime(progress_mode)
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    print(json.dumps({"address": rt.worker_address.hex()}), flush=True)
    peer = bytes.fromhex(json.loads(sys.stdin.readline())["address"])
    ep = rt.call(rt.connect(peer), 30)
    go = np.zeros(8, dtype=np.uint8)
    while True:
        rt.call(rt.recv_any(go, 0x51), 600)
        if go[0]:
            break
        rt.call(ep.send(src, tag=0x52, force_tag=True), 120)


def ucxx_worker_address(nbytes: int, op: str = "transfer", env: Mapping[str, Any] | None = None, reps: int = 5,
                        progress_mode: str = "thread") -> Timing:
    """One ucxx tag message of ``nbytes`` from a child process: worker-address endpoint, error handling off,
    the backend's ``UCX_TLS`` — what the ``ucx`` backend's chunks ride on, as one buffer."""
    try:
        from kvbridge.connectors.ucx import runtime as rtmod
    except ImportError as exc:
        raise Unavailable(f"{exc}") from exc
    import asyncio

    rt = rtmod.runtime(progress_mode)  # the running one if this process has one (its mode then)
    proc = _child("ucxx-sender", str(nbytes), rt.progress_mode)
    try:
        ep = None
        peer = bytes.fromhex(_line(proc)["address"])
        _say(proc, address=rt.worker_address.hex())
        ep = rt.call(rt.connect(peer), 30)
        dst = np.empty(nbytes, dtype=np.uint8)

        async def pull() -> None:
            recv = asyncio.ensure_future(ep.recv(dst, tag=0x52, force_tag=True))
            await ep.send(np.zeros(8, dtype=np.uint8), tag=0x51, force_tag=True)
            await recv

        samples = []
        for i in range(reps + 1):
            evict()
            t0 = time.perf_counter()
            rt.call(pull(), 120)
            if i:
                samples.append(time.perf_counter() - t0)
        rt.call(ep.send(np.ones(8, dtype=np.uint8), tag=0x51, force_tag=True), 10)
        expected = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        if not np.array_equal(dst, expected):
            raise Unavailable("raw ucxx bytes differ")
        return Timing(tuple(samples))
    finally:
        if ep is not None:
            rt.close_endpoint(ep)
        proc.wait(20)


# ---- plain TCP between two processes -----------------------------------------------------------------
def _tcp_sender(port: int, nbytes: int) -> None:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ask = bytearray(1)
        while s.recv_into(ask) == 1 and ask[0] == ord("g"):
            s.sendall(src.data)


def tcp_processes(nbytes: int, reps: int) -> Timing:
    """``nbytes`` over a loopback TCP socket from a child process, per 1-byte request."""
    listener = socket.create_server(("127.0.0.1", 0))
    proc = _child("tcp-sender", str(listener.getsockname()[1]), str(nbytes))
    conn, _ = listener.accept()
    listener.close()
    dst = np.empty(nbytes, dtype=np.uint8)
    view = dst.data
    samples = []
    try:
        for i in range(reps + 1):
            t0 = time.perf_counter()
            conn.sendall(b"g")
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got:])
                if not n:
                    raise Unavailable("tcp sender went away")
                got += n
            if i:
                samples.append(time.perf_counter() - t0)
        conn.sendall(b"q")
    finally:
        conn.close()
        proc.wait(20)
    return Timing(tuple(samples))


def measure(tokens: int = 2048, reps: int = 5, progress_mode: str = "thread") -> list[dict[str, Any]]:
    """The three figures for one request of ``tokens`` tokens of Llama-3-8B KV; one row each.

    ``progress_mode`` is the kvbridge engines' (both in their own processes; the raw ucxx receiver uses
    this process's runtime, started by the kvbridge consumer with the same mode)."""
    blocks = tokens // 16
    nbytes = blocks * BLOCK_BYTES
    rows = []
    for path, run in (
        (f"kvbridge ucx (scattered, {progress_mode})", lambda: two_processes(Point(SHAPES["8b"], tokens), reps, progress_mode)),
        ("raw ucxx (one buffer)", lambda: ucxx_worker_address(nbytes, reps=reps, progress_mode=progress_mode)),
        ("tcp socket (one buffer)", lambda: tcp_processes(nbytes, reps)),
    ):
        try:
            t = run()
            rows.append({"path": path, "bytes": nbytes, "median_s": t.median, "gbps": nbytes / t.median / 1e9,
                         "best_gbps": nbytes / min(t.samples) / 1e9})
        except Exception as exc:  # noqa: BLE001 - a path that cannot run here is a row that says why
            rows.append({"path": path, "bytes": nbytes, "median_s": None, "gbps": None, "best_gbps": None, "note": str(exc)})
    return rows


def _ucxx_wa(nbytes: int, op: str, env: Mapping[str, Any], reps: int) -> Timing:
    return ucxx_worker_address(nbytes, op, env, reps)


BASELINES.setdefault("ucxx-wa", _ucxx_wa)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "producer":
        return _producer(argv[1], argv[2], argv[3])
    if argv and argv[0] == "ucxx-sender":
        return _ucxx_sender(int(argv[1]), argv[2])
    if argv and argv[0] == "tcp-sender":
        return _tcp_sender(int(argv[1]), int(argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--progress-mode", default="thread", choices=["thread", "blocking", "thread-polling", "polling"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = measure(args.tokens, args.reps, args.progress_mode)
    if args.json:
        print(json.dumps(rows))
        return
    tls = os.environ.get("UCX_TLS", "")
    print(f"Llama-3-8B KV, {args.tokens} tokens ({rows[0]['bytes'] / 2**20:.0f} MiB), {args.reps} reps, UCX_TLS={tls}")
    print(f"{'path':34} {'median ms':>10} {'GB/s':>7} {'best GB/s':>10}")
    for r in rows:
        if r["median_s"] is None:
            print(f"{r['path']:34} not measured: {r.get('note')}")
        else:
            print(f"{r['path']:34} {r['median_s'] * 1e3:10.1f} {r['gbps']:7.2f} {r['best_gbps']:10.2f}")


if __name__ == "__main__":
    main()


__all__ = ["consume", "measure", "tcp_processes", "two_processes", "ucxx_worker_address"]
