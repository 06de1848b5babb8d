"""``fs`` — a shared-filesystem store: one file per (namespace, rank, block key) under a directory.

The directory (local disk, NFS, Lustre, tmpfs) may be shared by any number of producer and consumer
processes on any number of machines. Objects live at::

    <path>/<sha256(namespace)[:16]>/<rank>/<name[:2]>/<name>     name = key.hex() (or a hash, see below)

so a key, whatever its bytes, names a file of hex digits under the root and can never escape it.

**Object format**: :data:`kvbridge.codec.FS` (version 1) — a :data:`HEADER_BYTES` header, then the
block's bytes in every layer, layer after layer (``num_layers * block_bytes``). The header holds
:data:`MAGIC`, the format version, the checksum kind, the full key, the layout fingerprint
(canonical JSON), the payload length and the payload's checksum (:mod:`kvbridge.codec` has the
byte layout). A reader checks all of them — and that the file has exactly the promised length —
before a single byte reaches the KV cache; an object that fails is a failed block (counted in
``stats.corrupt`` and logged), and a damaged one is deleted so the next producer rewrites it.
Objects of another version or layout are left alone (another engine may own them).

**Concurrency.** A writer writes a private temporary file in the object's directory and
``os.replace``\\ s it into place, which is atomic on POSIX filesystems (NFS and Lustre included), so a
reader sees the old object, the new one or none — never half of one. Readers that opened an object
keep reading it even if it is replaced or evicted meanwhile.

**Durability.** With ``fsync=False`` (the default) an object survives its writer's process dying,
not the machine losing power (the page cache may still hold it); a half-written object is never
visible either way. ``fsync=True`` flushes each object and its directory before the save returns:
slower (measured 3-5x on local disk), needed only where the cache must outlive a machine crash.

**Capacity.** With ``capacity_bytes`` set, a save that would push the directory past it first
deletes the oldest objects (by mtime: first saved, first evicted; a save that finds its key already
present refreshes that mtime) down to 90% of the capacity, so scans stay rare. Usage is an estimate
per process, refreshed by a scan whenever it crosses the capacity: several writers may overshoot it
by what they wrote between scans. A full filesystem (``ENOSPC``) fails that save with
:class:`~kvbridge.errors.StoreFull`; nothing already stored is lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Literal

from kvbridge import codec
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import Corrupted, StoreFull
from kvbridge.layout import KVLayout
from kvbridge.options import require
from kvbridge.staging import StagingPool
from kvbridge.store import StoreBackend, StoreIndex, StoreIO

log = logging.getLogger(__name__)

FORMAT = codec.FS
MAGIC = FORMAT.magic
VERSION = codec.VERSION
HEADER_BYTES = FORMAT.header_bytes
_FIXED = FORMAT.fixed  # the header's fixed fields (tests forge objects with it)
_MAX_HEX_KEY = 64  # longer keys are hashed into the file name (NAME_MAX is 255); the header keeps the key
_IOV_MAX = 512  # stay well under the kernel's IOV_MAX (1024) per readv/writev
_LOW_WATER = 0.9  # evict down to this fraction of capacity_bytes
_STALE_TMP_S = 3600.0  # temp files this old belong to a writer that died; eviction scans remove them


@dataclasses.dataclass(frozen=True)
class FsOptions:
    """``path``: the shared directory (created if missing). ``capacity_bytes``: 0 = unbounded, else
    evict oldest objects to stay under it. ``fsync``: flush every object before the save returns.
    ``checksum``: ``crc32`` (zlib, always there, ~3.7 GB/s here) or ``crc32c`` (hardware, ~22 GB/s,
    needs ``pip install google-crc32c``, in ``kvbridge[fs]``; the default where it is installed);
    readers verify whichever kind an object names."""

    path: str
    capacity_bytes: int = 0
    fsync: bool = False
    checksum: Literal["crc32", "crc32c"] = dataclasses.field(default_factory=codec.default_checksum)

    def __post_init__(self) -> None:
        require(bool(self.path), "fs option 'path' must name a directory")
        require(self.capacity_bytes >= 0, f"fs option 'capacity_bytes' must be >= 0, got {self.capacity_bytes}")


def object_name(key: bytes) -> str:
    """The file name of ``key``: its hex digits, or ``h`` + a blake2b hex digest for empty or long keys."""
    if 0 < len(key) <= _MAX_HEX_KEY // 2:
        return key.hex()
    return "h" + hashlib.blake2b(key, digest_size=32).hexdigest()


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` less their first ``n`` bytes (after a short readv/writev)."""
    while bufs and n >= len(bufs[0]):
        n -= len(bufs[0])
        bufs = bufs[1:]
    if bufs and n:
        bufs = [bufs[0][n:], *bufs[1:]]
    return bufs


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    while bufs:
        bufs = _advance(bufs, os.writev(fd, bufs[:_IOV_MAX]))


def _read_all(fd: int, bufs: list[memoryview]) -> int:
    """Fill ``bufs`` from offset 0 until they are full or the file ends; the bytes read."""
    total = 0
    while bufs:
        n = os.preadv(fd, bufs[:_IOV_MAX], total)
        if n == 0:
            break
        total += n
        bufs = _advance(bufs, n)
    return total


class _Tree:
    """Where one engine's objects live under the shared root: its namespace and rank."""

    def __init__(self, engine: EngineInfo, options: FsOptions):
        self.options = options
        self.root = os.path.abspath(options.path)
        ns = hashlib.sha256(engine.namespace.encode()).hexdigest()[:16]
        self.dir = os.path.join(self.root, ns, str(engine.rank))

    def path_of(self, key: bytes) -> str:
        name = object_name(key)
        return os.path.join(self.dir, name[:2], name)


class FsIndex(_Tree, StoreIndex):
    """Scheduler side: one stat per key, stopping at the first miss."""

    def __init__(self, engine: EngineInfo, options: FsOptions):
        StoreIndex.__init__(self, engine)
        _Tree.__init__(self, engine, options)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            try:
                os.stat(self.path_of(key))
            except OSError:  # missing, or the directory itself is gone: a miss either way
                break
            n += 1
        return n


class FsStore(_Tree, StoreIO):
    """Worker side: one engine's objects in the shared directory. See the module docstring."""

    def __init__(self, engine: EngineInfo, options: FsOptions):
        StoreIO.__init__(self, engine)
        _Tree.__init__(self, engine, options)
        self._kind = codec.CHECKSUMS[options.checksum]
        self._staging = StagingPool()  # host buffers the files are read into, written from
        self._made: set[str] = set()  # subdirectories known to exist (re-made if someone removes them)
        self._usage: int | None = None  # estimate of bytes under root, when capacity_bytes is set

    # -- worker side -------------------------------------------------------------------------------
    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        fds: list[tuple[str, int]] = []
        try:
            for key in op.keys:  # a prefix: the engine recomputes from the first block that is missing
                path = self.path_of(key)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    break
                fds.append((path, fd))
                # start the kernel's read-ahead of every object now, so cold reads overlap
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            with self._staging.lend(layout, len(fds)) as staging:
                arr = staging.numpy()  # numpy views are what readv fills (a tensor exports no buffer)
                tail = memoryview(bytearray(1))  # must stay empty: catches objects longer than promised
                header = memoryview(bytearray(HEADER_BYTES))
                good = 0
                for i, (path, fd) in enumerate(fds):
                    parts = [memoryview(arr[layer, i]) for layer in range(layout.num_layers)]
                    got = _read_all(fd, [header, *parts, tail])
                    try:
                        FORMAT.check(header, key=op.keys[i], fingerprint=layout.fingerprint, parts=parts, size=got)
                    except Corrupted as bad:
                        self._reject(path, fd, bad)
                        break
                    good += 1
                if good:  # one vectorized scatter of the blocks that passed validation, and only those
                    layout.scatter(op.block_ids[:good], staging[:, :good].to(layout.device))
            return op.block_ids[good:]
        finally:
            for _, fd in fds:
                os.close(fd)

    def save(self, op: BlockSave, layout: KVLayout) -> None:
        payload = layout.num_layers * layout.block_bytes
        if self.options.capacity_bytes:
            self._make_room(len(op.keys) * (HEADER_BYTES + payload))
        with self._staging.gathered(layout, op.block_ids) as staging:
            arr = staging.numpy()
            for i, key in enumerate(op.keys):
                path = self.path_of(key)
                if self._refresh(path):
                    continue  # already stored (by us or another writer): same key, same KV
                parts = [memoryview(arr[layer, i]) for layer in range(layout.num_layers)]
                header = FORMAT.pack(key, layout.fingerprint, parts, self._kind)
                self._write_object(path, [memoryview(header), *parts])
                if self._usage is not None:
                    self._usage += HEADER_BYTES + payload

    # -- bad objects -------------------------------------------------------------------------------
    def _reject(self, path: str, fd: int, bad: Corrupted) -> None:
        self.stats.add(corrupt=1)
        log.warning("fs store: %s is not loadable (%s)%s", path, bad, "; deleting it" if bad.damaged else "")
        if not bad.damaged:
            return
        try:  # delete only the file we read, not one a writer has just put in its place
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                os.unlink(path)
        except OSError:
            pass

    # -- files -------------------------------------------------------------------------------------
    def _write_object(self, path: str, bufs: list[memoryview]) -> None:
        folder = os.path.dirname(path)
        if folder not in self._made:
            os.makedirs(folder, exist_ok=True)
            self._made.add(folder)
        # a private name in the same directory: os.replace is atomic only within one filesystem
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # the directory was removed under us: make it again, once
                os.makedirs(folder, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, bufs)
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"fs store {self.root}: no space for {path} ({exc.strerror})") from exc
            raise
        if self.options.fsync:  # make the rename itself durable
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _refresh(self, path: str) -> bool:
        """Whether ``path`` exists; under a capacity, also make it young again (it is still wanted)."""
        try:
            if self.options.capacity_bytes:
                os.utime(path)
            else:
                os.stat(path)
        except OSError:
            return False
        return True

    def _make_room(self, need: int) -> None:
        cap = self.options.capacity_bytes
        if need > cap:
            raise StoreFull(f"fs store {self.root}: {need} bytes to save exceed capacity_bytes={cap}")
        if self._usage is not None and self._usage + need <= cap:
            return
        objects = sorted(self._scan())
        total = sum(size for _, size, _ in objects)
        evicted = 0
        if total + need > cap:
            target = int(cap * _LOW_WATER) - need
            for _, size, path in objects:
                if total <= target:
                    break
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    evicted += 1
                total -= size  # gone either way: unlinked by us, or by another process
        if evicted:
            self.stats.add(evictions=evicted)
        self._usage = total

    def _scan(self) -> Iterator[tuple[float, int, str]]:
        """(mtime, size, path) of every object under the root; removes stale temporary files."""
        now = time.time()
        for folder, _, files in os.walk(self.root):
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if name.startswith("."):
                    if name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(path)
                    continue
                yield st.st_mtime, st.st_size, path

    def close(self) -> None:
        self._staging.clear()
        super().close()


class FsBackend(StoreBackend):
    """The ``fs`` store backend: an :class:`FsIndex` for the scheduler, an :class:`FsStore` per worker."""

    name = "fs"
    options_type = FsOptions

    def __init__(self, options: FsOptions):
        codec.require_checksum(options.checksum, "fs")
        super().__init__(options)

    def open_index(self, engine: EngineInfo) -> FsIndex:
        return FsIndex(engine, self.options)

    def open_io(self, engine: EngineInfo) -> FsStore:
        return FsStore(engine, self.options)


BACKEND = FsBackend

__all__ = ["BACKEND", "HEADER_BYTES", "MAGIC", "VERSION", "FsBackend", "FsOptions", "FsIndex", "FsStore", "object_name"]
