"""``fs`` — a shared-filesystem store: one file per (namespace, rank, block key) under a directory.

The directory (local disk, NFS, Lustre, tmpfs) may be shared by any number of producer and consumer
processes on any number of machines. Objects live at::

    <path>/<sha256(namespace)[:16]>/<rank>/<name[:2]>/<name>     name = key.hex() (or a hash, see below)

so a key, whatever its bytes, names a file of hex digits under the root and can never escape it.

**Object format** (version 1): a fixed :data:`HEADER_BYTES` header, then the block's bytes in every
layer, layer after layer (``num_layers * block_bytes``). The header holds :data:`MAGIC`, the format
version, the checksum kind, the full key, the layout fingerprint (canonical JSON), the payload
length and the payload's checksum. A reader checks all of them — and that the file has exactly the
promised length — before a single byte reaches the KV cache; an object that fails is a failed
block (counted in ``stats.corrupt`` and logged), and a damaged one is deleted so the next producer
rewrites it. Objects of another version or layout are left alone (another engine may own them).

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
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import numpy as np
import torch

from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import MissingDependency, StoreFull
from kvbridge.layout import KVLayout
from kvbridge.options import require
from kvbridge.store import StoreBackend, StoreIndex, StoreIO

log = logging.getLogger(__name__)

MAGIC = b"KVBRFS\r\n"  # \r\n: a text-mode copy that mangles line ends fails the magic check
VERSION = 1
# page-aligned payload (room for O_DIRECT or mmap later); 0.2% of a 2 MiB Llama-3-8B block
HEADER_BYTES = 4096
_FIXED = struct.Struct("<8sHHHHQI")  # magic, version, checksum kind, key len, fingerprint len, payload len, checksum
_CHECKSUMS = {"crc32": 1, "crc32c": 2}
_MAX_HEX_KEY = 64  # longer keys are hashed into the file name (NAME_MAX is 255); the header keeps the key
_IOV_MAX = 512  # stay well under the kernel's IOV_MAX (1024) per readv/writev
_LOW_WATER = 0.9  # evict down to this fraction of capacity_bytes
_STALE_TMP_S = 3600.0  # temp files this old belong to a writer that died; eviction scans remove them

Checksum = Callable[[Sequence[memoryview]], int]


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
    checksum: Literal["crc32", "crc32c"] = dataclasses.field(default_factory=lambda: "crc32c" if _have_crc32c() else "crc32")

    def __post_init__(self) -> None:
        require(bool(self.path), "fs option 'path' must name a directory")
        require(self.capacity_bytes >= 0, f"fs option 'capacity_bytes' must be >= 0, got {self.capacity_bytes}")


def _crc32(parts: Sequence[memoryview]) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def _crc32c(parts: Sequence[memoryview]) -> int:
    import google_crc32c

    crc = 0
    for part in parts:
        crc = google_crc32c.extend(crc, np.asarray(part))  # it refuses memoryviews; a numpy view is no copy
    return int(crc)


_CHECKSUM_FNS: dict[int, Checksum] = {1: _crc32, 2: _crc32c}


def _have_crc32c() -> bool:
    try:
        import google_crc32c  # noqa: F401
    except ImportError:
        return False
    return True


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


class _Invalid(Exception):
    """An object failed validation; ``damaged`` ones are deleted, foreign ones left alone."""

    def __init__(self, reason: str, *, damaged: bool):
        super().__init__(reason)
        self.damaged = damaged


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
        self._kind = _CHECKSUMS[options.checksum]
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
            staging = self._host_staging(layout, len(fds), "fs-load")
            arr = staging.numpy()  # numpy views are what readv fills (a tensor exports no buffer)
            tail = memoryview(bytearray(1))  # must stay empty: catches objects longer than promised
            header = memoryview(bytearray(HEADER_BYTES))
            good = 0
            for i, (path, fd) in enumerate(fds):
                parts = [memoryview(arr[layer, i]) for layer in range(layout.num_layers)]
                got = _read_all(fd, [header, *parts, tail])
                try:
                    self._validate(op.keys[i], layout, header, parts, got)
                except _Invalid as bad:
                    self._reject(path, fd, str(bad), damaged=bad.damaged)
                    break
                good += 1
            if good:  # one vectorized scatter of the blocks that passed validation, and only those
                layout.scatter(op.block_ids[:good], staging[:, :good].to(layout.device))
            return op.block_ids[good:]
        finally:
            for _, fd in fds:
                os.close(fd)

    def save(self, op: BlockSave, layout: KVLayout) -> None:
        staging = layout.gather(op.block_ids, out=layout.scratch("fs-save", len(op.block_ids)))
        if staging.device.type != "cpu":
            staging = staging.cpu()
        arr = staging.numpy()
        payload = layout.num_layers * layout.block_bytes
        if self.options.capacity_bytes:
            self._make_room(len(op.keys) * (HEADER_BYTES + payload))
        fp = layout.fingerprint.to_json().encode()
        for i, key in enumerate(op.keys):
            path = self.path_of(key)
            if self._refresh(path):
                continue  # already stored (by us or another writer): same key, same KV
            parts = [memoryview(arr[layer, i]) for layer in range(layout.num_layers)]
            header = self._header(key, fp, payload, _CHECKSUM_FNS[self._kind](parts))
            self._write_object(path, [memoryview(header), *parts])
            if self._usage is not None:
                self._usage += HEADER_BYTES + payload

    # -- object format -----------------------------------------------------------------------------
    def _header(self, key: bytes, fp: bytes, payload: int, checksum: int) -> bytearray:
        fixed = _FIXED.pack(MAGIC, VERSION, self._kind, len(key), len(fp), payload, checksum)
        header = bytearray(HEADER_BYTES)
        end = len(fixed) + len(key) + len(fp)
        if end > HEADER_BYTES:
            raise ValueError(f"key ({len(key)} B) and fingerprint ({len(fp)} B) do not fit a {HEADER_BYTES} B header")
        header[:end] = fixed + key + fp
        return header

    def _validate(self, key: bytes, layout: KVLayout, header: memoryview, parts: list[memoryview], got: int) -> None:
        if got < _FIXED.size:
            raise _Invalid(f"truncated to {got} bytes", damaged=True)
        magic, version, kind, key_len, fp_len, payload, checksum = _FIXED.unpack_from(header)
        if magic != MAGIC:
            raise _Invalid("bad magic", damaged=True)
        if version != VERSION:
            raise _Invalid(f"format version {version}, this reader knows {VERSION}", damaged=False)
        if _FIXED.size + key_len + fp_len > HEADER_BYTES:
            raise _Invalid("header lengths out of range", damaged=True)
        pos = _FIXED.size
        if bytes(header[pos : pos + key_len]) != key:
            raise _Invalid("object holds another key", damaged=True)
        fp = bytes(header[pos + key_len : pos + key_len + fp_len])
        if fp != layout.fingerprint.to_json().encode():
            raise _Invalid(f"layout {fp.decode(errors='replace')} != ours {layout.fingerprint.to_json()}", damaged=False)
        want = layout.num_layers * layout.block_bytes
        if payload != want:
            raise _Invalid(f"payload length {payload} != {want}", damaged=True)
        if got != HEADER_BYTES + payload:
            raise _Invalid(f"{got} bytes on disk, header promises {HEADER_BYTES + payload}", damaged=True)
        verify = _CHECKSUM_FNS.get(kind)
        if verify is None or (kind == 2 and not _have_crc32c()):
            raise _Invalid(f"checksum kind {kind} cannot be verified here", damaged=False)
        if verify(parts) != checksum:
            raise _Invalid("checksum mismatch", damaged=True)

    def _reject(self, path: str, fd: int, reason: str, *, damaged: bool) -> None:
        self.stats.add(corrupt=1)
        log.warning("fs store: %s is not loadable (%s)%s", path, reason, "; deleting it" if damaged else "")
        if not damaged:
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

    @staticmethod
    def _host_staging(layout: KVLayout, n: int, name: str) -> torch.Tensor:
        """A host buffer ``[num_layers, n, block_bytes]`` to read into (pinned when the KV is on a GPU)."""
        if layout.device.type == "cpu":
            return layout.scratch(name, n)
        return torch.empty((layout.num_layers, n, layout.block_bytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())


class FsBackend(StoreBackend):
    """The ``fs`` store backend: an :class:`FsIndex` for the scheduler, an :class:`FsStore` per worker."""

    name = "fs"
    options_type = FsOptions

    def __init__(self, options: FsOptions):
        if options.checksum == "crc32c" and not _have_crc32c():
            raise MissingDependency("fs option checksum='crc32c' needs google-crc32c: pip install google-crc32c")
        super().__init__(options)

    def open_index(self, engine: EngineInfo) -> FsIndex:
        return FsIndex(engine, self.options)

    def open_io(self, engine: EngineInfo) -> FsStore:
        return FsStore(engine, self.options)


BACKEND = FsBackend

__all__ = ["BACKEND", "HEADER_BYTES", "MAGIC", "VERSION", "FsBackend", "FsOptions", "FsIndex", "FsStore", "object_name"]
