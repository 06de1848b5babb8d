"""``lmcache`` — LMCache's storage backends as one more kvbridge tier (``pip install 'kvbridge[lmcache]'``).

kvbridge drives an LMCache ``StorageManager`` (LMCache 0.5.6) directly — no LMCache engine, no GPU
connector — so its local CPU arena, its local disk tier and its remote stores (the ``lm://`` server,
``redis://``, …: any ``remote_url`` LMCache understands) hold kvbridge blocks. It works alone or as a
tier of ``chain`` (e.g. ``cpu`` then ``lmcache``).

**What is shared with whom.** One ``StorageManager`` per process per set of options: every store of
this backend in a process with equal options (the scheduler side and the worker side of an engine,
several engines in a test) uses it, reference-counted, and the last one to close closes it. Its CPU
arena and its disk tier are private to that manager: LMCache indexes disk objects in memory, so
another process (or a restart) never sees them; the manager's *locators* (below) are private to it
too. Only a **remote** tier is shared across processes, and it is what makes this backend a hand-off
between engines; with the scheduler and the worker in different processes (vLLM), a lookup sees a
block only once it reached the remote tier. Without a ``remote_url`` the backend is an offload tier
for one process.

**Objects: one per chunk.** A save cuts its blocks into *chunks* as ``fs`` does: block ``i`` ends a
chunk when ``crc32(key) % C == 0`` (``C = chunk_tokens // block_size`` blocks, so chunks are ``C``
blocks long on average, as LMCache's own 256-token chunks), a property of the key alone, so every
engine and every tier of a chain cuts a prompt alike. Each run of a save's blocks inside one chunk is
one LMCache object — the whole chunk, or the part of it the save has: the prompt's last, unfinished
chunk is an object of its own (a later request for the same prompt hits all of it), and the next step
of a chunked prefill starts a new object where the last one ended (nothing is read back: the blocks
before it stay in the object of the step before). An object holds at most ``2 * C`` blocks (a
longer chunk is cut every ``2 * C`` blocks), so it fits the CPU arena, which must hold two of the
largest (:class:`~kvbridge.errors.ConfigError` at ``register`` otherwise).

An object is keyed by its **last block**: ``CacheEngineKey(model, world_size, rank, chunk_hash,
uint8)`` where ``model`` is ``<model_name>-<sha256(namespace)[:16]>-v2c<C>`` (safe for LMCache's
``@``/``%``-separated key string and its 150-character limit whatever the namespace; the format
version and ``C`` in it, so objects of format version 1 — one per block, written before — and of
another chunk size are never found: misses, never errors) and ``chunk_hash`` is that block's key
(hashed to 32 bytes when longer). The value is a uint8 tensor ``[1, 1, 1, n]`` in the chunk format
:data:`kvbridge.codec.LMCACHE_CHUNK` (version 2): a header (magic, version, checksum kind, the layout
fingerprint, per block its key and checksum, a checksum of the header itself), then the blocks, each
its bytes in every layer.

**Lookup: one** ``contains`` **per chunk.** The scheduler asks for the object keyed by each chunk's
last block (the last key asked about ends the last chunk); the first chunk that is not there is
searched by bisection for how far it goes, each probe asking whether a block is stored in *some*
object: the object ending at it, else its **locator** — this manager's map from a block to the object
holding it (written by its saves and loads, for its own tiers; bounded, the oldest forgotten first;
an entry counts only while its object is still there), or, with a remote, a 64-byte locator object
in the remote (written beside the chunk objects, for every block that does not end its object). So
a prompt that shares only part of a chunk with a stored one still hits that part, in about ``n/C +
log2(C)`` calls for ``n`` blocks. A hit says the object ending the chunk is there; a chunk split over
several objects (a long chunk, a chunked prefill) whose earlier object was evicted alone is offered
and then fails from that block (recomputed, never wrong bytes).

**Saves** allocate each object in LMCache's CPU arena and copy the blocks straight from the KV cache
into it (no staging buffer: with a KV in host memory one call on :mod:`kvbridge._core`'s native threads,
each block's crc32c taken beside its copy; else one ``index_select`` per layer into the object's
block-major view, then the checksums: ``crc32c`` where it can be computed (the native module or
``google-crc32c``), else ``crc32``), write the header, and put it at once, so LMCache's disk writer
stores one object while the next is filled.
The save then waits — bounded by ``timeout_s`` — until the disk and remote writes are done and the
remote answers for the last of them (``lm://`` puts are unacknowledged), so a consumer can see them
when the save returns. A full arena (nothing evictable) saves what fit and raises
:class:`~kvbridge.errors.StoreFull` for the rest, never waits; a remote tier that is down or dropped
writes fails the save (:class:`~kvbridge.errors.PeerUnreachable`); both are counted by the worker.

Measured on a 2-core VM beside LMCache's own engine on the same tier, in the same runs (Llama-3-8B
geometry, 128 MiB per request; ``benches/results/stores-2026-12-03b.txt``): on the arena alone, with the
native copy, save/load 6.5 / 6.6 GB/s against LMCache's 3.7 / 3.8; on the disk tier, loads 3.9 against
2.9 (saves swing up to 5x with which engine writes first: this VM's first touch of page-cache pages).
(Before the native copy, ``lmcache-chunks.txt``: arena 3.66-4.25 / 3.99-4.42; format 1, an object per
block with a staging copy each way: 0.53 / 0.84-0.96 on the disk tier.)

**Loads** find the object of each chunk (its locator, else the object ending the chunk, else the
remote locator), ``batched_get`` them from their tiers in batches that fit half the arena (LMCache
reads a disk or remote hit into the arena and, when it is full, waits for room forever), check each
header, and copy the blocks straight into the KV. With a KV in host memory and crc32c objects that is
one call on the native threads, each block's crc32c taken where it landed (as ``fs`` reads into the
KV: the blocks are the request's own, which the engine reads only after the report, and recomputes
if one failed); else each block's checksum is checked in the arena object *before* it is copied
(one copy per layer per object). A damaged block fails
from itself on: the blocks before it load, it and the blocks after it are reported failed (the
engine recomputes them), the object is counted in ``stats.corrupt`` and dropped from the tiers that
can delete (CPU, disk; the ``lm://`` server cannot). Objects of another layout are left alone. Every
object LMCache hands out is released (``ref_count_down``) whatever happens.

**Failures.** A dead remote is a miss for lookups and failed blocks for loads, never a hang: kvbridge
sets ``timeout_s`` on the ``lm://`` socket, drops a connection whose peer closed it, and reconnects at
most every ``reconnect_s`` (a bare LMCache ``StorageManager`` never does). Calls into one manager are
serialized (the ``lm://`` client multiplexes one socket without framing its replies).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import hashlib
import importlib.util
import itertools
import logging
import math
import os
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from kvbridge.connectors.fs import chunk_blocks, chunk_end, chunk_ends

from kvbridge import codec, native
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import (
    ClosedError,
    ConfigError,
    Corrupted,
    MissingDependency,
    PeerUnreachable,
    StoreFull,
    TransferTimeout,
)
from kvbridge.layout import KVLayout, block_words, coalesce, packed_offsets
from kvbridge.options import require, writable_directory
from kvbridge.staging import StagingPool
from kvbridge.store import StoreBackend, StoreIndex, StoreIO

_HINT = "pip install 'kvbridge[lmcache]'"
# find_spec costs nothing (importing LMCache takes 3-10 s): `kvbridge backends` stays fast, and tells the truth
if importlib.util.find_spec("lmcache") is None:
    raise MissingDependency(f"the lmcache backend needs LMCache: {_HINT}")

log = logging.getLogger(__name__)

FORMAT = codec.LMCACHE_CHUNK
MAGIC = FORMAT.magic
VERSION = FORMAT.version
HEADER_BYTES = FORMAT.align  # the unit of a header's length (a chunk object's header is a multiple of it)
_KEY_LIMIT = 150  # LMCache asserts on longer key strings
_MAX_HASH = 32  # longer block keys are hashed to this many bytes (the header keeps the full key)
_MAX_BLOCKS = 0xFFFF  # blocks per object the header can count
_MODEL_NAME = re.compile(r"[A-Za-z0-9._-]{1,40}")
_REMOTE = "RemoteBackend"
_DELETABLE = ("LocalCPUBackend", "LocalDiskBackend")
_MIN_LOCATORS, _MAX_LOCATORS = 1 << 14, 1 << 20  # block -> object entries a manager keeps (as its tiers hold blocks)
# a locator object in the remote: magic, version, blocks in the object, the block's position in it, length of the
# object's chunk hash, a digest of the block key, the object's chunk hash (zero-padded)
_LOCATOR = struct.Struct("<8sHHHH16s32s")
_LOCATOR_MAGIC = b"KVBRLL\r\n"


@dataclasses.dataclass(frozen=True)
class LMCacheOptions:
    """Which LMCache tiers hold the blocks, and how long to wait for them.

    ``remote_url``: an LMCache remote (``lm://host:port``, ``redis://host:port``, …); the only tier
    shared across processes. ``local_cpu_bytes``: LMCache's CPU arena, allocated up front; every
    object passes through it, so it must hold two of the largest (``2 * chunk_tokens`` tokens of KV
    each). ``cpu_cache``: also keep saved and loaded objects in that arena (a hot tier, LRU-evicted);
    off, it is only a staging buffer. ``local_disk`` + ``local_disk_bytes``: a disk tier in that
    directory (private to the process). ``model_name``: a readable label in every LMCache key (the
    namespace digest follows it). ``timeout_s``: the longest a save waits for its writes, and a remote
    call for its reply. ``reconnect_s``: how often to retry a remote that went away. ``checksum``:
    ``crc32`` or ``crc32c`` (hardware: the native module or ``google-crc32c``; the default where either is);
    readers verify whichever kind an object names. ``chunk_tokens``: tokens per object on average (in
    whole blocks, at least one); engines find each other's objects only with the same number of blocks
    per chunk.
    """

    remote_url: str = ""
    local_cpu_bytes: int = 1 << 30
    cpu_cache: bool = True
    local_disk: str = ""
    local_disk_bytes: int = 0
    model_name: str = "kvbridge"
    timeout_s: float = 30.0
    reconnect_s: float = 10.0
    checksum: Literal["crc32", "crc32c"] = dataclasses.field(default_factory=codec.default_checksum)
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        require(
            not self.remote_url or re.match(r"[a-z][a-z0-9+.-]*://", self.remote_url) is not None,
            f"lmcache option 'remote_url' must look like lm://host:port, got {self.remote_url!r}",
        )
        require(self.local_cpu_bytes >= 1 << 20, f"lmcache option 'local_cpu_bytes' must be >= 1 MiB, got {self.local_cpu_bytes}")
        require(
            "," not in self.local_disk,  # LMCache reads the path as a comma-separated list
            f"lmcache option 'local_disk' must be one directory, got {self.local_disk!r}",
        )
        require(
            (self.local_disk_bytes > 0) == bool(self.local_disk),
            "lmcache options 'local_disk' and 'local_disk_bytes' (> 0) go together",
        )
        require(
            _MODEL_NAME.fullmatch(self.model_name) is not None,
            f"lmcache option 'model_name' must be 1-40 of [A-Za-z0-9._-], got {self.model_name!r}",
        )
        require(self.timeout_s > 0, f"lmcache option 'timeout_s' must be > 0, got {self.timeout_s}")
        require(self.reconnect_s >= 0, f"lmcache option 'reconnect_s' must be >= 0, got {self.reconnect_s}")
        require(
            isinstance(self.chunk_tokens, int) and 1 <= self.chunk_tokens <= 1 << 15,
            f"lmcache option 'chunk_tokens' must be in [1, 32768], got {self.chunk_tokens!r}",
        )


# -- LMCache, imported once and lazily -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _LMCache:
    CacheEngineKey: Any
    Config: Any
    EventManager: Any
    KV_2LTD: Any
    Metadata: Any
    StorageManager: Any


_LIB: _LMCache | None = None


def quiet_environment() -> None:
    """What LMCache reads when imported: no usage tracking, warnings only (a user's own settings win)."""
    for name, value in (("LMCACHE_TRACK_USAGE", "false"), ("DO_NOT_TRACK", "1"), ("LMCACHE_LOG_LEVEL", "WARNING")):
        os.environ.setdefault(name, value)


def _lmcache() -> _LMCache:
    global _LIB
    if _LIB is None:
        quiet_environment()
        try:
            from lmcache.utils import CacheEngineKey
            from lmcache.v1.config import LMCacheEngineConfig
            from lmcache.v1.event_manager import EventManager
            from lmcache.v1.memory_management import MemoryFormat
            from lmcache.v1.metadata import LMCacheMetadata
            from lmcache.v1.storage_backend.storage_manager import StorageManager
        except ImportError as exc:
            raise MissingDependency(f"LMCache is installed but does not import ({exc}); {_HINT}") from exc
        _LIB = _LMCache(CacheEngineKey, LMCacheEngineConfig, EventManager, MemoryFormat.KV_2LTD, LMCacheMetadata, StorageManager)
    return _LIB


# -- one StorageManager per process per options ----------------------------------------------------
def _socket_of(connection: Any) -> socket.socket | None:
    """The ``lm://`` client's socket (LMCache wraps the connector in an instrumented one), if any."""
    for conn in (connection, getattr(connection, "_connector", None)):
        sock = getattr(conn, "client_socket", None)
        if isinstance(sock, socket.socket):
            return sock
    return None


class _Manager:
    """A ``StorageManager``, its users, the lock that serializes calls into it, remote upkeep."""

    def __init__(self, options: LMCacheOptions):
        lib = _lmcache()
        self.options = options
        disk = {}
        if options.local_disk:
            disk = {"local_disk": os.path.join(options.local_disk, ""), "max_local_disk_size": options.local_disk_bytes / 2**30}
        config = lib.Config.from_defaults(
            local_cpu=options.cpu_cache,
            max_local_cpu_size=options.local_cpu_bytes / 2**30,
            remote_url=options.remote_url or None,
            remote_serde="naive",  # bytes as they are: kvbridge blocks are opaque to LMCache
            blocking_timeout_secs=max(1, math.ceil(options.timeout_s)),
            **disk,
        )
        metadata = lib.Metadata(
            model_name=options.model_name, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.uint8, kv_shape=(1, 1, 1, 1, 1),  # a sizing hint only, on this path
        )
        self.sm = lib.StorageManager(config, metadata, lib.EventManager())
        self.lock = threading.Lock()
        self.users = 0
        # locators of this manager's tiers: block key -> (key of the object holding it, its blocks, the block's place)
        self.where: collections.OrderedDict[Any, tuple[Any, int, int]] = collections.OrderedDict()
        self.where_cap = _MIN_LOCATORS
        self._next_connect = 0.0
        self._arm_socket()

    @property
    def remote(self) -> Any:
        return self.sm.storage_backends.get(_REMOTE)

    def _arm_socket(self) -> None:
        remote = self.remote
        sock = _socket_of(getattr(remote, "connection", None))
        if sock is not None:  # a blocking recv without a timeout hangs LMCache's loop on a stalled server
            sock.settimeout(self.options.timeout_s)

    def check_remote(self) -> bool:
        """Before a call (with :attr:`lock` held): drop a dead ``lm://`` connection, retry a missing one
        (at most every ``reconnect_s``). Whether a remote connection is up now."""
        remote = self.remote
        if remote is None:
            return False
        sock = _socket_of(remote.connection)
        if sock is not None:
            try:  # between calls nothing may be readable: EOF (peer gone) or stray bytes both end the stream
                if select.select([sock], [], [], 0)[0]:
                    raise OSError(f"lmcache remote {self.options.remote_url}: connection closed or out of step")
            except (OSError, ValueError) as exc:
                log.warning("%s; reconnecting at most every %ss", exc, self.options.reconnect_s)
                with contextlib.suppress(OSError):
                    sock.close()
                remote.connection = None
                self._next_connect = time.monotonic() + self.options.reconnect_s
        if remote.connection is None and time.monotonic() >= self._next_connect:
            self._next_connect = time.monotonic() + self.options.reconnect_s
            remote.failure_time = -1e9  # LMCache's own back-off would refuse to retry
            remote.init_connection()
            self._arm_socket()
        return remote.connection is not None

    def remember(self, obj_key: Any, block_keys: Sequence[Any]) -> None:
        """Note (with :attr:`lock` held) that the object ``obj_key`` holds ``block_keys``, in order."""
        where, n = self.where, len(block_keys)
        for pos, key in enumerate(block_keys):
            where[key] = (obj_key, n, pos)
            where.move_to_end(key)
        while len(where) > self.where_cap:
            where.popitem(last=False)

    def drain(self, keys: Sequence[Any]) -> None:
        """Wait until no tier still writes ``keys`` (LMCache's puts to disk and remote are fire-and-forget)."""
        deadline = time.monotonic() + self.options.timeout_s
        pause = 0.0002
        for backend in self.sm.storage_backends.values():
            for key in keys:
                while backend.exists_in_put_tasks(key):
                    if time.monotonic() > deadline:
                        raise TransferTimeout(f"lmcache: {backend} still writing after {self.options.timeout_s}s")
                    time.sleep(pause)
                    pause = min(pause * 2, 0.001)

    def close(self) -> None:
        self.sm.close()  # stops and joins LMCache's (non-daemon) event-loop thread


_MANAGERS: dict[LMCacheOptions, _Manager] = {}
_MANAGERS_LOCK = threading.Lock()


def _acquire(options: LMCacheOptions) -> _Manager:
    with _MANAGERS_LOCK:
        manager = _MANAGERS.get(options)
        if manager is None:
            manager = _MANAGERS[options] = _Manager(options)
        manager.users += 1
        return manager


def _release(manager: _Manager) -> None:
    with _MANAGERS_LOCK:
        manager.users -= 1
        if manager.users > 0:
            return
        _MANAGERS.pop(manager.options, None)
    manager.close()


def _close_all() -> None:
    """Safety net at exit: a manager left open keeps a non-daemon thread that would hang the interpreter."""
    with _MANAGERS_LOCK:
        managers = list(_MANAGERS.values())
        _MANAGERS.clear()
    for manager in managers:
        with contextlib.suppress(Exception):
            manager.close()


# threading joins non-daemon threads *before* atexit handlers run; its own hook runs before that join
getattr(threading, "_register_atexit", atexit.register)(_close_all)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _layer_views(layout: KVLayout) -> list[torch.Tensor] | None:
    """Per layer, a view ``[num_blocks, ...]`` of the KV that moves a block as plain integers: rows of int64
    words where a block is one stretch of memory (faster copies), else the block's own shape as integers of
    the element's width (``kv_first``: K and V apart). ``None`` for a KV that is not in host memory."""
    if layout.device_type != "cpu":
        return None
    views = []
    for v in layout.layers:
        rows = block_words(v)
        if rows is None:
            bits = _BITS[v.element_size()]
            rows = v if v.dtype == bits else v.view(bits)
        views.append(rows)
    return views


def _object_side(kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` (uint8 ``[k, block_bytes]``, one layer's bytes of ``k`` blocks in an object, rows may be
    apart) viewed to match ``kv`` (a :func:`_layer_views` entry): the same dtype and block shape."""
    return blocks.view(kv.dtype).view(blocks.shape[0], *kv.shape[1:])


@dataclasses.dataclass
class _Want:
    """An object a load reads: its key and tier, the load's block ``at`` it should hold, how many blocks of
    the load it should hold from there, its size at most, and whether it was found by the chunk's end alone."""

    key: Any
    tier: str
    at: int
    count: int
    nbytes: int
    by_end: bool


class _Handle:
    """One engine side's view of its (shared) LMCache ``StorageManager``: its keys, chunks and session."""

    engine: EngineInfo

    def __init__(self, engine: EngineInfo, options: LMCacheOptions):
        self.options = options
        self._lib = _lmcache()
        self.chunk = chunk_blocks(engine.block_size, options.chunk_tokens)
        self.max_blocks = 1 if self.chunk == 1 else min(2 * self.chunk, _MAX_BLOCKS)
        ns = hashlib.sha256(engine.namespace.encode()).hexdigest()[:16]
        self._model = f"{options.model_name}-{ns}-v{VERSION}c{self.chunk}"
        self._locator_model = f"{self._model}-l"
        longest = self._lib.CacheEngineKey(self._locator_model, engine.kv_world_size, engine.kv_rank, bytes(_MAX_HASH), torch.uint8)
        if len(longest.to_string()) > _KEY_LIMIT:
            raise ConfigError(f"lmcache keys of {self._model!r} would exceed LMCache's {_KEY_LIMIT} characters")
        self._manager: _Manager | None = _acquire(options)

    @property
    def storage_manager(self) -> Any:
        """The LMCache ``StorageManager`` behind this store (shared; for diagnostics and tests)."""
        return self._open().sm

    @staticmethod
    def _hash(key: bytes) -> bytes:
        return key if 0 < len(key) <= _MAX_HASH else hashlib.blake2b(key, digest_size=_MAX_HASH).digest()

    def lmcache_key(self, key: bytes) -> Any:
        """The LMCache ``CacheEngineKey`` of the object that ends with block ``key`` (of this engine's
        namespace, chunk size and rank); also what a manager's locators know the block by."""
        return self._lib.CacheEngineKey(self._model, self.engine.kv_world_size, self.engine.kv_rank, self._hash(key), torch.uint8)

    def locator_key(self, key: bytes) -> Any:
        """The LMCache key of block ``key``'s locator object in the remote tier."""
        return self._lib.CacheEngineKey(self._locator_model, self.engine.kv_world_size, self.engine.kv_rank, self._hash(key),
                                        torch.uint8)

    def _open(self) -> _Manager:
        if self._manager is None:
            raise ClosedError("lmcache store is closed")
        return self._manager

    @contextlib.contextmanager
    def _session(self) -> Iterator[_Manager]:
        manager = self._open()
        with manager.lock:
            manager.check_remote()
            yield manager

    @staticmethod
    def _remote_up(m: _Manager) -> bool:
        return m.remote is not None and m.remote.connection is not None

    def _holder(self, m: _Manager, key: bytes) -> tuple[Any, int, int] | None:
        """Where block ``key`` is, by a locator: ``(object key, its blocks, the block's place)`` of an object
        that is there now; ``None`` if no locator names one. The manager's own, then the remote's."""
        held = m.where.get(self.lmcache_key(key))
        if held is not None and m.sm.contains(held[0]) is not None:
            return held
        if not self._remote_up(m) or m.sm.contains(self.locator_key(key), search_range=[_REMOTE]) is None:
            return None
        got = m.sm.batched_get([self.locator_key(key)], location=_REMOTE) or [None]
        obj = got[0]
        if obj is None:
            return None
        try:
            raw = obj.tensor.view(-1).numpy().tobytes() if obj.tensor is not None else b""
        finally:
            obj.ref_count_down()
        if len(raw) < _LOCATOR.size:
            return None
        magic, version, count, pos, length, digest, chunk = _LOCATOR.unpack_from(raw)
        if magic != _LOCATOR_MAGIC or version != VERSION or digest != codec.key_digest(key) or not pos < count:
            log.debug("lmcache: the remote locator of a block is not one (%r); ignored", raw[:16])
            return None
        if not 0 < length <= _MAX_HASH:
            return None
        target = self._lib.CacheEngineKey(self._model, self.engine.kv_world_size, self.engine.kv_rank, chunk[:length], torch.uint8)
        if m.sm.contains(target) is None:
            return None
        return target, count, pos

    def close(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            _release(manager)


class LMCacheIndex(_Handle, StoreIndex):
    """Scheduler side: which keys LMCache holds, from the first; one ``contains`` per chunk (module docstring)."""

    def __init__(self, engine: EngineInfo, options: LMCacheOptions):
        StoreIndex.__init__(self, engine)
        _Handle.__init__(self, engine, options)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        with self._session() as m:  # (LMCache answers a failed remote as a miss)
            n = 0
            for end in chunk_ends(keys, self.chunk):  # n is where this chunk starts
                if m.sm.contains(self.lmcache_key(keys[end])) is not None:  # the object ending the chunk is there
                    n = end + 1
                    continue
                if not self._stored(m, keys[n]):
                    return n
                if end == n:
                    n += 1
                    continue
                # the chunk's first block here is stored, its last is not: bisect. A block in an object proves the
                # blocks before it in its chunk (saved with it, or before it by the same prompt).
                lo, hi = n, end
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if self._stored(m, keys[mid]):
                        lo = mid
                    else:
                        hi = mid
                return lo + 1
            return n

    def _stored(self, m: _Manager, key: bytes) -> bool:
        """Whether block ``key`` is in some object: one ending with it, or one a locator names."""
        if m.sm.contains(self.lmcache_key(key)) is not None:
            return True
        held = m.where.get(self.lmcache_key(key))
        if held is not None and m.sm.contains(held[0]) is not None:
            return True
        return self._remote_up(m) and m.sm.contains(self.locator_key(key), search_range=[_REMOTE]) is not None


class LMCacheStore(_Handle, StoreIO):
    """Worker side: chunk objects in and out of LMCache. See the module docstring."""

    def __init__(self, engine: EngineInfo, options: LMCacheOptions):
        StoreIO.__init__(self, engine)
        _Handle.__init__(self, engine, options)
        self._kind = codec.CHECKSUMS[options.checksum]
        self._staging = StagingPool()  # a KV that is not in host memory: gathered and scattered through host buffers
        self._views: tuple[KVLayout, list[torch.Tensor] | None] | None = None
        self._native = native.load_core()[0]  # kvbridge._core where built: a KV in host memory copied by address

    # -- geometry ------------------------------------------------------------------------------------
    def attach(self, layout: KVLayout) -> None:
        biggest = self._object_bytes(layout, self.max_blocks)
        if 2 * biggest > self.options.local_cpu_bytes or biggest >= 1 << 31:
            raise ConfigError(
                f"lmcache: an object holds up to {self.max_blocks} blocks ({biggest} bytes: chunk_tokens="
                f"{self.options.chunk_tokens}, block_size={layout.fingerprint.block_size}); local_cpu_bytes="
                f"{self.options.local_cpu_bytes} must hold two (raise it, or lower chunk_tokens), and LMCache's wire "
                "format stays under 2 GiB"
            )
        payload = layout.num_layers * layout.block_bytes
        local = (self.options.local_cpu_bytes if self.options.cpu_cache else 0) + self.options.local_disk_bytes
        m = self._open()
        with m.lock:  # room for a locator per block the local tiers can hold, twice over
            m.where_cap = max(m.where_cap, min(_MAX_LOCATORS, 2 * local // max(1, payload)))
        self._layer_views(layout)

    def _layer_views(self, layout: KVLayout) -> list[torch.Tensor] | None:
        if self._views is None or self._views[0] is not layout:
            self._views = (layout, _layer_views(layout))
        return self._views[1]

    @staticmethod
    def _object_bytes(layout: KVLayout, blocks: int) -> int:
        """The most bytes an object of ``blocks`` blocks takes (keys of up to 64 bytes)."""
        return FORMAT.header_length([bytes(64)] * blocks, layout.fingerprint) + blocks * layout.num_layers * layout.block_bytes

    def _pieces(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """The objects a save of ``keys`` writes, as ``[a, b)`` ranges: cut where a block ends a chunk, every
        :attr:`max_blocks` blocks, and at the end."""
        out = []
        a = 0
        for end in chunk_ends(keys, self.chunk):
            while a <= end:  # a chunk longer than max_blocks is cut into several objects
                b = min(end + 1, a + self.max_blocks)
                out.append((a, b))
                a = b
        return out

    # -- saves ---------------------------------------------------------------------------------------
    def save(self, op: BlockSave, layout: KVLayout) -> None:
        if not op.keys:
            return
        ids = layout.check_range(op.block_ids)
        if self._layer_views(layout) is None:  # not in host memory: gathered over once, copied from there
            with self._staging.gathered(layout, op.block_ids) as host:
                self._store(op, layout, ids, host)
        else:
            self._store(op, layout, ids, None)

    def _store(self, op: BlockSave, layout: KVLayout, ids: np.ndarray, host: torch.Tensor | None) -> None:
        lkeys = [self.lmcache_key(k) for k in op.keys]
        pieces = self._pieces(op.keys)
        with self._session() as m:
            up = m.remote is None or m.remote.connection is not None
            failed_before = m.remote.put_failed_count if m.remote is not None else 0
            put: list[int] = []  # pieces handed to LMCache (it owns those objects now)
            try:
                for p, (a, b) in enumerate(pieces):
                    obj = self._allocate(m, FORMAT.header_length(op.keys[a:b], layout.fingerprint) + (b - a) * layout.num_layers
                                         * layout.block_bytes)
                    if obj is None and put:  # the arena is full of this save's writes: let them land, then retry
                        m.drain([lkeys[pieces[q][1] - 1] for q in put])
                        obj = self._allocate(m, FORMAT.header_length(op.keys[a:b], layout.fingerprint)
                                             + (b - a) * layout.num_layers * layout.block_bytes)
                    if obj is None:
                        raise StoreFull(
                            f"lmcache: CPU arena ({self.options.local_cpu_bytes} B) has no room for an object of {b - a} "
                            f"blocks; saved {a} of {len(op.keys)} blocks of {op.request_id}"
                        )
                    try:
                        self._fill(obj, op.keys[a:b], ids[a:b], layout, None if host is None else host[:, a:b])
                    except BaseException:
                        obj.ref_count_down()
                        raise
                    m.sm.batched_put([lkeys[b - 1]], [obj])  # at once: LMCache writes it while the next is filled
                    put.append(p)
            finally:
                ends = [lkeys[pieces[q][1] - 1] for q in put]
                if ends:
                    m.drain(ends)
                    # A finished put was only *sent*: the lm:// protocol has no acknowledgement, and a reader on
                    # another connection could ask before the server took it. The server answers one connection in
                    # order, so a lookup of the last key on ours returns once every put before it landed.
                    self._locate_saved(m, [pieces[q] for q in put], op.keys, lkeys)
            if m.remote is not None and (not up or m.remote.connection is None or m.remote.put_failed_count > failed_before):
                raise PeerUnreachable(f"lmcache remote {self.options.remote_url} did not take the blocks of {op.request_id}")

    def _allocate(self, m: _Manager, nbytes: int) -> Any:
        return m.sm.allocate(torch.Size([1, 1, 1, nbytes]), torch.uint8, fmt=self._lib.KV_2LTD, eviction=True, busy_loop=False)

    def _fill(self, obj: Any, keys: Sequence[bytes], ids: np.ndarray, layout: KVLayout, host: torch.Tensor | None) -> None:
        """Write blocks ``ids`` (keys ``keys``) into ``obj``: straight from the KV (or ``host``), then their
        checksums and the header."""
        k, payload = len(keys), layout.num_layers * layout.block_bytes
        flat = obj.tensor.view(-1)
        start = FORMAT.header_length(keys, layout.fingerprint)
        body = flat[start : start + k * payload].view(k, layout.num_layers, layout.block_bytes)
        views = self._layer_views(layout)
        checked = None  # each block's crc32c, where the native copy took it
        if host is not None or views is None:
            assert host is not None
            body.copy_(host.transpose(0, 1))
        elif (checked := self._native_copy(layout, ids, body.data_ptr(), into_object=True,
                                           checked=self._kind == codec.CRC32C)) is None:  # fmt: skip
            runs = coalesce(ids)
            idx = None if len(runs) == 1 else torch.from_numpy(ids)
            for layer, kv in enumerate(views):
                dst = _object_side(kv, body[:, layer])
                if idx is None:
                    dst.copy_(kv.narrow(0, runs[0][0], k))
                else:
                    torch.index_select(kv, 0, idx, out=dst)
        arr = flat.numpy()
        if checked is None or not len(checked):
            checked = codec.block_checksums(self._kind, arr[start : start + k * payload].reshape(k, payload))
        sums = checked.tolist()
        arr[:start] = np.frombuffer(FORMAT.pack(keys, layout.fingerprint, sums, self._kind), dtype=np.uint8)

    def _locate_saved(self, m: _Manager, pieces: Sequence[tuple[int, int]], keys: Sequence[bytes], lkeys: Sequence[Any]) -> None:
        """After a save's puts: this manager's locators for its blocks, and the remote's (then the remote's
        answer for the last of them, which comes once every put before it landed)."""
        local = [name for name in m.sm.storage_backends if name != _REMOTE]
        for a, b in pieces:
            obj_key = lkeys[b - 1]
            if m.where.keys().isdisjoint(lkeys[a:b]):  # the common case, blocks no object held: one update in C
                m.where.update(zip(lkeys[a:b], zip(itertools.repeat(obj_key), itertools.repeat(b - a), range(b - a))))
                continue
            for pos in range(b - a):
                held = m.where.get(lkeys[a + pos])
                if held is not None and held[0] != obj_key and local and m.sm.contains(held[0], search_range=local) is not None:
                    continue  # it is in an object that is still here (LMCache keeps the first object put under a key)
                m.where[lkeys[a + pos]] = (obj_key, b - a, pos)
                m.where.move_to_end(lkeys[a + pos])
        while len(m.where) > m.where_cap:
            m.where.popitem(last=False)
        last = lkeys[pieces[-1][1] - 1]
        if not self._remote_up(m):
            return
        locators, objs = [], []
        try:
            for a, b in pieces:
                chunk = self._hash(keys[b - 1])
                for pos in range(b - a - 1):  # the block ending an object is found by the object itself
                    obj = self._allocate(m, _LOCATOR.size)
                    if obj is None:
                        break
                    objs.append(obj)
                    raw = _LOCATOR.pack(_LOCATOR_MAGIC, VERSION, b - a, pos, len(chunk), codec.key_digest(keys[a + pos]), chunk)
                    obj.tensor.view(-1).numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
                    locators.append(self.locator_key(keys[a + pos]))
        except BaseException:
            for obj in objs:
                obj.ref_count_down()
            raise
        if locators:
            m.sm.batched_put(locators, objs, location=_REMOTE)
            m.drain(locators)
            last = locators[-1]
        if self._remote_up(m) and m.sm.contains(last, search_range=[_REMOTE]) is None:
            raise PeerUnreachable(f"lmcache remote {m.options.remote_url} does not hold what was just put")

    # -- loads ---------------------------------------------------------------------------------------
    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        if not op.keys:
            return op.block_ids
        ids = layout.check_range(op.block_ids)
        if self._layer_views(layout) is None:  # not in host memory: through a host buffer, one scatter at the end
            with self._staging.lend(layout, len(ids)) as host:
                good = self._fetch(op, layout, ids, host)
                if good:
                    layout.scatter(op.block_ids[:good], host[:, :good].to(layout.device))
        else:
            good = self._fetch(op, layout, ids, None)
        return op.block_ids[good:]

    def _find(self, m: _Manager, keys: Sequence[bytes], i: int, tried: set[int], layout: KVLayout) -> _Want | None:
        """The object to read block ``keys[i]`` of a load from: its locator's, else the one ending its chunk."""
        held = m.where.get(self.lmcache_key(keys[i]))
        if held is None or m.sm.contains(held[0]) is None:
            held = None
            if i not in tried:
                end = chunk_end(keys, i, self.chunk)
                key = self.lmcache_key(keys[end])
                tier = m.sm.contains(key)
                if tier is not None:
                    return _Want(key, tier, i, end - i + 1, self._object_bytes(layout, self.max_blocks), True)
            held = self._holder(m, keys[i])
            if held is None:
                return None
        key, count, pos = held
        tier = m.sm.contains(key)
        if tier is None:
            return None
        return _Want(key, tier, i, max(1, min(count - pos, len(keys) - i)), self._object_bytes(layout, count), False)

    def _fetch(self, op: BlockLoad, layout: KVLayout, ids: np.ndarray, host: torch.Tensor | None) -> int:
        """Copy the blocks of ``op`` that pass their checks into the KV (or ``host``), from the first; how many."""
        # LMCache reads a disk or remote hit into its CPU arena and, when the arena is full, waits for room
        # forever: fetch in batches that fit in half of it, and give each batch back before the next.
        budget = self.options.local_cpu_bytes // 2
        n, good = len(op.keys), 0
        tried: set[int] = set()  # blocks the object ending their chunk turned out not to hold
        with self._session() as m:
            for _ in range(2 * n + 2):  # each round loads a block, or rules a way to one out, or ends
                if good >= n:
                    break
                plan: list[_Want] = []
                used, i = 0, good
                while i < n:
                    want = self._find(m, op.keys, i, tried, layout)
                    if want is None or (plan and used + want.nbytes > budget):
                        break
                    plan.append(want)
                    used += want.nbytes
                    i += want.count
                if not plan:
                    break
                got: list[Any] = []
                try:
                    for tier, group in _runs(plan):  # one batched_get per run of objects in the same tier
                        objs = m.sm.batched_get([w.key for w in group], location=tier) or []
                        got.extend([*objs, *[None] * (len(group) - len(objs))][: len(group)])
                    go_on = True
                    for want, obj in zip(plan, got):
                        if want.at != good:  # an object held fewer of the load's blocks than its locator said
                            break
                        if obj is None:  # gone since it was found (evicted, a dead remote)
                            go_on = False
                            break
                        taken, go_on = self._take(m, want, obj, op, layout, ids, host, tried)
                        good += taken
                        if not go_on or taken < want.count:
                            break
                finally:
                    for obj in got:
                        if obj is not None:
                            obj.ref_count_down()
                if not go_on:
                    break
        return good

    def _take(self, m: _Manager, want: _Want, obj: Any, op: BlockLoad, layout: KVLayout, ids: np.ndarray,
              host: torch.Tensor | None, tried: set[int]) -> tuple[int, bool]:
        """Check object ``obj`` and copy the load's blocks it holds from ``want.at`` on; ``(blocks copied,
        whether the load may go on)``."""
        i = want.at
        try:
            t = obj.tensor
            if t is None or t.dtype != torch.uint8 or not t.is_contiguous():
                raise Corrupted(f"not a kvbridge object ({None if t is None else (t.dtype, tuple(t.shape))})", damaged=True)
            flat = t.view(-1)
            arr = flat.numpy()
            size = int(flat.numel())
            length = FORMAT.header_bytes(arr[: min(size, codec.MAX_HEADER)], size)
            chunk = FORMAT.parse(arr[:length], fingerprint=layout.fingerprint, size=size)
            if self.lmcache_key(chunk.keys[-1]) != want.key:
                raise Corrupted("object holds another key", damaged=True)
        except Corrupted as bad:
            self._reject(m, want.key, want.tier, bad)
            return 0, False
        m.remember(want.key, [self.lmcache_key(k) for k in chunk.keys])
        key = op.keys[i]
        if key not in chunk.keys:  # an object of a later part of the chunk: the block is elsewhere, or nowhere
            if want.by_end:
                tried.add(i)
                return 0, True
            return 0, False
        pos = chunk.keys.index(key)
        count = 1
        while pos + count < len(chunk.keys) and i + count < len(op.keys) and chunk.keys[pos + count] == op.keys[i + count]:
            count += 1
        body = flat[chunk.header_bytes :].view(len(chunk.keys), layout.num_layers, layout.block_bytes)[pos : pos + count]
        landed = None
        if host is None and chunk.kind == codec.CRC32C:  # copied into the KV, each block checked where it landed
            landed = self._native_copy(layout, ids[i : i + count], body.data_ptr(), into_object=False, checked=True)
        if landed is not None:  # (a block that failed is in the request's own KV, which recomputes it)
            good = chunk.matching(pos, landed)
        else:  # each block checked before it is copied, all in one call
            good = chunk.first_bad(pos, arr[chunk.offset(pos) : chunk.offset(pos + count)].reshape(count, chunk.payload))
            if good:
                self._scatter(layout, ids[i : i + good], body[:good], None if host is None else host[:, i : i + good])
        if good < count:
            self._reject(m, want.key, want.tier, chunk.mismatch(pos + good))
        return good, good == count

    def _scatter(self, layout: KVLayout, ids: np.ndarray, body: torch.Tensor, host: torch.Tensor | None) -> None:
        """Copy ``body`` (uint8 ``[k, num_layers, block_bytes]``, in an object) into blocks ``ids`` (or ``host``)."""
        if host is not None:
            host.copy_(body.transpose(0, 1))
            return
        if self._native_copy(layout, ids, body.data_ptr(), into_object=False) is not None:
            return
        views = self._layer_views(layout)
        assert views is not None
        runs = coalesce(ids)
        for layer, kv in enumerate(views):  # numpy's fancy assignment: ~1.7x torch's index_copy_ on the CPU
            dst, src = kv.numpy(), _object_side(kv, body[:, layer]).numpy()
            if len(runs) == 1:
                dst[runs[0][0] : runs[0][0] + len(ids)] = src
            else:
                dst[ids] = src

    def _native_copy(
        self, layout: KVLayout, ids: np.ndarray, at: int, *, into_object: bool, checked: bool = False
    ) -> np.ndarray | None:
        """Blocks ``ids`` of a KV in host memory copied into (or out of) an object's body at address ``at``,
        block after block as the object holds them, in one call on kvbridge's native threads (memcpy, cut
        between them from 8 MiB): a Python copy per layer took 1.1 ms of an 8 MiB load here. ``checked``:
        each block's crc32c taken where it landed, beside its copy (``uint32``; else empty). ``None``
        where that module is not built (the caller copies)."""
        if self._native is None or not len(ids) or (checked and not self._native.HAS_CRC32C):
            return None
        kv, lengths = layout.addressing().by_block(ids)
        body = np.uint64(at) + packed_offsets(lengths)
        src, dst = (kv, body) if into_object else (body, kv)
        if not checked:
            self._native.copy_start(src, dst, lengths).result()
            return np.zeros(0, np.uint32)
        sums, _, _ = self._native.copy_start(src, dst, lengths, parts=len(lengths) // len(ids)).checked()
        return np.frombuffer(sums, "<u4")[: len(ids)]

    def _reject(self, m: _Manager, key: Any, tier: str, bad: Corrupted) -> None:
        self.stats.add(corrupt=1)
        log.warning("lmcache store: object %s in %s is not loadable (%s)", key.to_string(), tier, bad)
        if bad.damaged:  # the remote cannot delete; CPU (a write-back copy) and disk can
            m.sm.remove(key, locations=list(_DELETABLE))

    def locate(self, key: bytes) -> tuple[Any, int, int] | None:
        """Where block ``key`` is stored: ``(LMCache key of its object, offset, length)`` of its bytes in the
        object, or ``None`` (not stored, not readable, no KV attached yet). For tools and fault injection."""
        if self._views is None:
            return None
        layout = self._views[0]
        with self._session() as m:
            want = self._find(m, [key], 0, set(), layout)
            if want is None:
                return None
            got = m.sm.batched_get([want.key], location=want.tier) or [None]
            obj = got[0]
            if obj is None:
                return None
            try:
                arr = obj.tensor.view(-1).numpy()
                length = FORMAT.header_bytes(arr[: min(arr.size, codec.MAX_HEADER)], arr.size)
                chunk = FORMAT.parse(arr[:length], fingerprint=layout.fingerprint, size=arr.size)
            except Corrupted:
                return None
            finally:
                obj.ref_count_down()
        if key not in chunk.keys:
            return None
        pos = chunk.keys.index(key)
        return want.key, chunk.offset(pos), chunk.payload

    def close(self) -> None:
        self._staging.clear()
        self._views = None
        super().close()


def _runs(plan: Sequence[_Want]) -> Iterator[tuple[str, list[_Want]]]:
    """``plan`` cut into runs of consecutive objects in the same tier."""
    i = 0
    while i < len(plan):
        j = i + 1
        while j < len(plan) and plan[j].tier == plan[i].tier:
            j += 1
        yield plan[i].tier, list(plan[i:j])
        i = j


class LMCacheBackend(StoreBackend):
    """The ``lmcache`` store backend: an :class:`LMCacheIndex` and :class:`LMCacheStore` s on the process's manager."""

    name = "lmcache"
    options_type = LMCacheOptions

    def __init__(self, options: LMCacheOptions):
        codec.require_checksum(options.checksum, "lmcache")
        if options.local_disk:
            writable_directory(options.local_disk, "lmcache option 'local_disk'")
        super().__init__(options)

    def open_index(self, engine: EngineInfo) -> LMCacheIndex:
        return LMCacheIndex(engine, self.options)

    def open_io(self, engine: EngineInfo) -> LMCacheStore:
        return LMCacheStore(engine, self.options)


BACKEND = LMCacheBackend

__all__ = ["BACKEND", "HEADER_BYTES", "MAGIC", "VERSION", "LMCacheBackend", "LMCacheIndex", "LMCacheOptions", "LMCacheStore"]
