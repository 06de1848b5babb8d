"""Stores: backends keyed by block hash, and the one connector that drives any of them.

A store is two small protocols, one per side, each opened by the backend for its own side (they
may live in different processes):

- :class:`StoreIndex` (scheduler side): how long a prefix of keys the store holds, and — for a store
  whose placement the scheduler decides (the CPU tier assigns its slots there) — reservations for
  loads and saves, whose results travel to the worker inside the plan (``BlockLoad.source``,
  ``BlockSave.target``), and their release.
- :class:`StoreIO` (worker side): load keys into blocks, save blocks under keys.

:class:`StoreBackend` turns the pair into the full connector contract with :class:`StoreScheduler`
and :class:`StoreWorker`, which every store shares, over the core's :mod:`kvbridge.lifecycle`:
lookup, allocation, the step plan, loads and saves on a background thread, failure reports.
A save never runs inside the forward pass: ``finish_step`` hands it to the IO thread, and a request
that ends with a save in flight keeps its blocks (``delay_free``) until the save is over.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
import threading
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from kvbridge.contract import (
    NULL_BLOCK,
    Backend,
    BlockLoad,
    BlockSave,
    EngineInfo,
    FinishDecision,
    KVGroup,
    Lookup,
    RequestInfo,
    ScheduledRequest,
    SchedulerSide,
    StepPlan,
    WorkerReport,
    WorkerSide,
    split_groups,
)
from kvbridge.errors import KVBridgeError
from kvbridge.keys import group_key
from kvbridge.layout import KVLayout
from kvbridge.lifecycle import Ending, LoadBook, Transfers
from kvbridge.stats import TransferStats
from kvbridge.transfer import Transfer

log = logging.getLogger(__name__)


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


@dataclasses.dataclass
class _Tracked:
    info: RequestInfo
    num_computed: int = 0  # at lookup time
    hit_blocks: int = 0  # prefix the store holds
    saved_upto: int = 0  # prompt blocks saved or already present
    saving: bool = False  # a save of it went out: at its end the worker may still be reading its blocks
    writes_back: bool = False  # its load copies the loaded blocks on after its report (StoreIO.write_back)
    looked_up: bool = False  # the store was asked (the engine may ask again; the answer must not change)
    group_keys: tuple[tuple[bytes, ...], ...] = ()  # per KV-cache group, where the engine has several


class _Groups:
    """A grouped engine's requests (:attr:`EngineInfo.kv_groups`): one block per group per position,
    each stored under its own key (:func:`~kvbridge.keys.group_key`); a sliding-window group keeps, and
    so loads, only the blocks its window covers. Saves and reservations of group ``g`` go under
    request id ``rid#g``, so a store's per-request state (fs's chunk being written) stays per group."""

    def __init__(self, engine: EngineInfo):
        self.groups, self.bs = engine.kv_groups, engine.block_size

    def keys(self, tracked: _Tracked) -> tuple[tuple[bytes, ...], ...]:
        if not tracked.group_keys:
            tracked.group_keys = tuple(tuple(group_key(k, g) for k in tracked.info.block_keys) for g in range(len(self.groups)))
        return tracked.group_keys

    @staticmethod
    def rid(request_id: str, group: int) -> str:
        return f"{request_id}#{group}"

    def position(self, tracked: _Tracked, key: bytes) -> int:
        """The position of a group's key in its request."""
        for keys in self.keys(tracked):
            if key in keys:
                return keys.index(key)
        raise KeyError(key)


class StoreScheduler(SchedulerSide):
    """Scheduler side of every store: prefix lookup, load and save planning, holds (via :class:`LoadBook`)."""

    def __init__(self, index: StoreIndex, engine: EngineInfo):
        self.index = index
        self.engine = engine
        self.stats: TransferStats = index.stats
        self.loads = LoadBook()
        self._requests: dict[str, _Tracked] = {}
        self._saving_held: list[str] = []  # ended with saves out: the next plan names them held
        self._releasing: set[str] = set()  # held for their saves: reservations go with the worker's report
        self._flush: list[str] = []
        self._groups = _Groups(engine) if engine.kv_groups else None
        self._window_saves: set[str] = set()  # saved sliding-window blocks this step: the next plan flushes them

    @property
    def _saves(self) -> bool:
        return self.engine.role in ("producer", "both")

    def lookup(self, request: RequestInfo, num_computed_tokens: int) -> Lookup:
        self._check_open()
        bs = self.engine.block_size
        tracked = self._requests.setdefault(request.request_id, _Tracked(request))
        tracked.num_computed = num_computed_tokens
        if self.engine.role == "producer" or not request.block_keys or self.loads.failed_before(request.request_id):
            return Lookup(0)
        if not tracked.looked_up:  # the engine asks again every step a request waits: ask the store once
            try:
                hit = (self.index.contains_prefix(request.block_keys) if self._groups is None
                       else self._grouped_hit(tracked, num_computed_tokens))
            except KVBridgeError as exc:  # a store that cannot answer is a miss, not a failed request
                log.warning("lookup failed for %s: %s", request.request_id, exc)
                hit = 0
            tracked.looked_up = True
            tracked.hit_blocks = hit
            tracked.saved_upto = max(tracked.saved_upto, hit)
            self.index.stats.add(hits=hit, misses=len(request.block_keys) - hit)
        loadable = min(tracked.hit_blocks * bs, request.num_prompt_tokens - 1)
        return Lookup(max(0, loadable - num_computed_tokens), is_async=not self.index.layerwise)

    def _grouped_hit(self, tracked: _Tracked, computed: int) -> int:
        """The blocks a grouped engine can load: the prefix every full-attention group holds, if each
        sliding-window group holds what its window at that point covers; else none. With a state group,
        the hit ends on a block boundary where every state group holds its state (the longest such)."""
        assert self._groups is not None
        groups, keys = self._groups.groups, self._groups.keys(tracked)
        bs, prompt = self.engine.block_size, tracked.info.num_prompt_tokens
        hit = min((self.index.contains_prefix(k) for g, k in zip(groups, keys) if not g.gives_back),
                  default=len(tracked.info.block_keys))
        if not any(g.state for g in groups):
            return hit if self._holds(groups, keys, computed, min(hit * bs, prompt - 1)) else 0
        for n in range(min(hit, (prompt - 1) // bs), computed // bs, -1):  # the state at the hit's end
            if self._holds(groups, keys, computed, n * bs):
                return n
        return 0

    def _holds(self, groups: Sequence[KVGroup], keys: Sequence[Sequence[bytes]], computed: int, total: int) -> bool:
        """Whether the store holds what each window and state group needs for a load up to ``total``."""
        for group, k in zip(groups, keys):
            need = group.loaded(computed, total, self.engine.block_size)
            if group.gives_back and len(need) and self.index.contains_prefix(k[need.start : need.stop]) < len(need):
                return False
        return True

    def on_allocated(self, request: RequestInfo, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self._check_open()
        tracked = self._requests.setdefault(request.request_id, _Tracked(request))
        if num_external_tokens <= 0:
            return
        if self._groups is not None:
            self._plan_grouped_load(tracked, block_ids, tracked.num_computed + num_external_tokens)
            return
        bs = self.engine.block_size
        first = tracked.num_computed // bs
        last = -(-(tracked.num_computed + num_external_tokens) // bs)  # ceil
        keys = request.block_keys[first:last]
        source = self.index.reserve_load(request.request_id, keys)
        self._writes_back(tracked, source)
        self.loads.plan(BlockLoad(request.request_id, tuple(block_ids[first:last]), tuple(keys), source,
                                  layerwise=self.index.layerwise))

    def _writes_back(self, tracked: _Tracked, source: Any) -> None:
        """A load whose source writes back (:meth:`StoreIO.write_back`) reads the request's blocks after
        its report: the request is saving (held at its end, flushed when preempted), and where a sliding
        window may give those blocks back, flushed before the next forward pass."""
        if getattr(source, "writes_back", False):
            tracked.writes_back = True
            if self._groups is not None and any(g.gives_back for g in self._groups.groups):
                self._window_saves.add(tracked.info.request_id)

    def _plan_grouped_load(self, tracked: _Tracked, block_ids: Sequence[int], total: int) -> None:
        """One load of every group's blocks the engine keeps (group-major), each from its group's key."""
        assert self._groups is not None
        ids: list[int] = []
        keys: list[bytes] = []
        for group, mine, k in zip(self._groups.groups, split_groups(block_ids, len(self._groups.groups)),
                                  self._groups.keys(tracked)):
            for i in group.loaded(tracked.num_computed, total, self.engine.block_size):
                if i < len(mine) and mine[i] != NULL_BLOCK:
                    ids.append(mine[i])
                    keys.append(k[i])
        rid = tracked.info.request_id
        source = self.index.reserve_load(rid, keys)
        self._writes_back(tracked, source)
        self.loads.plan(BlockLoad(rid, tuple(ids), tuple(keys), source, layerwise=self.index.layerwise))

    def plan_step(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        self._check_open()
        if self._groups is not None:
            saves = [op for req in scheduled for op in self._grouped_saves(req)] if self._saves else []
        else:
            saves = [op for req in scheduled if (op := self._save_of(req)) is not None] if self._saves else []
        loads, held = self.loads.take()
        held += tuple(self._saving_held)
        flush, self._saving_held, self._flush = tuple(self._flush), [], sorted(self._window_saves)
        self._window_saves = set()
        return StepPlan(loads=loads, saves=tuple(saves), held=held, flush=flush)

    def _save_of(self, req: ScheduledRequest) -> BlockSave | None:
        """The save of the prompt blocks this step completes for ``req`` (none already present)."""
        tracked = self._requests.get(req.request_id)
        if tracked is None:
            return None
        keys = tracked.info.block_keys
        upto = min(len(keys), (req.num_computed_tokens + req.num_scheduled_tokens) // self.engine.block_size, len(req.block_ids))
        if upto <= tracked.saved_upto:
            return None
        span = range(tracked.saved_upto, upto)
        tracked.saved_upto = upto
        chosen, target = self.index.reserve_save(req.request_id, [keys[i] for i in span])
        picked = [span[i] for i in chosen]
        if not picked:
            return None
        tracked.saving = True
        return BlockSave(req.request_id, tuple(req.block_ids[i] for i in picked), tuple(keys[i] for i in picked), target)

    def _grouped_saves(self, req: ScheduledRequest) -> list[BlockSave]:
        """Per group, the save of the blocks this step completes (a sliding window's: all of them, since
        the step computes them); those of a sliding group must be over before the next forward pass,
        which may run in blocks vLLM has taken back from the window."""
        assert self._groups is not None
        tracked = self._requests.get(req.request_id)
        if tracked is None:
            return []
        groups = self._groups.groups
        ids = split_groups(req.block_ids, len(groups))
        upto = min(len(tracked.info.block_keys), (req.num_computed_tokens + req.num_scheduled_tokens) // self.engine.block_size,
                   len(ids[0]))
        if upto <= tracked.saved_upto:
            return []
        span = range(tracked.saved_upto, upto)
        tracked.saved_upto = upto
        saves = []
        for g, (group, mine, keys) in enumerate(zip(groups, ids, self._groups.keys(tracked))):
            span_g = [i for i in span if mine[i] != NULL_BLOCK]
            chosen, target = self.index.reserve_save(self._groups.rid(req.request_id, g), [keys[i] for i in span_g])
            picked = [span_g[i] for i in chosen]
            if picked:
                saves.append(BlockSave(req.request_id, tuple(mine[i] for i in picked), tuple(keys[i] for i in picked), target))
                if group.gives_back:
                    self._window_saves.add(req.request_id)
        tracked.saving = tracked.saving or bool(saves)
        return saves

    def _release(self, request_id: str, failed: Sequence[bytes] = ()) -> None:
        """Release a request's reservations (and, in a grouped engine, each group's)."""
        self.index.release(request_id, failed)
        for g in range(len(self._groups.groups) if self._groups is not None else 0):
            self.index.release(_Groups.rid(request_id, g))

    def on_report(self, report: WorkerReport) -> None:
        self._check_open()
        for result in self.loads.report(report):
            op = result.op
            failed = [k for b, k in zip(op.block_ids, op.keys) if b in result.failed]
            self.index.release(op.request_id, failed)
            tracked = self._requests.get(op.request_id)
            if tracked is not None and len(failed) == len(op.keys):
                tracked.writes_back = False  # nothing arrived: the worker wrote nothing back
            if failed and tracked is not None:  # the engine recomputes from the first failed block: save those again
                first = (tracked.info.block_keys.index(failed[0]) if self._groups is None
                         else min(self._groups.position(tracked, k) for k in failed))
                tracked.saved_upto = min(tracked.saved_upto, first)
        for rid in self._releasing & report.finished_saving:
            self._releasing.discard(rid)
            self._release(rid)

    def on_preempted(self, request_ids: Sequence[str]) -> None:
        self._check_open()
        for rid in request_ids:
            tracked = self._requests.get(rid)
            if tracked is not None and (tracked.saving or tracked.writes_back):
                self._flush.append(rid)

    def on_finished(self, request: RequestInfo, block_ids: Sequence[int]) -> FinishDecision:
        self._check_open()
        rid = request.request_id
        tracked = self._requests.pop(rid, None)
        ending, _ = self.loads.finish(rid)
        if ending is Ending.IN_FLIGHT:  # blocks still being written: released once the load reports
            return FinishDecision(delay_free=True)
        if tracked is not None and (tracked.saving or (tracked.writes_back and ending is not Ending.DROPPED)):
            # a save may still be reading the blocks: the worker reports the request once it is over;
            # the save's reservations (cpu slots it writes) last until then
            self._saving_held.append(rid)
            self._releasing.add(rid)
            return FinishDecision(delay_free=True)
        self._release(rid)
        return FinishDecision()

    def close(self) -> None:
        if not self._closed:
            self.index.close()
        super().close()


class StoreWorker(WorkerSide):
    """Worker side of every store: loads and saves on the IO thread (:class:`Transfers`), never in the
    forward pass."""

    def __init__(self, io: StoreIO, engine: EngineInfo):
        self.io = io
        self.engine = engine
        self.stats: TransferStats = io.stats
        self.transfers = Transfers(f"{engine.engine_id}-io")
        # layerwise loads get their own thread: behind a save on the IO thread, the forward pass would wait
        self.layer_transfers = Transfers(f"{engine.engine_id}-layers") if isinstance(io, LayerwiseIO) else None
        self._layers: list[list[threading.Event]] = []  # per layerwise load of this step: a flag per layer
        self._saves: tuple[BlockSave, ...] = ()

    def register(self, layout: KVLayout) -> None:
        super().register(layout)
        self.io.attach(layout)

    def start_step(self, plan: StepPlan) -> None:
        layout = self._require_layout()
        if plan.flush:  # preempted requests: their blocks may be overwritten by this step's forward pass
            self.transfers.wait(plan.flush)
        self._saves = plan.saves
        self._layers = []
        for op in plan.loads:
            if op.layerwise and self.layer_transfers is not None:
                self.layer_transfers.track(self._begin_layerwise(op, layout, self.layer_transfers),
                                           functools.partial(self._loaded, layout))
            else:
                started = self._started(self.io.start_load, op, layout)
                self.transfers.track(started or self.transfers.run(op, functools.partial(self.io.load, op, layout)),
                                     functools.partial(self._loaded, layout))
        self.transfers.hold(plan.held)

    def _begin_layerwise(self, op: BlockLoad, layout: KVLayout, transfers: Transfers) -> Transfer:
        """Check the load, then copy it layer by layer, on its own thread; ``wait_layer(i)`` waits for layer i."""
        assert isinstance(self.io, LayerwiseIO)
        io = self.io
        flags = [threading.Event() for _ in range(layout.num_layers)]
        self._layers.append(flags)

        def run() -> Sequence[int]:
            try:
                valid, copy = io.load_layers(op, layout)
                for layer, flag in enumerate(flags):
                    copy(layer)
                    flag.set()
            finally:
                for flag in flags:  # never leave the forward pass waiting (a raise fails every block)
                    flag.set()
            return op.block_ids[valid:]

        return transfers.run(op, run)

    def _started(self, start: Callable[[Any, KVLayout], Transfer | None], op: BlockLoad | BlockSave,
                 layout: KVLayout) -> Transfer | None:
        """``start(op, layout)`` (:meth:`StoreIO.start_load` or ``start_save``): the handle of what the store
        started on its native threads, or ``None`` for the IO thread to do it — always when something is
        queued there (a started transfer must not overtake it), or when starting failed (the IO thread then
        reports what fails, the ordinary way). No hand-off to the IO thread and back: a large share of a small
        move (``kvbridge bench --backends cpu --ops load``, its 8 MiB rows)."""
        if self.transfers.queued():
            return None
        try:
            return start(op, layout)
        except Exception as exc:
            log.debug("native start of %s failed (%s): the IO thread moves it", op.request_id, exc)
            return None

    def wait_layer(self, layer: int) -> None:
        self._check_open()
        for flags in self._layers:
            flags[layer].wait()

    def _loaded(self, layout: KVLayout, transfer: Transfer) -> None:
        """A load is over, however it ran: counted, and its write-back (a chain's promotion) kept to run once
        the load is reported (the request held until that is over)."""
        op = transfer.op
        assert isinstance(op, BlockLoad)
        failed = transfer.failed()
        self._count_load(op, layout, len(failed), transfer.seconds)
        if getattr(op.source, "writes_back", False) and len(failed) < len(op.block_ids):
            back = BlockSave(op.request_id, op.block_ids, op.keys)
            self.transfers.after_load(back, functools.partial(self.io.write_back, op, layout, sorted(failed)),
                                      self._written_back)

    def _count_load(self, op: BlockLoad, layout: KVLayout, failed: int, seconds: float) -> None:
        ok = len(op.block_ids) - failed
        self.stats.add(
            loads=1,
            load_blocks=ok,
            load_bytes=ok * layout.num_layers * layout.block_bytes,
            load_seconds=seconds,
            load_failures=int(bool(failed)),
            failed_blocks=failed,
        )

    def finish_step(self) -> None:
        layout = self._require_layout()
        self._layers = []  # every layer was waited for by now (an engine that skipped some wants none)
        saves, self._saves = self._saves, ()
        if not saves:
            return
        ready = _forward_done(layout)
        for op in saves:
            started = self._started(self.io.start_save, op, layout) if ready is None else None
            if started is None:
                started = self.transfers.run(op, functools.partial(self.io.save, op, layout),
                                             before=None if ready is None else ready.synchronize)
            self.transfers.track(started, functools.partial(self._saved, layout))

    def _saved(self, layout: KVLayout, transfer: Transfer) -> None:
        """A save is over, however it ran: counted (a failed one loses a cache entry, never the request)."""
        if transfer.failed() or transfer.error is not None:
            self.stats.add(save_failures=1)
            return
        n = len(transfer.op.block_ids)
        self.stats.add(saves=1, save_blocks=n, save_bytes=n * layout.num_layers * layout.block_bytes,
                       save_seconds=transfer.seconds)

    def _written_back(self, transfer: Transfer) -> None:
        if transfer.error is not None:
            self.stats.add(save_failures=1)

    def poll(self) -> WorkerReport:
        self._check_open()
        report = self.transfers.poll()
        if self.layer_transfers is not None:
            report = WorkerReport.merge([report, self.layer_transfers.poll()])
        return report

    def wait_idle(self, timeout: float | None = None) -> bool:
        self._check_open()
        idle = self.layer_transfers is None or self.layer_transfers.wait(timeout=timeout)
        return self.transfers.wait(timeout=timeout) and idle

    def close(self) -> None:
        if not self._closed:
            if self.layer_transfers is not None:
                self.layer_transfers.close()
            self.transfers.close()
            self.io.close()
        super().close()


def _forward_done(layout: KVLayout) -> Any:
    """An event the IO thread waits on before reading KV the forward pass wrote (``None`` on the CPU,
    where the forward pass is over when ``finish_step`` runs)."""
    if layout.device_type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(layout.device))
    return event


__all__ = ["LayerwiseIO", "StoreBackend", "StoreIO", "StoreIndex", "StoreScheduler", "StoreWorker"]
