"""Scheduler side of every store: :class:`StoreScheduler` over a :class:`~kvbridge.store.base.StoreIndex`
(prefix lookup, load and save planning, holds), with :class:`_Groups` for an engine of several KV-cache
groups."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from kvbridge.contract import (
    NULL_BLOCK,
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
    split_groups,
)
from kvbridge.errors import KVBridgeError
from kvbridge.keys import group_key
from kvbridge.lifecycle import Ending, LoadBook
from kvbridge.stats import TransferStats
from kvbridge.store.base import StoreIndex

log = logging.getLogger(__name__)


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


__all__ = ["StoreScheduler"]
