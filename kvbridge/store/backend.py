""":class:`StoreBackend`: a backend made of a store's two halves, and the shared sides that drive them."""

from __future__ import annotations

import abc
from typing import ClassVar

from kvbridge.contract import Backend, EngineInfo
from kvbridge.store.base import StoreIndex, StoreIO
from kvbridge.store.scheduler import StoreScheduler
from kvbridge.store.worker import StoreWorker


class StoreBackend(Backend):
    """A backend made of a :class:`StoreIndex` and a :class:`StoreIO`: subclasses open each.

    Every store takes several KV-cache groups (:class:`_Groups` in the scheduler; the worker's layout
    then holds each shared tensor once, so a block id moves the bytes of whichever group owns it)."""

    kind: ClassVar = "store"
    supports_kv_groups: ClassVar[bool] = True
    supports_state_groups: ClassVar[bool] = True

    @abc.abstractmethod
    def open_index(self, engine: EngineInfo) -> StoreIndex:
        """The scheduler side's handle on the store for ``engine``."""

    @abc.abstractmethod
    def open_io(self, engine: EngineInfo) -> StoreIO:
        """A worker's handle on the store for ``engine`` (one per rank)."""

    def scheduler(self, engine: EngineInfo) -> StoreScheduler:
        return StoreScheduler(self.open_index(engine), engine)

    def worker(self, engine: EngineInfo) -> StoreWorker:
        return StoreWorker(self.open_io(engine), engine)


__all__ = ["StoreBackend"]
