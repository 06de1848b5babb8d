"""The worker side of an ``fs`` store: one engine's rank, its loads and saves, each given its route once
(:mod:`~.plan`) and moved by :class:`~.read.Reader` or :class:`~.write.Writer`."""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvbridge.connectors.fs import native as fs_native
from kvbridge.connectors.fs.evict import Shelf
from kvbridge.connectors.fs.files import Threads
from kvbridge.connectors.fs.kv import Blocks
from kvbridge.connectors.fs.naming import Tree
from kvbridge.connectors.fs.options import FsOptions
from kvbridge.connectors.fs.plan import Medium, ReadPlan, Route, choose_read, choose_save
from kvbridge.connectors.fs.read import Reader
from kvbridge.connectors.fs.write import Writer

from kvbridge import codec
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import Corrupted
from kvbridge.layout import KVLayout
from kvbridge.staging import StagingPool
from kvbridge.store import StoreIO
from kvbridge.transfer import Started, Transfer


class FsStore(Tree, StoreIO):
    """Worker side: one engine's objects in the shared directory. See the package docstring."""

    def __init__(self, engine: EngineInfo, options: FsOptions):
        StoreIO.__init__(self, engine)
        Tree.__init__(self, engine, options)
        self._kind = codec.CHECKSUMS[options.checksum]
        self._direct = getattr(os, "O_DIRECT", 0) if options.o_direct else 0
        self._staging = StagingPool()  # where a KV on a GPU (or in kv_first) is gathered and scattered
        self._threads = Threads(options.io_threads)
        self._views: tuple[KVLayout, Blocks | None] | None = None
        # the native module where it loaded and has crc32c: blocks moved and checked without a Python
        # object per block (None: Python threads move them)
        self._native = fs_native.module()
        self.shelf = Shelf(self, self.stats, self._kind)
        self.reader = Reader(self, engine.rank, self.shelf, self._threads, self._staging, self._direct)
        self.writer = Writer(self, self.shelf, self.reader, self._threads, self._staging, kind=self._kind, direct=self._direct)

    def attach(self, layout: KVLayout) -> None:
        self._blocks(layout)

    def _blocks(self, layout: KVLayout) -> Blocks | None:
        if self._views is None or self._views[0] is not layout:
            self._views = (layout, Blocks.of(layout))
        return self._views[1]

    def _medium(self) -> Medium:
        return Medium(native=self._native is not None, direct=bool(self._direct), kind=self._kind)

    def plan_read(self, op: BlockLoad, layout: KVLayout) -> ReadPlan:
        """The route of ``op``'s blocks into ``layout``: chosen here, once per load."""
        return choose_read(layout, op.source, self._medium(), tp=self.tp, views=self._blocks(layout) is not None)

    def plan_save(self, layout: KVLayout) -> Route:
        """The route of a save's blocks out of ``layout``."""
        return choose_save(layout, self._medium(), views=self._blocks(layout) is not None)

    # -- loads ---------------------------------------------------------------------------------------
    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        layout.check_bounds(op.block_ids)  # ids outside the KV fail the whole load, before any read
        plan = self.plan_read(op, layout)
        return op.block_ids[self.reader.load(op, layout, plan, self._native, self._blocks(layout)) :]

    def start_load(self, op: BlockLoad, layout: KVLayout) -> Transfer | None:
        """A load into a CPU KV, started from the engine's thread: its objects opened and their headers
        checked here, the blocks read and checked on the native threads (``file_start``), the sums
        compared by the poll that sees the read over; no hand-off to the IO thread and back (bench: ``fs
        load 8b 64tok``, where that hand-off weighs most). ``None`` (the IO thread loads it) for a plan
        other than ``NATIVE``, or objects that need the plan's fallback."""
        plan = self.plan_read(op, layout)
        if plan.route is not Route.NATIVE:
            return None
        assert self._native is not None
        layout.check_bounds(op.block_ids)
        started = self.reader.start(op, layout, plan, self._native)
        if started is None:
            return None  # nothing found (the IO thread's load reports it, the ordinary way), or older objects
        running, good = started
        return Started(op, running, lambda: op.block_ids[good() :])

    # -- saves ---------------------------------------------------------------------------------------
    def save(self, op: BlockSave, layout: KVLayout) -> None:
        if not op.keys or self.engine.rank != self.engine.kv_rank:  # rank 0 writes the bytes every rank holds
            return
        layout.check_bounds(op.block_ids)
        self.writer.save(op, layout, self.plan_save(layout), self._native, self._blocks(layout))

    def locate(self, key: bytes) -> tuple[str, int, int] | None:
        """Where ``key``'s block is stored: ``(object path, offset, length)`` of its bytes, or ``None`` (not
        stored, not readable, or no KV attached yet). For tools and fault injection; loads do not use it."""
        if self._views is None:
            return None
        path = self.path_of(key)
        try:
            fd, chunk = self.reader.open(path, self._views[0].fingerprint)
        except (OSError, Corrupted):
            return None
        try:
            pos = chunk.keys.index(key) if key in chunk.keys else -1
        finally:
            os.close(fd)
        return None if pos < 0 else (os.path.realpath(path), chunk.offset(pos), chunk.payload)

    def close(self) -> None:
        self._threads.close()
        self._staging.clear()
        self._views = None
        super().close()
