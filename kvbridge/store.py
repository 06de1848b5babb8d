"""Stores: backends keyed by block hash, and the one connector that drives any of them.

A store backend implements :class:`BlockStore` — a small contract: how long a prefix of keys it
holds, load keys into blocks, save blocks under keys. :class:`StoreBackend` then turns it into the
full connector contract with :class:`StoreScheduler` and :class:`StoreWorker`, which every store
shares: lookup, allocation, the step plan, asynchronous loads on a worker thread, failure reports.

The scheduler side and the worker side each open their *own* :class:`BlockStore` (they may live in
different processes). A store whose index must live on the scheduler side (the CPU tier, whose
slots the scheduler assigns) says so through :meth:`BlockStore.reserve_load` and
:meth:`BlockStore.reserve_save`, whose results travel to the worker inside the plan.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kvbridge.contract import (
    Backend,
    BlockLoad,
    BlockSave,
    EngineInfo,
    FinishDecision,
    Lookup,
    RequestInfo,
    ScheduledRequest,
    SchedulerSide,
    StepPlan,
    WorkerReport,
    WorkerSide,
)
from kvbridge.errors import KVBridgeError
from kvbridge.layout import KVLayout
from kvbridge.stats import TransferStats

log = logging.getLogger(__name__)


class BlockStore(abc.ABC):
    """Storage of KV blocks by key. One instance per side (scheduler or worker) per engine.

    Keys are bytes (:mod:`kvbridge.keys`); a block's value is the bytes of that block in every layer
    (``layout.num_layers * layout.block_bytes``), tagged with the layout fingerprint so a reader with
    another layout treats it as a failed load, never loads it.
    """

    stats: TransferStats

    def __init__(self, engine: EngineInfo):
        self.engine = engine
        self.stats = TransferStats()

    # -- scheduler side ---------------------------------------------------------------------------
    @abc.abstractmethod
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are present (a miss is 0, never an error)."""

    def reserve_load(self, request_id: str, keys: Sequence[bytes]) -> Mapping[str, Any] | None:
        """Pin ``keys`` until :meth:`release` (they must not be evicted while loading); return what the
        worker needs to find them (``BlockLoad.source``). Default: nothing to pin, nothing to say."""
        return None

    def reserve_save(self, request_id: str, keys: Sequence[bytes]) -> tuple[Sequence[int], Mapping[str, Any] | None]:
        """Which of ``keys`` (positions) to save, and where (``BlockSave.target``). Default: all."""
        return range(len(keys)), None

    def release(self, request_id: str, *, loaded: bool = True, failed: Sequence[bytes] = ()) -> None:  # noqa: B027
        """The worker is done with ``request_id``'s reservations (loaded or saved, or it failed).

        ``failed`` are keys whose load did not arrive: an index that claims them (reserved for a
        promotion, or holding bytes that failed validation) should forget them, or every later lookup
        would offer blocks that fail again."""

    # -- worker side ------------------------------------------------------------------------------
    @abc.abstractmethod
    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        """Copy ``op.keys`` into blocks ``op.block_ids``; return the block ids that did *not* arrive.

        Runs on a worker thread. Must never write bytes that failed validation into the KV. A block
        that failed is reported, not raised; raising marks every block of ``op`` as failed.
        """

    @abc.abstractmethod
    def save(self, op: BlockSave, layout: KVLayout) -> None:
        """Store blocks ``op.block_ids`` under ``op.keys``. On return the KV blocks may be overwritten."""

    def attach(self, layout: KVLayout) -> None:  # noqa: B027 - optional hook
        """The worker registered its KV cache (allocate pools, check geometry)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files, memory, connections."""


class StoreBackend(Backend):
    """A backend made of a :class:`BlockStore`: subclasses only implement :meth:`open_store`."""

    kind: ClassVar = "store"

    @abc.abstractmethod
    def open_store(self, engine: EngineInfo, side: str) -> BlockStore:
        """A store handle for ``side`` (``"scheduler"`` or ``"worker"``) of ``engine``."""

    def scheduler(self, engine: EngineInfo) -> StoreScheduler:
        return StoreScheduler(self.open_store(engine, "scheduler"), engine)

    def worker(self, engine: EngineInfo) -> StoreWorker:
        return StoreWorker(self.open_store(engine, "worker"), engine)


@dataclasses.dataclass
class _Tracked:
    info: RequestInfo
    num_computed: int = 0  # at lookup time
    hit_blocks: int = 0  # prefix the store holds
    saved_upto: int = 0  # prompt blocks saved or already present
    load: BlockLoad | None = None  # planned and not yet reported finished
    looked_up: bool = False  # the store was asked (the engine may ask again; the answer must not change)


class StoreScheduler(SchedulerSide):
    """Scheduler side of every store: prefix lookup, load and save planning, holding blocks under load."""

    def __init__(self, store: BlockStore, engine: EngineInfo):
        self.store = store
        self.engine = engine
        self.stats = store.stats
        self._requests: dict[str, _Tracked] = {}
        self._pending_loads: list[BlockLoad] = []
        self._hold: list[str] = []

    @property
    def _saves(self) -> bool:
        return self.engine.role in ("producer", "both")

    def lookup(self, request: RequestInfo, num_computed_tokens: int) -> Lookup:
        self._check_open()
        bs = self.engine.block_size
        tracked = self._requests.setdefault(request.request_id, _Tracked(request))
        tracked.num_computed = num_computed_tokens
        if self.engine.role == "producer" or not request.block_keys:
            return Lookup(0)
        if not tracked.looked_up:  # the engine asks again every step a request waits: ask the store once
            try:
                hit = self.store.contains_prefix(request.block_keys)
            except KVBridgeError as exc:  # a store that cannot answer is a miss, not a failed request
                log.warning("lookup failed for %s: %s", request.request_id, exc)
                hit = 0
            tracked.looked_up = True
            tracked.hit_blocks = hit
            tracked.saved_upto = max(tracked.saved_upto, hit)
            self.store.stats.add(hits=hit, misses=len(request.block_keys) - hit)
        hit = tracked.hit_blocks
        loadable = min(hit * bs, request.num_prompt_tokens - 1)
        return Lookup(max(0, loadable - num_computed_tokens), is_async=True)

    def on_allocated(self, request: RequestInfo, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self._check_open()
        tracked = self._requests.setdefault(request.request_id, _Tracked(request))
        if num_external_tokens <= 0:
            return
        bs = self.engine.block_size
        first = tracked.num_computed // bs
        last = -(-(tracked.num_computed + num_external_tokens) // bs)  # ceil
        keys = request.block_keys[first:last]
        ids = tuple(block_ids[first:last])
        source = self.store.reserve_load(request.request_id, keys)
        tracked.load = BlockLoad(request.request_id, ids, tuple(keys), source)
        self._pending_loads.append(tracked.load)

    def plan_step(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        self._check_open()
        saves = []
        if self._saves:
            bs = self.engine.block_size
            for req in scheduled:
                tracked = self._requests.get(req.request_id)
                if tracked is None:
                    continue
                keys = tracked.info.block_keys
                upto = min(len(keys), (req.num_computed_tokens + req.num_scheduled_tokens) // bs, len(req.block_ids))
                if upto <= tracked.saved_upto:
                    continue
                span = range(tracked.saved_upto, upto)
                tracked.saved_upto = upto
                chosen, target = self.store.reserve_save(req.request_id, [keys[i] for i in span])
                picked = [span[i] for i in chosen]
                if picked:
                    saves.append(
                        BlockSave(
                            req.request_id,
                            tuple(req.block_ids[i] for i in picked),
                            tuple(keys[i] for i in picked),
                            target,
                        )
                    )
        plan = StepPlan(loads=tuple(self._pending_loads), saves=tuple(saves), hold_after_load=tuple(self._hold))
        self._pending_loads.clear()
        self._hold.clear()
        return plan

    def on_report(self, report: WorkerReport) -> None:
        self._check_open()
        for rid in report.finished_loading:
            tracked = self._requests.get(rid)
            failed: list[bytes] = []
            if tracked is not None and tracked.load is not None:
                op, tracked.load = tracked.load, None
                failed = [k for b, k in zip(op.block_ids, op.keys) if b in report.failed_blocks]
            self.store.release(rid, loaded=True, failed=failed)

    def on_finished(self, request: RequestInfo, block_ids: Sequence[int]) -> FinishDecision:
        self._check_open()
        tracked = self._requests.pop(request.request_id, None)
        if tracked is not None and tracked.load is not None:
            # blocks still being written by a load: the worker frees them once it is over
            if any(op.request_id == request.request_id for op in self._pending_loads):
                self._pending_loads = [op for op in self._pending_loads if op.request_id != request.request_id]
                self.store.release(request.request_id, loaded=False)
                return FinishDecision()
            self._hold.append(request.request_id)
            return FinishDecision(delay_free=True)
        self.store.release(request.request_id, loaded=False)
        return FinishDecision()

    def close(self) -> None:
        if not self._closed:
            self.store.close()
        super().close()


class StoreWorker(WorkerSide):
    """Worker side of every store: loads on one background thread, saves at the end of the step."""

    def __init__(self, store: BlockStore, engine: EngineInfo):
        self.store = store
        self.engine = engine
        self.stats = store.stats
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kvbridge-{engine.engine_id}-load")
        self._lock = threading.Lock()
        self._inflight: dict[str, concurrent.futures.Future[None]] = {}
        self._loaded: set[str] = set()
        self._saved: set[str] = set()
        self._failed: set[int] = set()
        self._holds: set[str] = set()
        self._saves: tuple[BlockSave, ...] = ()

    def register(self, layout: KVLayout) -> None:
        super().register(layout)
        self.store.attach(layout)

    def start_step(self, plan: StepPlan) -> None:
        layout = self._require_layout()
        self._saves = plan.saves
        with self._lock:
            for rid in plan.hold_after_load:
                if rid in self._inflight:
                    self._holds.add(rid)
                else:
                    self._saved.add(rid)
            for op in plan.loads:
                self._inflight[op.request_id] = self._pool.submit(self._load, op, layout)

    def _load(self, op: BlockLoad, layout: KVLayout) -> None:
        t0 = time.perf_counter()
        try:
            failed = set(self.store.load(op, layout))
        except Exception as exc:  # every block of the op is lost; the engine recomputes them
            log.warning("load of %s failed: %s", op.request_id, exc)
            failed = set(op.block_ids)
        ok = len(op.block_ids) - len(failed)
        self.store.stats.add(
            loads=1,
            load_blocks=ok,
            load_bytes=ok * layout.num_layers * layout.block_bytes,
            load_seconds=time.perf_counter() - t0,
            load_failures=int(bool(failed)),
            failed_blocks=len(failed),
        )
        with self._lock:
            self._inflight.pop(op.request_id, None)
            self._loaded.add(op.request_id)
            self._failed |= failed
            if op.request_id in self._holds:
                self._holds.discard(op.request_id)
                self._saved.add(op.request_id)

    def finish_step(self) -> None:
        layout = self._require_layout()
        saves, self._saves = self._saves, ()
        for op in saves:
            t0 = time.perf_counter()
            try:
                self.store.save(op, layout)
            except Exception as exc:  # a failed save loses a cache entry, never the request
                log.warning("save of %s failed: %s", op.request_id, exc)
                self.store.stats.add(save_failures=1)
                continue
            self.store.stats.add(
                saves=1,
                save_blocks=len(op.block_ids),
                save_bytes=len(op.block_ids) * layout.num_layers * layout.block_bytes,
                save_seconds=time.perf_counter() - t0,
            )

    def poll(self) -> WorkerReport:
        self._check_open()
        with self._lock:
            report = WorkerReport(frozenset(self._loaded), frozenset(self._saved), frozenset(self._failed))
            self._loaded.clear()
            self._saved.clear()
            self._failed.clear()
        return report

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no load is in flight (tests, shutdown); ``False`` on timeout."""
        with self._lock:
            futures = list(self._inflight.values())
        done, pending = concurrent.futures.wait(futures, timeout=timeout)
        return not pending

    def close(self) -> None:
        if not self._closed:
            self._pool.shutdown(wait=True, cancel_futures=False)
            self.store.close()
        super().close()


__all__ = ["BlockStore", "StoreBackend", "StoreScheduler", "StoreWorker"]
