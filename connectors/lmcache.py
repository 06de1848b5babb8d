"""``lmcache`` — LMCache's storage backends as one more kvbridge tier (``pip install 'kvbridge[lmcache]'``).

kvbridge drives an LMCache ``StorageManager`` (LMCache 0.5.6) directly — no LMCache engine, no GPU
connector — so its local CPU arena, its local disk tier and its remote stores (the ``lm://`` server,
``redis://``, …: any ``remote_url`` LMCache understands) hold kvbridge blocks. It works alone or as a
tier of ``chain`` (e.g. ``cpu`` then ``lmcache``).

**What is shared with whom.** One ``StorageManager`` per process per set of options: every store of
this backend in a process with equal options (the scheduler side and the worker side of an engine,
several engines in a test) uses it, reference-counted, and the last one to close closes it. Its CPU
arena and its disk tier are private to that manager: LMCache indexes disk objects in memory, so
another process (or a restart) never sees them. Only a **remote** tier is shared across processes,
and it is what makes this backend a hand-off between engines; with the scheduler and the worker in
different processes (vLLM), a lookup sees a block only once it reached the remote tier. Without a
``remote_url`` the backend is an offload tier for one process.

**Objects.** One LMCache object per kvbridge block, keyed ``CacheEngineKey(model, world_size, rank,
chunk_hash, uint8)`` where ``model`` is ``<model_name>-<sha256(namespace)[:16]>`` (safe for LMCache's
``@``/``%``-separated key string and its 150-character limit whatever the namespace) and
``chunk_hash`` is the block key (hashed to 32 bytes when longer). The value is a uint8 tensor
``[1, 1, 1, HEADER_BYTES + num_layers * block_bytes]`` in format :data:`kvbridge.codec.LMCACHE`: a
:data:`HEADER_BYTES` header (:data:`MAGIC`, format version, checksum kind, the payload's checksum
and length, the layout fingerprint's digest and a digest of the full block key; byte layout in
:mod:`kvbridge.codec`), then the block's bytes in every layer. A reader checks all of it before a
byte reaches the KV cache; an object that fails is a failed block (``stats.corrupt``),
and a damaged one is dropped from the tiers that can delete (CPU, disk; the ``lm://`` server cannot).
Objects of another layout or format version are left alone.

**Saves** gather all blocks of the op in one vectorized copy, copy each block's slab into an object
allocated from LMCache's CPU arena (LMCache's API is per object), ``batched_put`` them, and wait —
bounded by ``timeout_s`` — until the disk and remote writes are done and the remote answers for the
last of them (``lm://`` puts are unacknowledged), so a consumer can see them when the save returns. A full arena (nothing evictable) saves what fit and raises
:class:`~kvbridge.errors.StoreFull` for the rest, never waits; a remote tier that is down or dropped
writes fails the save (:class:`~kvbridge.errors.PeerUnreachable`); both are counted by the worker.

Measured on a 2-core VM (Llama-3-8B geometry, 124 MiB per op, ``OMP_NUM_THREADS=1``): save/load
0.18/0.19 GB/s through ``lm://`` on loopback and 0.33/0.46 GB/s through the disk tier, beside a 3.8 GB/s
torch memcpy; the time goes to LMCache's transport (its event-loop thread, the Python server), not to
kvbridge's copies and checksums.

**Loads** find each key's tier (stopping at the first miss), ``batched_get`` each run of keys from
its tier, validate, and write the blocks that passed in one ``layout.scatter``; every object LMCache
hands out is released (``ref_count_down``) whatever happens.

**Failures.** A dead remote is a miss for lookups and failed blocks for loads, never a hang: kvbridge
sets ``timeout_s`` on the ``lm://`` socket, drops a connection whose peer closed it, and reconnects at
most every ``reconnect_s`` (a bare LMCache ``StorageManager`` never does). Calls into one manager are
serialized (the ``lm://`` client multiplexes one socket without framing its replies).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import importlib.util
import logging
import math
import os
import re
import select
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch

from kvbridge import codec
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
from kvbridge.layout import KVLayout, block_words
from kvbridge.options import require, writable_directory
from kvbridge.staging import StagingPool
from kvbridge.store import StoreBackend, StoreIndex, StoreIO

_HINT = "pip install 'kvbridge[lmcache]'"
# find_spec costs nothing (importing LMCache takes 3-10 s): `kvbridge backends` stays fast, and tells the truth
if importlib.util.find_spec("lmcache") is None:
    raise MissingDependency(f"the lmcache backend needs LMCache: {_HINT}")

log = logging.getLogger(__name__)

FORMAT = codec.LMCACHE
MAGIC = FORMAT.magic
VERSION = codec.VERSION
HEADER_BYTES = FORMAT.header_bytes  # keeps the payload 8-byte aligned
_KEY_LIMIT = 150  # LMCache asserts on longer key strings
_MAX_HASH = 32  # longer block keys are hashed to this many bytes (the header keeps a digest of the full key)
_MODEL_NAME = re.compile(r"[A-Za-z0-9._-]{1,40}")
_REMOTE = "RemoteBackend"
_CPU = "LocalCPUBackend"
_DELETABLE = ("LocalCPUBackend", "LocalDiskBackend")


@dataclasses.dataclass(frozen=True)
class LMCacheOptions:
    """Which LMCache tiers hold the blocks, and how long to wait for them.

    ``remote_url``: an LMCache remote (``lm://host:port``, ``redis://host:port``, …); the only tier
    shared across processes. ``local_cpu_bytes``: LMCache's CPU arena, allocated up front; every
    object passes through it, so it must hold at least one block (the saves of one step are put in
    batches that fit). ``cpu_cache``: also keep saved and loaded blocks in that arena (a hot tier,
    LRU-evicted); off, it is only a staging buffer. ``local_disk`` + ``local_disk_bytes``: a disk tier
    in that directory (private to the process). ``model_name``: a readable label in every LMCache key
    (the namespace digest follows it). ``timeout_s``: the longest a save waits for its writes, and a
    remote call for its reply. ``reconnect_s``: how often to retry a remote that went away.
    ``checksum``: ``crc32`` or ``crc32c`` (``pip install google-crc32c``).
    """

    remote_url: str = ""
    local_cpu_bytes: int = 1 << 30
    cpu_cache: bool = True
    local_disk: str = ""
    local_disk_bytes: int = 0
    model_name: str = "kvbridge"
    timeout_s: float = 30.0
    reconnect_s: float = 10.0
    checksum: Literal["crc32", "crc32c"] = "crc32"

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
                    pause = min(pause * 2, 0.005)

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


def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` of uint8 rows, as int64 words where size and alignment allow (faster copies)."""
    dw, sw = block_words(dst), block_words(src)
    if dw is not None and sw is not None:
        dw.copy_(sw)
    else:
        dst.copy_(src)


class _Handle:
    """One engine side's view of its (shared) LMCache ``StorageManager``: its keys and its session."""

    engine: EngineInfo

    def __init__(self, engine: EngineInfo, options: LMCacheOptions):
        self.options = options
        self._lib = _lmcache()
        self._model = f"{options.model_name}-{hashlib.sha256(engine.namespace.encode()).hexdigest()[:16]}"
        longest = self._lib.CacheEngineKey(self._model, engine.kv_world_size, engine.kv_rank, bytes(_MAX_HASH), torch.uint8)
        if len(longest.to_string()) > _KEY_LIMIT:
            raise ConfigError(f"lmcache keys of {self._model!r} would exceed LMCache's {_KEY_LIMIT} characters")
        self._manager: _Manager | None = _acquire(options)

    @property
    def storage_manager(self) -> Any:
        """The LMCache ``StorageManager`` behind this store (shared; for diagnostics and tests)."""
        return self._open().sm

    def lmcache_key(self, key: bytes) -> Any:
        """The LMCache ``CacheEngineKey`` that holds block ``key`` of this engine's namespace and rank."""
        chunk = key if 0 < len(key) <= _MAX_HASH else hashlib.blake2b(key, digest_size=_MAX_HASH).digest()
        return self._lib.CacheEngineKey(self._model, self.engine.kv_world_size, self.engine.kv_rank, chunk, torch.uint8)

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

    def close(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            _release(manager)


class LMCacheIndex(_Handle, StoreIndex):
    """Scheduler side: which keys LMCache holds, from the first."""

    def __init__(self, engine: EngineInfo, options: LMCacheOptions):
        StoreIndex.__init__(self, engine)
        _Handle.__init__(self, engine, options)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self._session() as m:
            for key in keys:
                if m.sm.contains(self.lmcache_key(key)) is None:  # LMCache answers a failed remote as a miss
                    break
                n += 1
        return n


class LMCacheStore(_Handle, StoreIO):
    """Worker side: block objects in and out of LMCache. See the module docstring."""

    def __init__(self, engine: EngineInfo, options: LMCacheOptions):
        StoreIO.__init__(self, engine)
        _Handle.__init__(self, engine, options)
        self._kind = codec.CHECKSUMS[options.checksum]
        self._staging = StagingPool()  # host buffers between the KV and LMCache's objects

    def attach(self, layout: KVLayout) -> None:
        size = HEADER_BYTES + layout.num_layers * layout.block_bytes
        if size > self.options.local_cpu_bytes or size >= 1 << 31:
            raise ConfigError(
                f"lmcache: one block object is {size} bytes; local_cpu_bytes={self.options.local_cpu_bytes} "
                "must hold at least one (and LMCache's wire format stays under 2 GiB)"
            )

    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        keys = [self.lmcache_key(k) for k in op.keys]
        with self._staging.lend(layout, len(keys)) as staging:
            good = self._fetch(op, keys, layout, staging)
            if good:  # one vectorized scatter of the blocks that passed validation, and only those
                layout.scatter(op.block_ids[:good], staging[:, :good].to(layout.device))
        return op.block_ids[good:]

    def _fetch(self, op: BlockLoad, keys: list[Any], layout: KVLayout, staging: torch.Tensor) -> int:
        """Copy the objects of ``keys`` that pass validation into ``staging``, from the first; how many."""
        # LMCache reads a disk or remote hit into its CPU arena and, when the arena is full, waits for
        # room forever: fetch in batches that fit in half of it, and give each batch back before the next.
        per = max(1, (self.options.local_cpu_bytes // 2) // (HEADER_BYTES + layout.num_layers * layout.block_bytes))
        good = 0
        with self._session() as m:
            where = []
            for key in keys:  # a prefix: the engine recomputes from the first block that is missing
                tier = m.sm.contains(key)
                if tier is None:
                    break
                where.append(tier)
            while good < len(where):
                end = good
                while end < len(where) and end - good < per and where[end] == where[good]:
                    end += 1  # one batched_get per run of keys held by the same tier
                got = m.sm.batched_get(keys[good:end], location=where[good]) or []
                try:
                    for i, obj in enumerate(got, start=good):
                        if obj is None:
                            break
                        try:
                            payload = self._validate(op.keys[i], obj, layout)
                        except Corrupted as bad:
                            self._reject(m, keys[i], where[i], bad)
                            break
                        _copy_rows(staging[:, i], payload)  # LMCache's API is per object
                        good += 1
                finally:
                    for obj in got:
                        if obj is not None:
                            obj.ref_count_down()
                if good < end:
                    break
        return good

    def save(self, op: BlockSave, layout: KVLayout) -> None:
        if not op.keys:
            return
        with self._staging.gathered(layout, op.block_ids) as staging:
            self._store(op, layout, staging)

    def _store(self, op: BlockSave, layout: KVLayout, staging: torch.Tensor) -> None:
        """Put the blocks of ``op`` (gathered in ``staging``) into LMCache, one object each."""
        shape = torch.Size([1, 1, 1, HEADER_BYTES + layout.num_layers * layout.block_bytes])
        keys = [self.lmcache_key(k) for k in op.keys]
        with self._session() as m:
            up = m.remote is None or m.remote.connection is not None
            failed_before = m.remote.put_failed_count if m.remote is not None else 0
            batch: list[tuple[Any, Any]] = []
            stored = 0
            try:
                for i, key in enumerate(keys):
                    obj = m.sm.allocate(shape, torch.uint8, fmt=self._lib.KV_2LTD, eviction=True, busy_loop=False)
                    if obj is None and batch:  # the arena is full of this save: put it, then its objects are evictable
                        stored += self._put(m, batch)
                        obj = m.sm.allocate(shape, torch.uint8, fmt=self._lib.KV_2LTD, eviction=True, busy_loop=False)
                    if obj is None:
                        raise StoreFull(
                            f"lmcache: CPU arena ({self.options.local_cpu_bytes} B) has no room for a {shape[-1]} B "
                            f"object; saved {stored} of {len(keys)} blocks of {op.request_id}"
                        )
                    batch.append((key, obj))
                    self._fill(obj.tensor.view(-1), op.keys[i], layout, staging[:, i])
                stored += self._put(m, batch)
            finally:
                for _, obj in batch:  # only objects never handed to LMCache are left here
                    obj.ref_count_down()
            if m.remote is not None and (not up or m.remote.connection is None or m.remote.put_failed_count > failed_before):
                raise PeerUnreachable(
                    f"lmcache remote {self.options.remote_url} did not take the blocks of {op.request_id}"
                )

    @staticmethod
    def _put(m: _Manager, batch: list[tuple[Any, Any]]) -> int:
        """Hand ``batch`` (and our references to it) to LMCache and wait for its writes; empties it."""
        keys, objs = [k for k, _ in batch], [o for _, o in batch]
        batch.clear()
        m.sm.batched_put(keys, objs)
        m.drain(keys)
        # A finished put was only *sent*: the lm:// protocol has no acknowledgement, and a reader on another
        # connection could ask before the server took it. The server answers one connection in order, so a
        # lookup of the last key on ours returns once every put before it landed.
        if m.remote is not None and m.remote.connection is not None and m.sm.contains(keys[-1], search_range=[_REMOTE]) is None:
            raise PeerUnreachable(f"lmcache remote {m.options.remote_url} does not hold what was just put")
        return len(keys)

    def _fill(self, flat: torch.Tensor, key: bytes, layout: KVLayout, block: torch.Tensor) -> None:
        body = flat[HEADER_BYTES:]
        _copy_rows(body.view(block.shape), block)
        header = FORMAT.pack(key, layout.fingerprint, [body.numpy()], self._kind)
        flat[:HEADER_BYTES].numpy()[:] = np.frombuffer(header, dtype=np.uint8)

    def _validate(self, key: bytes, obj: Any, layout: KVLayout) -> torch.Tensor:
        """The payload of ``obj`` as ``[num_layers, block_bytes]`` uint8, or :class:`Corrupted`."""
        t = obj.tensor
        if t is None or t.dtype != torch.uint8 or not t.is_contiguous():
            raise Corrupted(f"not a kvbridge object ({None if t is None else (t.dtype, tuple(t.shape))})", damaged=True)
        flat = t.view(-1)
        body = flat[HEADER_BYTES:]
        FORMAT.check(flat[:HEADER_BYTES].numpy(), key=key, fingerprint=layout.fingerprint, parts=[body.numpy()], size=flat.numel())
        return body.view(layout.num_layers, layout.block_bytes)

    def _reject(self, m: _Manager, key: Any, tier: str, bad: Corrupted) -> None:
        self.stats.add(corrupt=1)
        log.warning("lmcache store: object %s in %s is not loadable (%s)", key.to_string(), tier, bad)
        if bad.damaged:  # the remote cannot delete; CPU (a write-back copy) and disk can
            m.sm.remove(key, locations=list(_DELETABLE))

    def close(self) -> None:
        self._staging.clear()
        super().close()


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
