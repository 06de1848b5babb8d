"""``memory`` — the reference store: a dict in this process. Read this first; every store works so.

Engines in one process that name the same store (``name`` option) share it, which is how tests play
producer and consumer without files or sockets. Not for production: it is unbounded and per process.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import torch

from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.layout import KVLayout, LayoutFingerprint
from kvbridge.store import StoreBackend, StoreIndex, StoreIO

# name -> {(namespace, rank, key): (fingerprint, bytes of the block in every layer [L, block_bytes])}
_SHARED: dict[str, dict[tuple[str, int, bytes], tuple[LayoutFingerprint, torch.Tensor]]] = {}
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    name: str = "default"


class _Shelf:
    """One engine's view of a shared dict: its namespace and rank."""

    def __init__(self, engine: EngineInfo, name: str):
        with _LOCK:
            self._data = _SHARED.setdefault(name, {})
        self._namespace, self._rank = engine.namespace, engine.rank

    def _slot(self, key: bytes) -> tuple[str, int, bytes]:
        return (self._namespace, self._rank, key)


class MemoryIndex(_Shelf, StoreIndex):
    def __init__(self, engine: EngineInfo, name: str):
        StoreIndex.__init__(self, engine)
        _Shelf.__init__(self, engine, name)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if self._slot(key) not in self._data:
                break
            n += 1
        return n


class MemoryIO(_Shelf, StoreIO):
    def __init__(self, engine: EngineInfo, name: str):
        StoreIO.__init__(self, engine)
        _Shelf.__init__(self, engine, name)

    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        found = []
        for key in op.keys:  # a prefix: stop at the first block that is missing or foreign
            entry = self._data.get(self._slot(key))
            if entry is None or entry[0] != layout.fingerprint:
                break
            found.append(entry[1])
        if found:
            layout.scatter(op.block_ids[: len(found)], torch.stack(found, dim=1))
        return op.block_ids[len(found) :]

    def save(self, op: BlockSave, layout: KVLayout) -> None:
        staging = layout.gather(op.block_ids)
        for i, key in enumerate(op.keys):
            self._data[self._slot(key)] = (layout.fingerprint, staging[:, i])


class MemoryBackend(StoreBackend):
    name = "memory"
    options_type = MemoryOptions

    def open_index(self, engine: EngineInfo) -> MemoryIndex:
        return MemoryIndex(engine, self.options.name)

    def open_io(self, engine: EngineInfo) -> MemoryIO:
        return MemoryIO(engine, self.options.name)


def clear(name: str | None = None) -> None:
    """Forget one shared store (or all of them)."""
    with _LOCK:
        if name is None:
            _SHARED.clear()
        else:
            _SHARED.pop(name, None)


BACKEND = MemoryBackend
