"""Baselines: the raw medium moving the same bytes, measured in the same run as the backend.

A baseline is ``fn(nbytes, op, env, reps) -> Timing``: ``op`` is the backend's operation (``save``,
``load``, ``transfer``), ``env`` what the case learned about the backend's medium (``dir``,
``fsync``). It raises :class:`Unavailable` when it cannot run here. Add one by adding an entry to
:data:`BASELINES`.

One that runs in the bench's own process is better written as a *stepped* baseline,
``cm(nbytes, op, env)``: a context manager whose value is a :class:`~kvbridge.bench.core.Case` (its
buffers and files live as long as the context). Entered in :data:`STEPPED`, it is timed round by
round with the backend's own case (:func:`~kvbridge.bench.core.time_interleaved`), so a minute in
which the machine runs slow slows both; :func:`timed` makes its ``BASELINES`` entry.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from kvbridge.bench.core import Case, Timing, time_reps
from kvbridge.bench.pool import fill_random

Baseline = Callable[[int, str, Mapping[str, Any], int], Timing]
Stepped = Callable[[int, str, Mapping[str, Any]], contextlib.AbstractContextManager[Case]]


class Unavailable(Exception):
    """A baseline or a case cannot run here; the message says why."""


def _bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor (no copy)."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


def _each_run(run: Callable[[], object]) -> Case:
    """A case with nothing to set up: ``run()`` timed each time (cold, as every transfer)."""
    return Case(lambda i: None, lambda _: run())


@contextlib.contextmanager
def memcpy(nbytes: int, op: str, env: Mapping[str, Any]) -> Iterator[Case]:
    """``torch`` ``copy_`` of one contiguous buffer of ``nbytes`` into another."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    fill_random(src)
    dst = torch.empty_like(src)
    yield _each_run(lambda: dst.copy_(src))


@contextlib.contextmanager
def memcpy_stream(nbytes: int, op: str, env: Mapping[str, Any]) -> Iterator[Case]:
    """The same bytes copied as fast as this process copies memory: kvbridge's native copy with
    streaming stores, cut between its two threads (1 MiB descriptors, contiguous). torch's ``copy_``
    (``memcpy``) uses plain stores, which first read every destination line that is not cached."""
    from kvbridge import native

    mod, why = native.load_core()
    if mod is None:
        raise Unavailable(f"kvbridge._core: {why}")
    src = torch.empty(nbytes, dtype=torch.uint8)
    fill_random(src)
    dst = torch.empty_like(src)
    piece = min(nbytes, 1 << 20)
    offsets = torch.arange(0, nbytes - piece + 1, piece, dtype=torch.int64).numpy().astype("uint64")
    remote, local = offsets + src.data_ptr(), offsets + dst.data_ptr()
    yield _each_run(lambda: mod.copy_start(remote, local, piece, streaming=True).result())


@contextlib.contextmanager
def pcie(nbytes: int, op: str, env: Mapping[str, Any]) -> Iterator[Case]:
    """For a KV cache on a GPU (``env["device"]``): one ``copy_`` of ``nbytes`` between pinned host memory and
    the device, as a store's staging moves them (``save``: device to host; ``load``: host to device;
    ``transfer``: device to device), timed to the end of the copy (``torch.cuda.synchronize``)."""
    device = torch.device(env.get("device", "cuda"))
    if device.type != "cuda" or not torch.cuda.is_available():
        raise Unavailable(f"pcie measures a CUDA device; the KV cache here is on {device}")
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    fill_random(gpu)
    other = torch.empty_like(gpu) if op == "transfer" else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src, dst = (other, gpu) if op == "load" else (gpu, other)

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    yield _each_run(copy)


@contextlib.contextmanager
def file(nbytes: int, op: str, env: Mapping[str, Any]) -> Iterator[Case]:
    """One sequential ``write`` (``save``; plus ``os.fsync`` when the backend fsyncs) or ``readinto``
    (``load``) of ``nbytes`` in the backend's own directory.

    Each write makes new files, as a store's save makes new objects, of at most ``env["object_bytes"]``
    each (the store's object size, where it has one), the first 4 KiB of each written last; the files
    stay until the end, as a store's objects do. Before each write, as before each save of a store
    (:func:`kvbridge.bench.cases.save_case`), ``os.sync()`` (untimed). New files, as fs writes its objects
    (header last): rewriting one file is slower than writing new ones (ext4 flushes a file truncated and
    written again when it is closed, ``auto_da_alloc``). A machine's write speed can drift for tens of
    seconds at a time, which is why this baseline takes turns with the store's own saves.

    A load reads one file written once, over and over, as a store's load case reads one saved prompt;
    with ``env["fresh"]`` (the case loads a prompt saved just before, as a chain's consumer does) it
    reads, file after file, the files one such write made just before (untimed)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    fill_random(buf)
    view = _bytes(buf)
    fsync = bool(env.get("fsync", False))
    folder = tempfile.mkdtemp(prefix=".kvbridge-bench-", dir=env.get("dir"))
    path = os.path.join(folder, "read")

    piece = int(env.get("object_bytes") or nbytes)

    def write(target: str) -> None:
        for n, at in enumerate(range(0, nbytes, piece)):
            part = view[at : min(nbytes, at + piece)]
            fd = os.open(f"{target}.{n}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                head = min(4096, len(part))
                if len(part) > head:
                    os.pwrite(fd, part[head:], head)  # one call: a file's pages, less its first
                os.pwrite(fd, part[:head], 0)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def read(_: object) -> None:
        with open(path, "rb", buffering=0) as f:
            f.readinto(view)

    def written(i: int) -> str:
        write(target := os.path.join(folder, f"r{i}"))
        return target

    def read_files(target: str) -> None:
        for n, at in enumerate(range(0, nbytes, piece)):
            with open(f"{target}.{n}", "rb", buffering=0) as f:
                f.readinto(view[at : min(nbytes, at + piece)])

    def fresh(i: int) -> str:
        os.sync()
        return os.path.join(folder, f"w{i}")

    try:
        if op == "save":
            yield Case(fresh, write)
        elif env.get("fresh"):
            yield Case(written, read_files)
        else:
            with open(path, "wb") as f:
                f.write(view)
            yield Case(lambda i: None, read)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def timed(stepped: Stepped) -> Baseline:
    """The plain baseline of a stepped one: its case timed alone, ``reps`` times."""

    def baseline(nbytes: int, op: str, env: Mapping[str, Any], reps: int) -> Timing:
        with stepped(nbytes, op, env) as case:
            return case.time(reps)

    baseline.__doc__ = stepped.__doc__
    return baseline


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def tcp(nbytes: int, op: str, env: Mapping[str, Any], reps: int) -> Timing:
    """A plain TCP socket on loopback: a sender thread ``sendall``s ``nbytes`` per 1-byte request."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    fill_random(src)
    dst = torch.empty_like(src)
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=60)
    server, _ = listener.accept()
    listener.close()
    for s in (client, server):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(60)

    def serve() -> None:
        ask = bytearray(1)
        try:
            while server.recv_into(ask) == 1:
                server.sendall(_bytes(src))
        except OSError:
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    view = _bytes(dst)

    def pull(_: object) -> None:
        client.sendall(b"g")
        _recv_exact(client, view)

    try:
        return time_reps(pull, reps)
    finally:
        client.close()
        thread.join(10)
        server.close()


_UCXX_SCRIPT = r"""
import asyncio, json, sys, time
import numpy as np
import ucxx
from kvbridge.bench.cold import evict
n, reps = int(sys.argv[1]), int(sys.argv[2])
async def main():
    ucxx.init(progress_mode="thread")
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.empty(n, dtype=np.uint8)
    async def handler(ep):
        ask = np.empty(1, dtype=np.uint8)
        for _ in range(reps + 1):
            await ep.recv(ask, tag=1)
            await ep.send(src, tag=2)
        await ep.close()
    lf = ucxx.create_listener(handler, port=0)
    ep = await ucxx.create_endpoint("127.0.0.1", lf.port)
    times = []
    for i in range(reps + 1):
        evict()
        t0 = time.perf_counter()
        await ep.send(np.zeros(1, dtype=np.uint8), tag=1)
        await ep.recv(dst, tag=2)
        times.append(time.perf_counter() - t0)
    assert (dst == src).all()
    print(json.dumps(times[1:]), flush=True)
    await ep.close()
    lf.close()
asyncio.run(main())
"""


def ucxx_raw(nbytes: int, op: str, env: Mapping[str, Any], reps: int) -> Timing:
    """One ``ucxx`` tag send/recv of a single ``nbytes`` buffer (listener and endpoint in a fresh process,
    so the benchmark's own UCX context is untouched)."""
    try:
        import ucxx  # noqa: F401
    except ImportError as exc:
        raise Unavailable(f"ucxx not installed ({exc}); pip install 'kvbridge[ucx]'") from exc
    # ucxx as its users run it, by default: not the Python-future mode kvbridge's runtime sets for itself
    # (inherited, it made this script hang at exit until the timeout, 120 s per size)
    environ = {k: v for k, v in os.environ.items() if k != "UCXPY_ENABLE_PYTHON_FUTURE"}
    environ["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    try:
        out = subprocess.run(
            [sys.executable, "-c", _UCXX_SCRIPT, str(nbytes), str(reps)],
            capture_output=True,
            text=True,
            timeout=120,
            env=environ,
            check=True,
        )
        return Timing(tuple(json.loads(out.stdout.strip().splitlines()[-1])))
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        raise Unavailable(f"ucxx transfer failed: {exc} {detail.strip()[-200:]}") from exc


# the baselines that run in this process, timed round by round with the backend's case
STEPPED: dict[str, Stepped] = {"memcpy": memcpy, "memcpy:nt": memcpy_stream, "file": file, "pcie": pcie}
BASELINES: dict[str, Baseline] = {name: timed(fn) for name, fn in STEPPED.items()} | {"tcp": tcp, "ucxx": ucxx_raw}
# a KV cache on a GPU: host-memory baselines become the copy between pinned host memory and the device
ON_DEVICE = {"memcpy": "pcie", "memcpy:nt": "pcie"}

__all__ = ["BASELINES", "ON_DEVICE", "STEPPED", "Baseline", "Stepped", "Unavailable", "file", "memcpy", "memcpy_stream", "pcie",
           "tcp", "timed", "ucxx_raw"]
