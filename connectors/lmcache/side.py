"""What both sides of the lmcache tier share: keys, the manager's session, locators (the package docstring)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from kvbridge.connectors.fs import chunk_blocks
from kvbridge.connectors.lmcache.manager import Manager, acquire, lmcache_lib, release
from kvbridge.connectors.lmcache.options import (
    KEY_LIMIT,
    LOCATOR,
    LOCATOR_MAGIC,
    MAX_BLOCKS,
    MAX_HASH,
    REMOTE,
    VERSION,
    LMCacheOptions,
)

from kvbridge import codec
from kvbridge.contract import EngineInfo
from kvbridge.errors import ClosedError, ConfigError

log = logging.getLogger(__name__)


class Side:
    """One engine side's view of its (shared) LMCache ``StorageManager``: its keys, chunks and session."""

    engine: EngineInfo

    def __init__(self, engine: EngineInfo, options: LMCacheOptions):
        self.options = options
        self._lib = lmcache_lib()
        self.chunk = chunk_blocks(engine.block_size, options.chunk_tokens)
        self.max_blocks = 1 if self.chunk == 1 else min(2 * self.chunk, MAX_BLOCKS)
        ns = hashlib.sha256(engine.namespace.encode()).hexdigest()[:16]
        self._model = f"{options.model_name}-{ns}-v{VERSION}c{self.chunk}"
        self._locator_model = f"{self._model}-l"
        longest = self._lib.CacheEngineKey(self._locator_model, engine.kv_world_size, engine.kv_rank, bytes(MAX_HASH), torch.uint8)
        if len(longest.to_string()) > KEY_LIMIT:
            raise ConfigError(f"lmcache keys of {self._model!r} would exceed LMCache's {KEY_LIMIT} characters")
        self._manager: Manager | None = acquire(options)

    @property
    def storage_manager(self) -> Any:
        """The LMCache ``StorageManager`` behind this store (shared; for diagnostics and tests)."""
        return self._open().sm

    @staticmethod
    def _hash(key: bytes) -> bytes:
        return key if 0 < len(key) <= MAX_HASH else hashlib.blake2b(key, digest_size=MAX_HASH).digest()

    def lmcache_key(self, key: bytes) -> Any:
        """The LMCache ``CacheEngineKey`` of the object that ends with block ``key`` (of this engine's
        namespace, chunk size and rank); also what a manager's locators know the block by."""
        return self._lib.CacheEngineKey(self._model, self.engine.kv_world_size, self.engine.kv_rank, self._hash(key), torch.uint8)

    def locator_key(self, key: bytes) -> Any:
        """The LMCache key of block ``key``'s locator object in the remote tier."""
        return self._lib.CacheEngineKey(self._locator_model, self.engine.kv_world_size, self.engine.kv_rank, self._hash(key),
                                        torch.uint8)

    def _open(self) -> Manager:
        if self._manager is None:
            raise ClosedError("lmcache store is closed")
        return self._manager

    @contextlib.contextmanager
    def _session(self) -> Iterator[Manager]:
        manager = self._open()
        with manager.lock:
            manager.check_remote()
            yield manager

    @staticmethod
    def _remote_up(m: Manager) -> bool:
        return m.remote is not None and m.remote.connection is not None

    def _holder(self, m: Manager, key: bytes) -> tuple[Any, int, int] | None:
        """Where block ``key`` is, by a locator: ``(object key, its blocks, the block's place)`` of an object
        that is there now; ``None`` if no locator names one. The manager's own, then the remote's."""
        held = m.where.get(self.lmcache_key(key))
        if held is not None and m.sm.contains(held[0]) is not None:
            return held
        if not self._remote_up(m) or m.sm.contains(self.locator_key(key), search_range=[REMOTE]) is None:
            return None
        got = m.sm.batched_get([self.locator_key(key)], location=REMOTE) or [None]
        obj = got[0]
        if obj is None:
            return None
        try:
            raw = obj.tensor.view(-1).numpy().tobytes() if obj.tensor is not None else b""
        finally:
            obj.ref_count_down()
        if len(raw) < LOCATOR.size:
            return None
        magic, version, count, pos, length, digest, chunk = LOCATOR.unpack_from(raw)
        if magic != LOCATOR_MAGIC or version != VERSION or digest != codec.key_digest(key) or not pos < count:
            log.debug("lmcache: the remote locator of a block is not one (%r); ignored", raw[:16])
            return None
        if not 0 < length <= MAX_HASH:
            return None
        target = self._lib.CacheEngineKey(self._model, self.engine.kv_world_size, self.engine.kv_rank, chunk[:length], torch.uint8)
        if m.sm.contains(target) is None:
            return None
        return target, count, pos

    def close(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            release(manager)
