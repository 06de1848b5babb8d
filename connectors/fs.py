"""``fs`` — a shared-filesystem store: one file per *chunk* (a run of consecutive blocks of a prompt,
``chunk_tokens`` tokens on average, as LMCache's chunks) per (namespace, rank), under a directory.

The directory (local disk, NFS, Lustre, tmpfs) may be shared by any number of producer and consumer
processes on any number of machines. **Where chunks end is a property of the blocks' keys**: block
``i`` ends a chunk when ``crc32(key) % C == 0`` (``C = chunk_tokens // block_size`` blocks, so chunks
are ``C`` blocks long on average; the last chunk of a prompt ends with it). Keys are chained over the
whole prefix, so every engine cuts a prompt the same way without knowing where a list of keys starts
in its prompt — a tier of a ``chain`` asked about a prompt's tail finds the same chunks as an engine
asked about the whole prompt. Every stored block has a *locator*, a file name derived from its key
alone::

    <path>/<sha256(namespace)[:16]>/tp<T>.<rank>/v2-<C>/<name[:2]>/<name>     name = key.hex() (or a hash, see below)

``tp<T>.<rank>`` names the shard: rank ``rank`` of ``T`` tensor-parallel ranks (``tp1.0`` for every rank of
an engine whose ranks all hold the same KV, MLA's latent cache: rank 0 writes it, every rank reads it).
A consumer of another TP size finds the shards of the ``T`` its lookup saw and cuts its heads out of
them (:func:`kvbridge.layout.reslice`): each of its ranks reads the objects of every producer rank
that holds some of its heads, and only the blocks all of those hold arrive.

so a key, whatever its bytes, names a file of hex digits under the root and can never escape it. The
locator of a chunk's *last* block is the chunk's object itself; the locators of its other blocks are
symbolic links to it (``../<name[:2]>/<name>``). Every object starts where its chunk starts, so
following any locator reaches an object holding that block and every block of its chunk before it:

- **lookup** stats one locator per chunk — its last block's, which exists only if the whole chunk
  does — and, in the first chunk that is not whole, finds how far it goes by bisection (a prompt that
  shares only part of a chunk with a stored one still hits that part): about ``n/C + log2(C)`` stats
  for ``n`` blocks (5 for a 1024-token prompt in 256-token chunks) instead of one per block;
- **loads** open one locator per object they read, whatever block the load starts at.

A save that starts inside a chunk (the next step of a chunked prefill) reads the chunk's first blocks
back from their object (checked) and writes the chunk again, whole up to where it has blocks. Which
blocks those are, the scheduler side tells the worker (:class:`FsSave`, in ``BlockSave.target``):
after the request's previous save, or where its lookup's hit ended. Where they are not in the store
(a tier of a chain whose hit ended inside a chunk another tier served), the rest of that chunk is not
written. One case it cannot see: a chain's tier asked about a prompt's tail (``keys[pos:]``) that
holds none of it takes that tail for a whole prompt, so the request's next save there may start an
object inside a chunk; a later lookup of the whole prompt by another engine may then offer blocks of
that chunk this store lacks — a failed load, recomputed, never wrong bytes.

**Object format**: :data:`kvbridge.codec.FS` (version 2; :mod:`kvbridge.codec` has the byte layout)
— a header (magic, version, checksum kind, the layout fingerprint, and per block its key and
checksum; :data:`HEADER_BYTES` long unless the keys need more, always a multiple of 4096), then the
blocks, each its bytes in every layer, layer after layer. A reader checks the header (its own
checksum included), that the object has exactly the promised length, that it holds the key it was
reached by, and each block's checksum *before that block counts as loaded*: a damaged block fails
from itself on (the blocks before it load; it and those after it are reported failed, so the engine
recomputes them over whatever landed there), is counted in ``stats.corrupt`` and logged, and its
object is deleted so the next producer rewrites it. Objects of another version or layout are
left alone (another engine may own them). **Version 1 objects** (one file per block, written before)
live outside the ``v2-<C>`` folders: today's readers never look at them (a miss, never an error) and
eviction removes them, oldest first, like any object.

**Moving bytes.** A save checksums each block straight from the KV cache and writes it from there
(``pwritev`` of the per-layer pieces: no staging copy). A load reads each block straight into its
block of the KV (``preadv`` into the per-layer pieces: the kernel's copy is the only one) and checks
it there. The block is the request's own, which the engine reads only after the load reports, and
recomputes if the check failed — as a one-sided ucx read lands before its seal is checked. (Reading
into a thread's buffer, checking, then copying into the KV cost a second copy: 0.61 of the raw
medium at 128 MiB.) With a CPU KV, crc32c objects and :mod:`kvbridge._core` built, a load's blocks
and a save's (a window of objects) go to its ``file_start`` in one call: ``preadv``/``pwritev`` of
each block's pieces and the block's crc32c beside, on the native threads, blocks cut between them,
no Python per block (a Python thread per stretch of blocks cost more than the read: ~0.35 ms of an
8 MiB load). Elsewhere ``io_threads`` threads share a load's or a save's blocks: a KV on a GPU, one whose blocks are not
contiguous, or ``o_direct`` (aligned buffers) goes through a per-thread buffer, then the KV or a
staging buffer and one scatter. ``o_direct=True`` opens objects with ``O_DIRECT`` (past the page cache: NVMe, parallel
filesystems), through page-aligned buffers; a filesystem that refuses it is a
:class:`~kvbridge.errors.ConfigError` at start-up. (A layout whose block is not a multiple of 4096
bytes writes through the page cache even then; every real model's is.)

**Concurrency.** A writer writes a private temporary file in the object's directory and
``os.replace``\\ s it into place, which is atomic on POSIX filesystems (NFS and Lustre included), so a
reader sees the old object, the new one or none — never half of one; links are made the same way.
Writers of the same chunk write the same bytes, and whichever renames last wins. Readers that opened
an object keep reading it even if it is replaced or evicted meanwhile.

**Durability.** With ``fsync=False`` (the default) an object survives its writer's process dying,
not the machine losing power (the page cache may still hold it); a half-written object is never
visible either way. ``fsync=True`` flushes each object and its directory before the save returns:
slower (measured 3-5x on local disk), needed only where the cache must outlive a machine crash. (Links
are not flushed: one lost in a crash makes its block a miss.)

**Capacity.** With ``capacity_bytes`` set, a save that would push the directory past it first
deletes the oldest objects (by mtime: first saved, first evicted; a save that finds its chunk already
present refreshes that mtime) down to 90% of the capacity, so scans stay rare; links left pointing
nowhere are misses and are removed by the same scans. Usage is an estimate per process, refreshed by
a scan whenever it crosses the capacity: several writers may overshoot it by what they wrote between
scans. A full filesystem (``ENOSPC``) fails that save with :class:`~kvbridge.errors.StoreFull`; the
chunks it published before are kept, and nothing already stored is lost.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import itertools
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from kvbridge import codec
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import ConfigError, Corrupted, LayoutMismatch, StoreFull
from kvbridge.layout import BlockAddressing, KVLayout, LayoutFingerprint, block_words, reslice, staged_addressing
from kvbridge.options import require, writable_directory
from kvbridge.staging import StagingPool
from kvbridge.store import StoreBackend, StoreIndex, StoreIO

log = logging.getLogger(__name__)

FORMAT = codec.FS
MAGIC = FORMAT.magic
VERSION = FORMAT.version
HEADER_BYTES = FORMAT.align  # a header's usual length: block 0 starts here unless the keys need more
_FIXED = FORMAT.fixed  # the header's fixed fields (tests forge objects with it)
_ALIGN = FORMAT.align
_MAX_HEX_KEY = 64  # longer keys are hashed into the file name (NAME_MAX is 255); the header keeps the key
_IOV_MAX = 512  # stay well under the kernel's IOV_MAX (1024) per readv/writev
_LOW_WATER = 0.9  # evict down to this fraction of capacity_bytes
_STALE_TMP_S = 3600.0  # temp files this old belong to a writer that died; eviction scans remove them
_SHARD = re.compile(r"tp(\d+)\.(\d+)")  # a shard's directory: tp<T>.<rank>
_REMEMBERED = 4096  # requests (and looked-up prompts) whose save positions the scheduler side keeps
_FOUND_S = 1.0  # how long what a lookup found answers a chain's members() without a stat
_ENOSPC = (errno.ENOSPC, errno.EDQUOT)
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux 4.14+: a read that fails rather than wait for the medium

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class FsOptions:
    """``path``: the shared directory (created if missing). ``capacity_bytes``: 0 = unbounded, else
    evict oldest objects to stay under it. ``fsync``: flush every object before the save returns.
    ``checksum``: ``crc32`` (zlib, always there, ~4 GB/s here) or ``crc32c`` (hardware, ~20-33 GB/s:
    kvbridge's native module where built, else ``google-crc32c``, in ``kvbridge[fs]``; the default where
    either is there);
    readers verify whichever kind an object names. ``chunk_tokens``: tokens per object on average (in
    whole blocks, at least one); engines sharing a directory find each other's objects only with the
    same number of blocks per chunk. ``io_threads``: threads moving one load's or save's blocks.
    ``o_direct``: bypass the page cache (``O_DIRECT``; refused where the filesystem cannot)."""

    path: str
    capacity_bytes: int = 0
    fsync: bool = False
    checksum: Literal["crc32", "crc32c"] = dataclasses.field(default_factory=codec.default_checksum)
    chunk_tokens: int = 256
    io_threads: int = 2
    o_direct: bool = False

    def __post_init__(self) -> None:
        require(bool(self.path), "fs option 'path' must name a directory")
        require(self.capacity_bytes >= 0, f"fs option 'capacity_bytes' must be >= 0, got {self.capacity_bytes}")
        require(self.chunk_tokens >= 1, f"fs option 'chunk_tokens' must be >= 1, got {self.chunk_tokens}")
        require(1 <= self.io_threads <= 64, f"fs option 'io_threads' must be in [1, 64], got {self.io_threads}")


# a block of a save (its index in the op) -> views of its bytes; None where kvbridge._core moves the
# blocks by address (FsStore._write_native); the addressing of a staging buffer holding the op's blocks in
# order (a KV on a GPU, gathered into pinned memory) where kvbridge._core moves them from there
_Parts = Callable[[int], list[Any]] | BlockAddressing | None


@dataclasses.dataclass(frozen=True)
class FsSave:
    """``BlockSave.target`` of an ``fs`` save: the keys of the blocks before its first in the same chunk
    (``()``: it starts a chunk; ``None``: not known, so that chunk is not written)."""

    head: tuple[bytes, ...] | None = ()


def object_name(key: bytes) -> str:
    """The file name of ``key``: its hex digits, or ``h`` + a blake2b hex digest for empty or long keys."""
    if 0 < len(key) <= _MAX_HEX_KEY // 2:
        return key.hex()
    return "h" + hashlib.blake2b(key, digest_size=32).hexdigest()


def chunk_blocks(block_size: int, chunk_tokens: int) -> int:
    """Blocks per chunk (on average): ``chunk_tokens`` rounded down to whole blocks, at least one."""
    return max(1, chunk_tokens // max(1, block_size))


def ends_chunk(key: bytes, chunk: int) -> bool:
    """Whether the block of ``key`` is the last of its chunk (of ``chunk`` blocks on average)."""
    return chunk == 1 or zlib.crc32(key) % chunk == 0


def chunk_end(keys: Sequence[bytes], i: int, chunk: int) -> int:
    """The index of the last block of the chunk holding ``keys[i]`` (the last key if its chunk goes on)."""
    last = len(keys) - 1
    if chunk == 1:
        return min(i, last)
    crc = zlib.crc32  # (inline: this runs once per key of every lookup)
    while i < last and crc(keys[i]) % chunk:
        i += 1
    return i


def chunk_ends(keys: Sequence[bytes], chunk: int) -> list[int]:
    """The index of the last block of every chunk ``keys`` are cut into, in order (the last key ends one):
    :func:`chunk_end` for all of them at once, the crc32s in one C-level pass (no Python loop per key)."""
    n = len(keys)
    if chunk == 1 or n == 0:
        return list(range(n))
    crcs = np.fromiter(map(zlib.crc32, keys), dtype=np.uint32, count=n)
    ends = np.flatnonzero(crcs % np.uint32(chunk) == 0).tolist()
    return ends if ends and ends[-1] == n - 1 else [*ends, n - 1]


def chunk_lengths(keys: Sequence[bytes], chunk: int) -> list[int]:
    """How many blocks each chunk ``keys`` are cut into holds, in order."""
    return np.diff([-1, *chunk_ends(keys, chunk)]).tolist()


# -- I/O helpers -------------------------------------------------------------------------------------
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


def _write_at(fd: int, bufs: Sequence[Any], offset: int) -> None:
    """Write ``bufs`` at ``offset``, all of them (a short write goes on where it stopped)."""
    left = _bytes_of(bufs)
    while left:
        n = os.pwritev(fd, left[:_IOV_MAX], offset)
        offset += n
        left = _advance(left, n)


def _read_at(fd: int, bufs: Sequence[Any], offset: int) -> int:
    """Fill ``bufs``, in order, from ``offset`` until they are full or the file ends; the bytes read."""
    left = _bytes_of(bufs)
    total = 0
    while left:
        n = os.preadv(fd, left[:_IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        left = _advance(left, n)
    return total


def _cached(fd: int, at: int) -> bool:
    """Whether the byte at ``at`` of ``fd`` is in the page cache: a one-byte read that may not wait for the
    medium (``RWF_NOWAIT``). ``False`` where the kernel or filesystem cannot say (as if it were not)."""
    if not _NOWAIT:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], at, _NOWAIT) == 1
    except (OSError, ValueError):  # EAGAIN: on the medium; EOPNOTSUPP / no RWF_NOWAIT: cannot tell
        return False


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned (``O_DIRECT``-ready) byte buffer of at least ``nbytes``, its pages touched once."""
    size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
    buf = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    buf[::_ALIGN] = 0
    return buf


def probe_o_direct(path: str) -> None:
    """Raise :class:`ConfigError` unless files under ``path`` can be written and read with ``O_DIRECT``."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        raise ConfigError("fs option o_direct: O_DIRECT does not exist on this platform")
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".o_direct.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    buf = _aligned(_ALIGN)
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


class _Blocks:
    """Numpy byte views of a CPU KV cache whose blocks are each one contiguous stretch per layer: block
    ``b`` of layer ``l`` is ``rows[l][b]``; where the layers are evenly spaced in memory (one allocation,
    as vLLM's), ``slab[:, b]`` is block ``b`` of every layer, so a block lands in one copy. (numpy, not
    torch: torch's copy may fan out to its own threads, which on a loaded machine costs more than it
    brings; numpy's releases the GIL and stays on the calling thread.)"""

    def __init__(self, rows: list[np.ndarray]):
        self.rows = rows
        self.slab: np.ndarray | None = None
        ptrs = [r.__array_interface__["data"][0] for r in rows]
        step = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
        if step and all(p == ptrs[0] + i * step for i, p in enumerate(ptrs)):
            shape = (len(rows), rows[0].shape[0], rows[0].shape[1])
            self.slab = np.lib.stride_tricks.as_strided(rows[0], shape, (step, *rows[0].strides), writeable=True)

    @classmethod
    def of(cls, layout: KVLayout) -> _Blocks | None:
        """The views of ``layout``, or ``None`` where it must go through staging (a GPU, ``kv_first``)."""
        if layout.device_type != "cpu":
            return None
        rows = [block_words(v, torch.uint8) for v in layout.layers]
        if any(r is None for r in rows):
            return None
        return cls([r.numpy() for r in rows if r is not None])

    def parts(self, block: int) -> list[np.ndarray]:
        return [r[block] for r in self.rows]

    def put(self, block: int, data: np.ndarray) -> None:
        """Write ``data`` (``[num_layers, block_bytes]``) into block ``block`` of every layer."""
        if self.slab is not None:
            self.slab[:, block] = data
        else:
            for layer, row in enumerate(self.rows):
                row[block] = data[layer]


class _Tree:
    """Where one engine's objects live under the shared root: its namespace, shard and chunk size."""

    def __init__(self, engine: EngineInfo, options: FsOptions):
        self.options = options
        self.root = os.path.abspath(options.path)
        self.chunk = chunk_blocks(engine.block_size, options.chunk_tokens)
        self.ns_dir = os.path.join(self.root, hashlib.sha256(engine.namespace.encode()).hexdigest()[:16])
        self.tp = engine.kv_world_size
        self.dir = self.shard_dir(self.tp, engine.kv_rank)

    def shard_dir(self, tp: int, rank: int) -> str:
        """The directory of rank ``rank``'s objects in a ``tp``-way engine of this namespace."""
        return os.path.join(self.ns_dir, f"tp{tp}.{rank}", f"v{VERSION}-{self.chunk}")

    def path_of(self, key: bytes, folder: str | None = None) -> str:
        """The locator of ``key`` (in this engine's shard, or ``folder``): its chunk's object (the chunk's
        last block), or a link to it."""
        name = key.hex() if 0 < len(key) <= _MAX_HEX_KEY // 2 else object_name(key)
        return f"{folder or self.dir}{os.sep}{name[:2]}{os.sep}{name}"


@dataclasses.dataclass(frozen=True)
class FsLoad:
    """``BlockLoad.source`` of an ``fs`` load whose blocks another TP size saved: its ``tp``."""

    tp: int


def _remember(book: collections.OrderedDict[Any, Any], key: Any, value: Any) -> None:
    book[key] = value
    book.move_to_end(key)
    while len(book) > _REMEMBERED:
        book.popitem(last=False)


class FsIndex(_Tree, StoreIndex):
    """Scheduler side: one stat per chunk (see the module docstring), and where each save starts."""

    def __init__(self, engine: EngineInfo, options: FsOptions):
        StoreIndex.__init__(self, engine)
        _Tree.__init__(self, engine, options)
        # key where a lookup's hit ended -> the keys before it in its chunk: where the request's saves will
        # start (the store holds everything before)
        self._hits: collections.OrderedDict[bytes, tuple[bytes, ...]] = collections.OrderedDict()
        # request -> the keys of the chunk its next save goes on with (None: not known)
        self._saving: collections.OrderedDict[str, tuple[bytes, ...] | None] = collections.OrderedDict()
        # last key of a hit another TP size held -> that TP size (its load cuts heads out of that split)
        self._split_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._splits_seen: tuple[float, list[int]] = (-1e9, [])
        # keys the lookups of the last _FOUND_S seconds found, and since when: a chain asks which blocks
        # its tiers hold (members) right after its lookup asked how far they go, and need not stat again
        self._found: tuple[float, set[bytes]] = (-1e9, set())

    def reserve_load(self, request_id: str, keys: Sequence[bytes]) -> FsLoad | None:
        tp = self._split_of.get(keys[-1]) if keys else None
        return FsLoad(tp) if tp is not None else None

    def _present(self, key: bytes, folder: str | None = None) -> bool:
        try:
            os.stat(self.path_of(key, folder))  # follows a link: a link whose object is gone is a miss
        except OSError:  # missing, or the directory itself is gone: a miss either way
            return False
        return True

    def _other_splits(self) -> list[int]:
        """The TP sizes other than ours whose rank 0 stored objects of this namespace (listed at most once
        a second)."""
        now = time.monotonic()
        if now - self._splits_seen[0] > 1.0:
            try:
                names = os.listdir(self.ns_dir)
            except OSError:
                names = []
            found = {int(m.group(1)) for m in map(_SHARD.fullmatch, names) if m and m.group(2) == "0"}
            self._splits_seen = (now, sorted(found - {self.tp}))
        return self._splits_seen[1]

    def members(self, keys: Sequence[bytes]) -> list[int]:
        """Every one of ``keys`` if a lookup found them all just before (a chain's reservation after its
        lookup); else looked up again. One found then evicted since fails its load, which recomputes it,
        as one evicted after this answer would."""
        since, found = self._found
        if time.monotonic() - since < _FOUND_S and found.issuperset(keys):
            return list(range(len(keys)))
        return super().members(keys)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        n = self._stat_prefix(keys)
        if n:
            since, found = self._found
            if time.monotonic() - since > _FOUND_S or len(found) > _REMEMBERED * 16:
                self._found = since, found = time.monotonic(), set()
            found.update(keys[:n])
        return n

    def _stat_prefix(self, keys: Sequence[bytes]) -> int:
        n = self._prefix(keys)
        if n < len(keys):
            for tp in self._other_splits():  # another TP size may hold more: its ranks are re-sliced
                m = self._prefix(keys, self.shard_dir(tp, 0))
                if m > n:
                    n = m
                    _remember(self._split_of, keys[m - 1], tp)
        if n < len(keys) and self.engine.role == "both":  # its saves start at n (a producer's at the prompt's start)
            b = n - 1
            while b >= 0 and not ends_chunk(keys[b], self.chunk):
                b -= 1
            _remember(self._hits, keys[n], tuple(keys[b + 1 : n]))
        return n

    def _prefix(self, keys: Sequence[bytes], folder: str | None = None) -> int:
        n = 0
        for end in chunk_ends(keys, self.chunk):  # n is where this chunk starts
            if self._present(keys[end], folder):  # the chunk is stored whole (as far as these keys go)
                n = end + 1
                continue
            if end == n or not self._present(keys[n], folder):
                return n
            # the chunk's first block here is there, its last is not: bisect. A locator found names an object
            # holding every block of its chunk up to it, so any block found proves the ones before it.
            lo, hi = n, end
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self._present(keys[mid], folder):
                    lo = mid
                else:
                    hi = mid
            return lo + 1
        return n

    def reserve_save(self, request_id: str, keys: Sequence[bytes]) -> tuple[Sequence[int], Any]:
        if request_id in self._saving:  # the request's next save: after its previous one
            head = self._saving.pop(request_id)
        else:  # its first: where its lookup's hit ended, or its prompt's start
            head = self._hits.get(keys[0], ()) if keys else ()
        run = (*head, *keys) if head is not None else tuple(keys)
        b = len(run) - 1
        while b >= 0 and not ends_chunk(run[b], self.chunk):
            b -= 1
        # the keys of the chunk the next save goes on with (unknown if its start is not among them)
        tail = run[b + 1 :] if b >= 0 or head is not None else None
        _remember(self._saving, request_id, tail)
        return range(len(keys)), FsSave(head)

    def release(self, request_id: str, failed: Sequence[bytes] = ()) -> None:
        # a load's release comes before the request computes (and saves) anything; its end's after its last save
        self._saving.pop(request_id, None)


@dataclasses.dataclass
class _Read:
    """Blocks ``first .. first+count-1`` of an open object, for blocks ``at ..`` of a load."""

    path: str
    fd: int
    chunk: codec.Chunk
    first: int
    count: int
    at: int


@dataclasses.dataclass
class _Object:
    """An object a save writes: its chunk's keys (``head`` of them read back from ``source``), its blocks
    from the op (``lo .. hi-1``), and its temporary file."""

    keys: tuple[bytes, ...]
    head: int
    lo: int
    hi: int
    path: str
    source: _Read | None = None
    tmp: str = ""
    fd: int = -1
    header: int = 0
    sums: list[int] = dataclasses.field(default_factory=list)
    error: BaseException | None = None


class FsStore(_Tree, StoreIO):
    """Worker side: one engine's objects in the shared directory. See the module docstring."""

    def __init__(self, engine: EngineInfo, options: FsOptions):
        StoreIO.__init__(self, engine)
        _Tree.__init__(self, engine, options)
        self._kind = codec.CHECKSUMS[options.checksum]
        self._direct = getattr(os, "O_DIRECT", 0) if options.o_direct else 0
        self._staging = StagingPool()  # where a KV on a GPU (or in kv_first) is gathered and scattered
        self._made: set[str] = set()  # subdirectories known to exist (re-made if someone removes them)
        self._folders = False  # the shard's 256 folders made (by the first save)
        self._usage: int | None = None  # estimate of bytes under root, when capacity_bytes is set
        self._local = threading.local()  # each thread's block buffer
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._views: tuple[KVLayout, _Blocks | None] | None = None
        # kvbridge._core where it loaded and has crc32c: reads checked without a Python object per block
        self._native = codec.native_crc32c()

    def attach(self, layout: KVLayout) -> None:
        self._blocks(layout)

    def _make_folders(self) -> None:
        """The 256 folders of this engine's shard, made by its first save: a save into a new folder paid
        its mkdir, and each link into one a failed symlink, a mkdir and the symlink again (~0.2 ms of an
        8 MiB save while the bench's saves met new folders). One that cannot be made is made (or fails)
        when a save needs it, as before."""
        self._folders = True
        for i in range(256):
            try:
                self._mkdir(os.path.join(self.dir, f"{i:02x}"))
            except OSError as exc:  # the save says why, when it needs the folder
                log.debug("fs store: cannot make the folders of %s yet (%s)", self.dir, exc)
                return

    def _blocks(self, layout: KVLayout) -> _Blocks | None:
        if self._views is None or self._views[0] is not layout:
            self._views = (layout, _Blocks.of(layout))
        return self._views[1]

    def _buffer(self, nbytes: int) -> np.ndarray:
        """This thread's aligned buffer, at least ``nbytes`` (kept: a block read into it stays in the CPU cache)."""
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.buf = _aligned(nbytes)
        return buf

    def _parallel(self, n: int, fn: Callable[[int], T]) -> list[T]:
        """``[fn(0), ..., fn(n-1)]``, run by up to ``io_threads`` threads (this one included), each taking
        the next index as it goes."""
        threads = min(self.options.io_threads, n)
        if threads <= 1:
            return [fn(i) for i in range(n)]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.options.io_threads - 1, thread_name_prefix="kvbridge-fs")
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

    # -- loads ---------------------------------------------------------------------------------------
    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        layout.check_bounds(op.block_ids)  # ids outside the KV fail the whole load, before any read
        if isinstance(op.source, FsLoad) and op.source.tp != self.tp:
            return op.block_ids[self._load_resliced(op, layout, op.source.tp):]
        reads = self._locate(op.keys, layout.fingerprint)
        try:
            covered = sum(r.count for r in reads)
            good = covered
            if covered:
                good = self._read_blocks(op, layout, reads, covered)
            return op.block_ids[good:]
        finally:
            for r in reads:
                os.close(r.fd)

    def start_load(self, op: BlockLoad, layout: KVLayout) -> tuple[Any, Callable[[], Sequence[int]]] | None:
        """A load into a CPU KV, started from the engine's thread: its objects opened and their headers
        checked here, the blocks read and checked on the native threads (``file_start``), the sums
        compared by the poll that sees the read over. No hand-off to the IO thread and back, which cost
        ~0.3 ms of an 8 MiB load here (its read takes ~0.4). ``None`` (the IO thread loads it) for what
        :meth:`load` does another way: another TP size's shards, a GPU KV, objects of another checksum."""
        if self._staged(layout) or not self._native_crc(layout):
            return None
        if isinstance(op.source, FsLoad) and op.source.tp != self.tp:
            return None
        layout.check_bounds(op.block_ids)
        reads = self._locate(op.keys, layout.fingerprint)
        covered = sum(r.count for r in reads)
        if not covered or not self._native_crc(layout, reads):
            for r in reads:
                os.close(r.fd)
            return None  # nothing found (the IO thread's load reports it, the ordinary way), or older objects
        try:
            running = self._start_move(layout, op.block_ids[:covered], self._runs(reads), write=False)
        except BaseException:
            for r in reads:
                os.close(r.fd)
            raise

        def failed() -> Sequence[int]:
            try:  # checked() does not wait: the poll saw the read over
                return op.block_ids[self._check_read(reads, covered, *running.checked()) :]
            finally:
                for r in reads:
                    os.close(r.fd)

        return running, failed

    def _open(self, path: str, fingerprint: LayoutFingerprint) -> tuple[int, codec.Chunk]:
        """Open the object at ``path`` and check its header; :class:`Corrupted` (fd closed) if it fails."""
        # O_NONBLOCK: something else than a file at a locator (a FIFO) must not hang the load
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | self._direct)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Corrupted("not a regular file", damaged=False)
            size = st.st_size
            buf = self._buffer(_ALIGN)
            got = _read_at(fd, [buf[:_ALIGN]], 0)
            length = FORMAT.header_bytes(buf[:got], size)
            if length > got:
                buf = _aligned(length)
                got = _read_at(fd, [buf[:length]], 0)
            return fd, FORMAT.parse(buf[:got], fingerprint=fingerprint, size=size)
        except Corrupted as bad:
            self._reject(path, fd, bad)
            os.close(fd)
            raise
        except BaseException:
            os.close(fd)
            raise

    def _locate(self, keys: Sequence[bytes], fingerprint: LayoutFingerprint, folder: str | None = None) -> list[_Read]:
        """The objects holding ``keys`` from the first on (open, headers checked against ``fingerprint``),
        up to the first missing; in this engine's shard or ``folder``."""
        reads: list[_Read] = []
        i = 0
        try:
            while i < len(keys):
                path = self.path_of(keys[i], folder)
                try:
                    fd, chunk = self._open(path, fingerprint)
                except Corrupted:
                    break
                except OSError:  # missing: the engine recomputes from here
                    break
                try:
                    first = chunk.find(keys[i])
                except Corrupted as bad:
                    self._reject(path, fd, bad, whole=False)
                    os.close(fd)
                    break
                count = 1
                while first + count < len(chunk.keys) and i + count < len(keys) and chunk.keys[first + count] == keys[i + count]:
                    count += 1
                reads.append(_Read(path, fd, chunk, first, count, i))
                if i and not self._direct and not _cached(fd, chunk.offset(first + count) - 1):
                    # start the kernel's read-ahead of the objects after the first (whose read starts at
                    # once), so reads from the medium overlap. Not for an object in the page cache: there
                    # the advice only walks its pages, 0.1 ms of the engine's thread per 32 MiB here
                    os.posix_fadvise(fd, chunk.offset(first), count * chunk.payload, os.POSIX_FADV_WILLNEED)
                i += count
        except BaseException:
            for r in reads:
                os.close(r.fd)
            raise
        return reads

    def _read_blocks(self, op: BlockLoad, layout: KVLayout, reads: list[_Read], covered: int) -> int:
        """Read, check and place the located blocks; how many from the first arrived."""
        if self._native_crc(layout, reads):
            return self._read_native(op, layout, reads, covered)
        blocks = self._blocks(layout)
        where = [(r, r.first + t) for r in reads for t in range(r.count)]
        failed = [covered]  # a block that failed: those after it need not be read (a hint; see below)
        staging = None if blocks is not None else self._staging.take(layout, covered)
        try:
            dest = staging.numpy() if staging is not None else None

            def place(i: int) -> BaseException | bool:
                """True: block i is in the KV; False: not read (a block before it failed); else why it failed."""
                if i > failed[0]:
                    return False
                r, pos = where[i]
                try:
                    if blocks is not None and not self._direct:  # straight into its block, checked there
                        self._read_in_place(r.fd, r.chunk, pos, blocks.parts(op.block_ids[i]))
                        return True
                    data = self._read_block(r.fd, r.chunk, pos).reshape(layout.num_layers, layout.block_bytes)
                except (Corrupted, OSError) as exc:
                    failed[0] = i
                    return exc
                if dest is not None:
                    dest[:, i] = data
                elif blocks is not None:
                    blocks.put(op.block_ids[i], data)
                return True

            outcomes = self._parallel(covered, place)
            good = next((i for i, ok in enumerate(outcomes) if ok is not True), covered)
            if good < covered:
                r = where[good][0]
                bad = outcomes[good]
                if isinstance(bad, Corrupted):
                    self._reject(r.path, r.fd, bad)
                elif isinstance(bad, OSError):
                    log.warning("fs store: reading %s failed (%s)", r.path, bad)
            if staging is not None and good:  # one vectorized scatter of the blocks that passed, and only those
                layout.scatter(op.block_ids[:good], staging[:, :good].to(layout.device))
            return good
        finally:
            if staging is not None:
                self._staging.give(staging)

    def _native_crc(self, layout: KVLayout, reads: Sequence[_Read] = ()) -> bool:
        """Whether blocks move through :mod:`kvbridge._core` (``file_start``: moved and checked on its threads,
        no Python object per block): a CPU KV (any layout: a block's pieces are addressed) or one on a GPU
        (through pinned staging), read in place, objects checked with crc32c (this store's kind, and every
        object's a load reads)."""
        return (self._native is not None and layout.device_type in ("cpu", "cuda") and not self._direct
                and self._kind == codec.CRC32C and all(r.chunk.kind == codec.CRC32C for r in reads))  # fmt: skip

    @staticmethod
    def _staged(layout: KVLayout) -> bool:
        """Whether the native path moves blocks through pinned staging: a KV the host cannot address (a GPU's)."""
        return layout.device_type != "cpu"

    def _read_native(self, op: BlockLoad, layout: KVLayout, reads: list[_Read], covered: int) -> int:
        """Every located block read straight into its block of the KV and checked there, in one call on
        the native threads (``file_start``: blocks cut between them, each block's crc taken as it lands);
        how many from the first arrived (a block that failed is handled as :meth:`_read_blocks` does). A KV
        on a GPU is read into pinned staging that way, then copied up once and scattered on the device."""
        if not self._staged(layout):
            running = self._start_move(layout, op.block_ids[:covered], self._runs(reads), write=False)
            return self._check_read(reads, covered, *running.checked())
        with self._staging.lend(layout, covered) as staging:
            running = self._start_move(layout, range(covered), self._runs(reads), write=False,
                                       addressing=staged_addressing(staging))  # fmt: skip
            good = self._check_read(reads, covered, *running.checked())
            if good:  # only the blocks that passed
                layout.scatter(op.block_ids[:good], staging[:, :good].to(layout.device))
            return good

    @staticmethod
    def _runs(reads: Sequence[_Read]) -> list[tuple[int, int, int]]:
        return [(r.fd, r.chunk.offset(r.first), r.count) for r in reads]

    def _check_read(self, reads: list[_Read], covered: int, sums: bytes, whole: int, err: int) -> int:
        """How many blocks from the first of a native read arrived whole with the sums their objects hold
        (``checked()``'s figures); the object of the first that did not is rejected or logged."""
        want = b"".join(r.chunk.packed_sums(r.first, r.count) for r in reads)
        good = codec.leading_matches(sums[: 4 * whole], want[: 4 * whole])
        if good < covered:
            r = next(r for r in reads if r.at <= good < r.at + r.count)
            pos = r.first + good - r.at
            if good < whole:  # a block arrived whole, and wrong
                self._reject(r.path, r.fd, r.chunk.mismatch(pos))
            elif err:
                log.warning("fs store: reading %s failed (%s)", r.path, os.strerror(err))
            else:
                self._reject(r.path, r.fd, Corrupted(f"block {pos} cut short", damaged=True))
        return good

    def _load_resliced(self, op: BlockLoad, layout: KVLayout, tp: int) -> int:
        """Cut this rank's heads out of the ``tp``-way shards that hold them (:func:`~kvbridge.layout.reslice`)
        into a staging buffer, then scatter what every one of those shards held; how many blocks, from
        the first, arrived."""
        try:
            theirs, cuts = reslice(layout.fingerprint, self.engine.rank, self.tp, tp)
        except LayoutMismatch as exc:
            log.warning("fs store: %s cannot be loaded from tp=%d: %s", op.request_id, tp, exc)
            return 0
        good = len(op.keys)
        with self._staging.lend(layout, good) as staging:
            dest = staging.numpy()
            for rank, cut in cuts.items():
                reads = self._locate(op.keys[:good], theirs, self.shard_dir(tp, rank))
                try:
                    good = self._cut_blocks(reads, theirs, dest, cut, min(good, sum(r.count for r in reads)))
                finally:
                    for r in reads:
                        os.close(r.fd)
            if good:
                layout.scatter(op.block_ids[:good], staging[:, :good].to(layout.device))
        return good

    def _cut_blocks(self, reads: list[_Read], theirs: LayoutFingerprint, dest: np.ndarray, cut: Any, n: int) -> int:
        """Read the first ``n`` located blocks (of layout ``theirs``), placing bytes ``cut`` of each in
        ``dest``; how many from the first passed their checks."""
        where = [(r, r.first + t) for r in reads for t in range(r.count)][:n]

        def place(i: int) -> bool:
            r, pos = where[i]
            try:
                data = self._read_block(r.fd, r.chunk, pos).reshape(theirs.num_layers, theirs.block_bytes)
            except (Corrupted, OSError) as exc:
                log.warning("fs store: reading %s failed (%s)", r.path, exc)
                return False
            dest[:, i, cut.dst : cut.dst + cut.length] = data[:, cut.src : cut.src + cut.length]
            return True

        outcomes = self._parallel(n, place)
        return next((i for i, ok in enumerate(outcomes) if not ok), n)

    @staticmethod
    def _read_in_place(fd: int, chunk: codec.Chunk, pos: int, parts: list[np.ndarray]) -> None:
        """Block ``pos`` of an object read into its block of the KV (``parts``: one per layer) and checked
        there; :class:`Corrupted` if bad (the engine then recomputes that block, overwriting it)."""
        got = _read_at(fd, parts, chunk.offset(pos))
        if got < chunk.payload:
            raise Corrupted(f"block {pos} cut short ({got} of {chunk.payload} bytes)", damaged=True)
        chunk.verify(pos, parts)

    def _read_block(self, fd: int, chunk: codec.Chunk, pos: int) -> np.ndarray:
        """Block ``pos`` of an object, read into this thread's buffer and checked; :class:`Corrupted` if bad."""
        payload = chunk.payload
        off = chunk.offset(pos)
        if self._direct:  # aligned offset, length and buffer; the end of the file may cut the read short
            lo = off - off % _ALIGN
            hi = -(-(off + payload) // _ALIGN) * _ALIGN
            buf = self._buffer(hi - lo)
            got = _read_at(fd, [buf[: hi - lo]], lo) - (off - lo)
            data = buf[off - lo : off - lo + payload]
        else:
            data = self._buffer(payload)[:payload]
            got = _read_at(fd, [data], off)
        if got < payload:
            raise Corrupted(f"block {pos} cut short ({max(got, 0)} of {payload} bytes)", damaged=True)
        chunk.verify(pos, [data])
        return data

    # -- saves ---------------------------------------------------------------------------------------
    def save(self, op: BlockSave, layout: KVLayout) -> None:
        if not op.keys or self.engine.rank != self.engine.kv_rank:  # rank 0 writes the bytes every rank holds
            return
        layout.check_bounds(op.block_ids)
        if not self._folders:
            self._make_folders()
        target = op.target if isinstance(op.target, FsSave) else FsSave()
        objects = [o for o in self._objects(op, target) if not self._refresh(o.path)]
        if not objects:
            return
        payload = layout.num_layers * layout.block_bytes
        if self.options.capacity_bytes:
            self._make_room(sum(FORMAT.header_length(o.keys, layout.fingerprint) + len(o.keys) * payload for o in objects))
        if self._native_crc(layout):  # blocks move by address, not by view
            if not self._staged(layout):
                self._save_objects(op, layout, objects, None)
                return
            with self._staging.gathered(layout, op.block_ids) as staging:  # from pinned staging, by address
                self._save_objects(op, layout, objects, staged_addressing(staging))
            return
        blocks = self._blocks(layout)
        if blocks is not None:
            self._save_objects(op, layout, objects, lambda i: blocks.parts(op.block_ids[i]))
            return
        with self._staging.gathered(layout, op.block_ids) as staging:
            arr = staging.numpy()
            self._save_objects(op, layout, objects, lambda i: [arr[layer, i] for layer in range(layout.num_layers)])

    def _objects(self, op: BlockSave, target: FsSave) -> list[_Object]:
        """The chunks ``op`` writes: one per chunk its blocks fall in (the first completed from ``target.head``)."""
        out = []
        i = 0
        head: tuple[bytes, ...] | None = target.head
        for end in (last + 1 for last in chunk_ends(op.keys, self.chunk)):
            if head is None:  # inside a chunk whose first blocks are unknown: not saved
                log.debug("fs store: %s: the first blocks of the chunk of block %d are unknown; not saved", op.request_id, i)
            else:
                keys = (*head, *op.keys[i:end])
                out.append(_Object(keys, len(head), i, end, self.path_of(keys[-1])))
            head = ()
            i = end
        return out

    def _save_objects(
        self, op: BlockSave, layout: KVLayout, objects: list[_Object], parts: _Parts
    ) -> None:
        # a window of objects at a time (one per thread), published before the next is written: a full disk
        # keeps every chunk of the save but those of the window it stopped in
        step = self.options.io_threads
        for w in range(0, len(objects), step):
            window = objects[w : w + step]
            try:
                self._write_window(op, layout, window, parts)
            finally:
                for o in window:
                    self._discard(o)

    def _write_window(
        self, op: BlockSave, layout: KVLayout, objects: list[_Object], parts: _Parts
    ) -> None:
        payload = layout.num_layers * layout.block_bytes
        direct = self._direct if payload % _ALIGN == 0 else 0
        ready = []
        for o in objects:
            if o.head and not self._open_head(o, layout):
                continue
            o.header = FORMAT.header_length(o.keys, layout.fingerprint)
            o.sums = [0] * len(o.keys)
            self._create(o, direct)
            ready.append(o)
        live = [o for o in ready if o.error is None]
        if parts is None or isinstance(parts, BlockAddressing):  # the op's blocks in one native call; the
            self._write_native(op, layout, live, parts)  # chunks' first blocks below, read back
            work = [(o, j) for o in live for j in range(o.head)]
        else:  # block j of every object, then block j+1: threads taking the next one write different files
            # (writes to one file take its lock in turn)
            work = [(o, j) for j in range(max((len(o.keys) for o in live), default=0)) for o in live if j < len(o.keys)]
        full: list[OSError] = []  # a write found the disk full: the others stop

        def write(i: int) -> None:
            o, j = work[i]
            if o.error is not None:
                return
            if full:
                o.error = full[0]
                return
            try:
                off = o.header + j * payload
                if j < o.head:  # read back from the chunk's earlier object, checked, written as it was
                    assert o.source is not None
                    data = self._read_block(o.source.fd, o.source.chunk, j)
                    o.sums[j] = o.source.chunk.checksums[j] if o.source.chunk.kind == self._kind else codec.checksum(self._kind, [data])
                    _write_at(o.fd, [data], off)
                    return
                assert callable(parts)  # the native path wrote the op's own blocks
                src = parts(o.lo + j - o.head)
                if direct:  # O_DIRECT writes from an aligned buffer
                    buf = self._buffer(payload)[:payload]
                    np.concatenate(src, out=buf)
                    o.sums[j] = codec.checksum(self._kind, [buf])
                    _write_at(o.fd, [buf], off)
                else:  # straight from the KV: checksum its pieces, write them where the block goes
                    o.sums[j] = codec.checksum(self._kind, src)
                    _write_at(o.fd, src, off)
            except OSError as exc:
                o.error = exc
                if exc.errno in _ENOSPC:
                    full.append(exc)
            except Corrupted as exc:
                o.error = exc

        self._parallel(len(work), write)
        for o in ready:  # published in order: a save cut short by a full disk keeps the chunks before
            if o.error is not None:
                if isinstance(o.error, Corrupted):
                    log.warning("fs store: %s: the chunk's first blocks failed (%s); not saved", o.path, o.error)
                    continue
                self._failed_write(o, o.error)
            self._publish(o, layout, direct)

    def _write_native(
        self, op: BlockSave, layout: KVLayout, objects: list[_Object], staged: BlockAddressing | None = None
    ) -> None:
        """The op's blocks of ``objects`` written where each goes in its object's file, in one call on the
        native threads (``file_start``: each block's crc32c taken as it is written, the blocks cut between
        the threads); an object whose blocks did not all land takes the error (a full disk: ``ENOSPC``).
        From the KV, or from ``staged`` (a buffer holding the op's blocks in order)."""
        todo = [o for o in objects if o.hi > o.lo]
        if not todo:
            return
        payload = layout.num_layers * layout.block_bytes
        source = np.arange(len(op.block_ids)) if staged is not None else np.asarray(op.block_ids)
        ids = np.concatenate([source[o.lo : o.hi] for o in todo])
        runs = [(o.fd, o.header + o.head * payload, o.hi - o.lo) for o in todo]
        sums, whole, err = self._move_native(layout, ids, runs, write=True, addressing=staged)
        got = sums.tolist()
        at = 0
        for o in todo:
            n = o.hi - o.lo
            if at + n <= whole:
                o.sums[o.head :] = got[at : at + n]
            else:  # this object, and those after (a thread may have written some: not published, all the same)
                o.error = OSError(err or errno.EIO, os.strerror(err or errno.EIO))
            at += n

    def _move_native(
        self,
        layout: KVLayout,
        block_ids: Sequence[int],
        runs: Sequence[tuple[int, int, int]],
        *,
        write: bool,
        addressing: BlockAddressing | None = None,
    ) -> tuple[np.ndarray, int, int]:
        """:meth:`_start_move`, waited for: each block's crc32c (``uint32``), how many from the first moved
        whole, and the errno of a failure."""
        sums, whole, err = self._start_move(layout, block_ids, runs, write=write, addressing=addressing).checked()
        return np.frombuffer(sums, "<u4"), whole, err

    def _start_move(self, layout: KVLayout, block_ids: Sequence[int], runs: Sequence[tuple[int, int, int]], *,
                    write: bool, addressing: BlockAddressing | None = None) -> Any:  # fmt: skip
        """``block_ids`` of the KV read from (or written to) ``runs`` of consecutive blocks in files, each
        ``(fd, offset of its first block, blocks)``, started in one ``file_start`` on the native threads
        (its ``checked()`` waits and gives each block's crc32c, how many moved whole, and an errno). A run
        holds its blocks' pieces back to back, in :meth:`~kvbridge.layout.BlockAddressing.by_block`'s order:
        ``file_start`` places each piece in its file from that. ``addressing``: where the blocks are, when
        not in the KV (a staging buffer: :func:`~kvbridge.layout.staged_addressing`)."""
        assert self._native is not None
        where = addressing or layout.addressing()
        starts, lengths = where.first_block()  # file_start makes every block's pieces from block 0's (no numpy here)
        payload = layout.num_layers * layout.block_bytes
        return self._native.file_start(runs, starts, lengths, len(lengths), write=write, cut_bytes=2 * payload,
                                       block_ids=block_ids, block_stride=where.block_stride)  # fmt: skip

    def _open_head(self, o: _Object, layout: KVLayout) -> bool:
        """Open the object holding the first ``o.head`` blocks of ``o``'s chunk; ``False`` if it cannot serve."""
        path = self.path_of(o.keys[o.head - 1])
        try:
            fd, chunk = self._open(path, layout.fingerprint)
        except (OSError, Corrupted) as exc:
            log.debug("fs store: the first blocks of %s are gone (%s); not saved", o.path, exc)
            return False
        if chunk.keys[: o.head] != o.keys[: o.head]:  # it must start where the chunk does
            os.close(fd)
            return False
        o.source = _Read(path, fd, chunk, 0, o.head, 0)
        return True

    def _create(self, o: _Object, direct: int) -> None:
        folder = os.path.dirname(o.path)
        self._mkdir(folder)
        # a private name in the same directory: os.replace is atomic only within one filesystem
        o.tmp = os.path.join(folder, f".{os.path.basename(o.path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct
        try:
            try:
                o.fd = os.open(o.tmp, flags, 0o644)
            except FileNotFoundError:  # the directory was removed under us: make it again, once
                self._made.discard(folder)
                self._mkdir(folder)
                o.fd = os.open(o.tmp, flags, 0o644)
        except OSError as exc:
            o.error = exc

    def _publish(self, o: _Object, layout: KVLayout, direct: int) -> None:
        header = FORMAT.pack(o.keys, layout.fingerprint, o.sums, self._kind)
        try:
            if direct:
                buf = _aligned(len(header))
                buf[: len(header)] = np.frombuffer(header, dtype=np.uint8)
                _write_at(o.fd, [buf[: len(header)]], 0)
            else:
                _write_at(o.fd, [header], 0)
            if self.options.fsync:
                os.fsync(o.fd)
            os.close(o.fd)
            o.fd = -1
            os.replace(o.tmp, o.path)
            o.tmp = ""
        except OSError as exc:
            self._failed_write(o, exc)
        if self._usage is not None:
            self._usage += len(header) + len(o.keys) * layout.num_layers * layout.block_bytes
        folder = os.path.dirname(o.path)
        if self.options.fsync:  # make the rename itself durable
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        name = os.path.basename(o.path)
        target = os.path.join("..", name[:2], name)
        for key in o.keys[:-1]:
            self._link(self.path_of(key), target)

    def _link(self, path: str, target: str) -> None:
        """Make ``path`` a link to ``target`` (atomically replacing what is there: a shorter object of the
        same chunk, or a link to another object holding the block)."""
        try:
            if self._new_link(path, target):
                return
            with contextlib.suppress(OSError):
                if os.readlink(path) == target:
                    return
            tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            os.symlink(target, tmp)
            try:
                os.replace(tmp, path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            if exc.errno in _ENOSPC:
                raise StoreFull(f"fs store {self.root}: no space for the link {path} ({exc.strerror})") from exc
            raise

    def _new_link(self, path: str, target: str) -> bool:
        """Make ``path`` a link to ``target`` if nothing is there (its folder made again if it went);
        ``False`` if something is, another writer's link included, made in the meantime."""
        try:
            os.symlink(target, path)
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:
            self._made.discard(os.path.dirname(path))
            self._mkdir(os.path.dirname(path))
        try:  # once more, in the folder made again; another writer may have linked it first
            os.symlink(target, path)
            return True
        except FileExistsError:
            return False

    def _mkdir(self, folder: str) -> None:
        if folder not in self._made:
            os.makedirs(folder, exist_ok=True)
            self._made.add(folder)

    def _discard(self, o: _Object) -> None:
        """Close and remove what a save of ``o`` left behind (nothing, once it is published)."""
        if o.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(o.fd)
            o.fd = -1
        if o.tmp:
            with contextlib.suppress(OSError):
                os.unlink(o.tmp)
            o.tmp = ""
        if o.source is not None:
            with contextlib.suppress(OSError):
                os.close(o.source.fd)
            o.source = None

    def _failed_write(self, o: _Object, exc: BaseException) -> None:
        self._discard(o)
        if isinstance(exc, OSError) and exc.errno in _ENOSPC:
            raise StoreFull(f"fs store {self.root}: no space for {o.path} ({exc.strerror})") from exc
        raise exc

    def locate(self, key: bytes) -> tuple[str, int, int] | None:
        """Where ``key``'s block is stored: ``(object path, offset, length)`` of its bytes, or ``None`` (not
        stored, not readable, or no KV attached yet). For tools and fault injection; loads do not use it."""
        if self._views is None:
            return None
        path = self.path_of(key)
        try:
            fd, chunk = self._open(path, self._views[0].fingerprint)
        except (OSError, Corrupted):
            return None
        try:
            pos = chunk.keys.index(key) if key in chunk.keys else -1
        finally:
            os.close(fd)
        return None if pos < 0 else (os.path.realpath(path), chunk.offset(pos), chunk.payload)

    # -- bad objects -------------------------------------------------------------------------------
    def _reject(self, path: str, fd: int, bad: Corrupted, *, whole: bool = True) -> None:
        """Count and log a failed object; delete it if damaged (``whole=False``: only the link that led to it,
        which named a key the object does not hold)."""
        self.stats.add(corrupt=1)
        log.warning("fs store: %s is not loadable (%s)%s", path, bad, "; deleting it" if bad.damaged else "")
        if not bad.damaged:
            return
        with contextlib.suppress(OSError):
            link = os.path.islink(path)
            real = os.path.realpath(path)
            ours = os.path.commonpath([real, os.path.realpath(self.root)]) == os.path.realpath(self.root)
            # delete only the file we read (not one a writer has just put in its place), and only in the store:
            # a link planted to a file elsewhere costs that link, never that file
            if whole and ours and os.path.samestat(os.fstat(fd), os.stat(real)):
                os.unlink(real)
            if link:
                os.unlink(path)

    # -- capacity ------------------------------------------------------------------------------------
    def _refresh(self, path: str) -> bool:
        """Whether ``path`` exists; under a capacity, also make its object young again (it is still wanted)."""
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
        """(mtime, size, path) of every object under the root (v1 objects too); removes stale temporary
        files and links whose object is gone."""
        now = time.time()
        stack = [self.root]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except OSError:
                continue
            for entry in entries:
                try:
                    if entry.is_symlink():  # a locator: gone with its object, or a writer's that died
                        old = entry.name.startswith(".") and now - entry.stat(follow_symlinks=False).st_mtime > _STALE_TMP_S
                        if old or not os.path.exists(entry.path):
                            os.unlink(entry.path)
                        continue
                    if entry.is_dir():
                        stack.append(entry.path)
                        continue
                    st = entry.stat()
                except OSError:
                    continue
                if entry.name.startswith("."):
                    if entry.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    continue
                yield st.st_mtime, st.st_size, entry.path

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._staging.clear()
        self._views = None
        super().close()


class FsBackend(StoreBackend):
    """The ``fs`` store backend: an :class:`FsIndex` for the scheduler, an :class:`FsStore` per worker."""

    name = "fs"
    options_type = FsOptions

    def __init__(self, options: FsOptions):
        codec.require_checksum(options.checksum, "fs")
        writable_directory(options.path, "fs option 'path'")
        if options.o_direct:
            probe_o_direct(options.path)
        super().__init__(options)

    def open_index(self, engine: EngineInfo) -> FsIndex:
        return FsIndex(engine, self.options)

    def open_io(self, engine: EngineInfo) -> FsStore:
        return FsStore(engine, self.options)


BACKEND = FsBackend

__all__ = [
    "BACKEND",
    "HEADER_BYTES",
    "MAGIC",
    "VERSION",
    "FsBackend",
    "FsIndex",
    "FsOptions",
    "FsSave",
    "FsStore",
    "chunk_blocks",
    "chunk_end",
    "chunk_ends",
    "ends_chunk",
    "object_name",
    "probe_o_direct",
]
