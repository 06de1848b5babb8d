"""The store-author contract: :class:`StoreIndex` (scheduler side), :class:`StoreIO` (worker side), and
:class:`LayerwiseIO` for a store that loads layer by layer. A new store subclasses the first two and hands
them out from a :class:`~kvbridge.store.backend.StoreBackend`."""

from __future__ import annotations

import abc
import typing
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.layout import KVLayout
from kvbridge.stats import TransferStats
from kvbridge.transfer import Transfer


class StoreIndex(abc.ABC):
    """Scheduler side of a store: which keys it holds, and the reservations a load or save needs.

    Keys are bytes (:mod:`kvbridge.keys`). One instance per engine's scheduler. ``layerwise``: its
    loads are synchronous and layer by layer (its IO is a :class:`LayerwiseIO`).
    """

    stats: TransferStats
    layerwise: bool = False

    def __init__(self, engine: EngineInfo):
        self.engine = engine
        self.stats = TransferStats()

    @abc.abstractmethod
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are present (a miss is 0, never an error)."""

    def members(self, keys: Sequence[bytes]) -> list[int]:
        """The positions of ``keys`` present, not only a prefix (a chain asks each tier which blocks it
        holds). Default: :meth:`contains_prefix` again past each miss, a call per missing block; an
        index that can tell at once overrides it."""
        out: list[int] = []
        i = 0
        while i < len(keys):
            m = self.contains_prefix(keys[i:])
            out.extend(range(i, i + m))
            i += m + 1
        return out

    def reserve_load(self, request_id: str, keys: Sequence[bytes]) -> Any:
        """Pin ``keys`` until :meth:`release` (they must not be evicted while loading); return what the
        worker needs to find them (``BlockLoad.source``). Default: nothing to pin, nothing to say."""
        return None

    def reserve_save(self, request_id: str, keys: Sequence[bytes]) -> tuple[Sequence[int], Any]:
        """Which of ``keys`` (positions) to save, and where (``BlockSave.target``). Default: all."""
        return range(len(keys)), None

    def release(self, request_id: str, failed: Sequence[bytes] = ()) -> None:  # noqa: B027
        """The worker is done with ``request_id``'s reservations (loaded or saved, or it failed).

        ``failed`` are keys whose load did not arrive: an index that claims them (reserved for a
        promotion, or holding bytes that failed validation) should forget them, or every later lookup
        would offer blocks that fail again."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files, memory, connections."""


class StoreIO(abc.ABC):
    """Worker side of a store: the bytes. One instance per worker (rank).

    A block's value is the bytes of that block in every layer (``layout.num_layers *
    layout.block_bytes``), tagged with the layout fingerprint so a reader with another layout treats
    it as a failed load, never loads it.
    """

    stats: TransferStats

    def __init__(self, engine: EngineInfo):
        self.engine = engine
        self.stats = TransferStats()

    @abc.abstractmethod
    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        """Copy ``op.keys`` into blocks ``op.block_ids``; return the block ids that did *not* arrive.

        Runs on the IO thread. A block counts as arrived only once its bytes are checked: bytes may land
        in ``op.block_ids`` before their check (the engine reads those blocks only after the report),
        and a block that failed is reported — never raised, never counted — so the engine recomputes it
        over whatever landed. Raising marks every block of ``op`` as failed.
        """

    @abc.abstractmethod
    def save(self, op: BlockSave, layout: KVLayout) -> None:
        """Store blocks ``op.block_ids`` under ``op.keys``. Runs on the IO thread; the blocks stay
        untouched until it returns."""

    def start_load(self, op: BlockLoad, layout: KVLayout) -> Transfer | None:
        """Optional: start ``op`` now where no Python thread waits on it (native threads) and return its
        handle (:class:`~kvbridge.transfer.Started`: the running copy, and what gives the block ids that did
        not arrive once it is over, on the thread that polls; a :class:`~kvbridge.transfer.Fallback` where
        what is left would block, as a chain asking its next tier for what the first failed). ``None``:
        :meth:`load` runs it on the IO thread instead. The worker asks only when nothing is queued on the IO
        thread, so a started load never overtakes a save it may read."""
        return None

    def start_save(self, op: BlockSave, layout: KVLayout) -> Transfer | None:
        """Optional: start ``op`` now where no Python thread waits on it and return its handle (completed on
        the thread that polls; a raise fails the save). ``None``: :meth:`save` runs it on the IO thread.
        Asked only when nothing is queued there."""
        return None

    def write_back(self, op: BlockLoad, layout: KVLayout, failed: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """After ``op`` was reported loaded: copy its blocks that arrived (not ``failed``) elsewhere, e.g. a
        chain's promotion into its faster tiers. Runs on the IO thread as a save of ``op``'s request, so
        the engine keeps those blocks until it is over. Only for a load whose ``source`` says
        ``writes_back`` (the scheduler then treats the request as saving)."""

    def attach(self, layout: KVLayout) -> None:  # noqa: B027 - optional hook
        """The worker registered its KV cache (allocate pools, check geometry)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files, memory, connections."""


@typing.runtime_checkable
class LayerwiseIO(typing.Protocol):
    """A :class:`StoreIO` that can load layer by layer, inside the step (``BlockLoad.layerwise``)."""

    def load_layers(self, op: BlockLoad, layout: KVLayout) -> tuple[int, Callable[[int], None]]:
        """Check ``op`` before any byte moves: how many leading blocks are valid (the rest fail), and a function
        copying layer ``i`` of them into the KV (called for every layer, in order). Both run on the worker's
        layer thread, in the step; a raise fails every block of ``op``."""
        ...


__all__ = ["LayerwiseIO", "StoreIO", "StoreIndex"]
