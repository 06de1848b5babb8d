"""File IO of an ``fs`` store: whole reads and writes of scattered buffers, page-cache and ``O_DIRECT``
probes, aligned buffers, and the threads (each with its own buffer) that move one load's or save's
blocks."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import mmap
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvbridge import codec
from kvbridge.errors import ConfigError

ALIGN = codec.FS.align  # O_DIRECT's alignment of offsets, lengths and buffers (a page)
IOV_MAX = 512  # stay well under the kernel's IOV_MAX (1024) per readv/writev
ENOSPC = (errno.ENOSPC, errno.EDQUOT)
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux 4.14+: a read that fails rather than wait for the medium

T = TypeVar("T")


def _advance(bufs: list[Any], n: int) -> list[Any]:
    """``bufs`` less their first ``n`` bytes (after a short readv/writev)."""
    while bufs and n >= len(bufs[0]):
        n -= len(bufs[0])
        bufs = bufs[1:]
    if bufs and n:
        bufs = [bufs[0][n:], *bufs[1:]]
    return bufs


def _bytes_of(bufs: Sequence[Any]) -> list[memoryview]:
    return [memoryview(b).cast("B") for b in bufs]


def write_at(fd: int, bufs: Sequence[Any], offset: int) -> None:
    """Write ``bufs`` at ``offset``, all of them (a short write goes on where it stopped)."""
    left = _bytes_of(bufs)
    while left:
        n = os.pwritev(fd, left[:IOV_MAX], offset)
        offset += n
        left = _advance(left, n)


def read_at(fd: int, bufs: Sequence[Any], offset: int) -> int:
    """Fill ``bufs``, in order, from ``offset`` until they are full or the file ends; the bytes read."""
    left = _bytes_of(bufs)
    total = 0
    while left:
        n = os.preadv(fd, left[:IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        left = _advance(left, n)
    return total


def cached(fd: int, at: int) -> bool:
    """Whether the byte at ``at`` of ``fd`` is in the page cache: a one-byte read that may not wait for the
    medium (``RWF_NOWAIT``). ``False`` where the kernel or filesystem cannot say (as if it were not)."""
    if not _NOWAIT:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], at, _NOWAIT) == 1
    except (OSError, ValueError):  # EAGAIN: on the medium; EOPNOTSUPP / no RWF_NOWAIT: cannot tell
        return False


def aligned(nbytes: int) -> np.ndarray:
    """A page-aligned (``O_DIRECT``-ready) byte buffer of at least ``nbytes``, its pages touched once."""
    size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    buf = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    buf[::ALIGN] = 0
    return buf


def probe_o_direct(path: str) -> None:
    """Raise :class:`ConfigError` unless files under ``path`` can be written and read with ``O_DIRECT``."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        raise ConfigError("fs option o_direct: O_DIRECT does not exist on this platform")
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".o_direct.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    buf = aligned(ALIGN)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | flag, 0o644)
        try:
            os.pwrite(fd, buf.data, 0)
            os.preadv(fd, [buf.data], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise ConfigError(
                f"fs option o_direct: the filesystem at {path} does not support O_DIRECT ({exc.strerror}); "
                "leave o_direct off there"
            ) from exc
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


class Threads:
    """Up to ``count`` threads (the calling one included) sharing the blocks of one load or save, each
    with a page-aligned buffer of its own."""

    def __init__(self, count: int):
        self.count = count
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._local = threading.local()

    def buffer(self, nbytes: int) -> np.ndarray:
        """This thread's aligned buffer, at least ``nbytes`` (kept: a block read into it stays in the CPU cache)."""
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.buf = aligned(nbytes)
        return buf

    def map(self, n: int, fn: Callable[[int], T]) -> list[T]:
        """``[fn(0), ..., fn(n-1)]``, each thread taking the next index as it goes."""
        threads = min(self.count, n)
        if threads <= 1:
            return [fn(i) for i in range(n)]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.count - 1, thread_name_prefix="kvbridge-fs")
        out: list[Any] = [None] * n
        ticket = itertools.count()

        def work() -> None:
            while (i := next(ticket)) < n:
                out[i] = fn(i)

        helpers = [self._pool.submit(work) for _ in range(threads - 1)]
        try:
            work()
        finally:  # never return (and close files) while a helper may still use them
            concurrent.futures.wait(helpers)
        for f in helpers:
            f.result()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
