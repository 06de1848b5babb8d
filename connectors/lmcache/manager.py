"""LMCache itself, imported once and lazily, and one ``StorageManager`` per process per set of options."""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from kvbridge.connectors.lmcache.options import HINT, MIN_LOCATORS, REMOTE, LMCacheOptions

from kvbridge.errors import MissingDependency, TransferTimeout

log = logging.getLogger(__name__)


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


def lmcache_lib() -> _LMCache:
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
            raise MissingDependency(f"LMCache is installed but does not import ({exc}); {HINT}") from exc
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


class Manager:
    """A ``StorageManager``, its users, the lock that serializes calls into it, remote upkeep."""

    def __init__(self, options: LMCacheOptions):
        lib = lmcache_lib()
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
        self.where_cap = MIN_LOCATORS
        self._next_connect = 0.0
        self._arm_socket()

    @property
    def remote(self) -> Any:
        return self.sm.storage_backends.get(REMOTE)

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


_MANAGERS: dict[LMCacheOptions, Manager] = {}
_MANAGERS_LOCK = threading.Lock()


def acquire(options: LMCacheOptions) -> Manager:
    with _MANAGERS_LOCK:
        manager = _MANAGERS.get(options)
        if manager is None:
            manager = _MANAGERS[options] = Manager(options)
        manager.users += 1
        return manager


def release(manager: Manager) -> None:
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
