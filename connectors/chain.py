"""``chain`` — ordered store tiers (fastest first) behind one connector, e.g. ``cpu`` then ``fs``.

Options: ``tiers`` is a list of ``{"backend": NAME, **that backend's options}``; each tier is built
with :func:`kvbridge.registry.create` when the chain is (an unknown name raises
:class:`~kvbridge.errors.UnknownBackend` there) and must be a store (a peer is a
:class:`~kvbridge.errors.ConfigError`). Each side of the chain opens the same side of every tier.

Semantics:

- **Lookup**: the longest prefix of blocks each held by *some* tier (blocks 0-3 in ``cpu`` and 4-7
  only in ``fs`` make a prefix of 8).
- **Loads**: every block comes from the first (fastest) tier that holds it; should that tier fail,
  from the next one holding it. Every tier holding a block reserves it, so the plan carries, per
  tier, the positions it holds and that tier's own reservation (``BlockLoad.source`` is a
  :class:`ChainLoad`; a save's target a :class:`ChainSave`).
- **Promotion** (``promote``, default on): a block served by a slower tier is saved into every
  faster tier from the KV, on the IO thread, *after* the load is reported (:meth:`ChainIO.write_back`):
  the request no longer waits for that second copy. It is a save of the request, so the engine keeps
  its blocks until it is over (held at the request's end, flushed when preempted; before the next
  forward pass where a sliding window may give them back). Slots in the faster tier are reserved on
  the scheduler side with the load. A tier whose reservation names its own placement (``target`` not
  ``None``, as ``cpu``'s slots) is promoted into only when every block of its share arrived; the bytes
  of a block that failed are never stored.
- **Saves**: write-through to every tier (each tier picks which blocks it takes, via its own
  ``reserve_save``), at once: a tier that starts its saves on native threads (``cpu``) copies while the
  next one saves. ``write_back`` is not implemented and is refused.
- **Degradation**: a tier that raises (lookup, reservation, load or save) is left out of that call
  and counted in ``stats.tier_failures``; the others still serve and store. A request fails only
  where no tier could deliver a block (reported as failed blocks, which the engine recomputes).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from kvbridge import registry
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import ConfigError, TransferError
from kvbridge.layout import KVLayout
from kvbridge.options import require
from kvbridge.stats import TransferStats
from kvbridge.store import StoreBackend, StoreIndex, StoreIO
from kvbridge.transfer import Fallback, Started, Transfer

log = logging.getLogger(__name__)
T = TypeVar("T")
S = TypeVar("S", StoreIndex, StoreIO)


@dataclasses.dataclass(frozen=True)
class ChainOptions:
    """``tiers``: ``[{"backend": NAME, ...options}, ...]``, fastest first. ``promote``: copy blocks
    found in a slower tier into the faster ones. ``write_back``: not implemented (must stay false)."""

    tiers: tuple[dict[str, Any], ...]
    promote: bool = True
    write_back: bool = False

    def __post_init__(self) -> None:
        require(len(self.tiers) > 0, "chain: option 'tiers' must name at least one tier")
        for i, tier in enumerate(self.tiers):
            require(
                isinstance(tier, Mapping) and isinstance(tier.get("backend"), str),
                f"chain: tier {i} must be a mapping with a 'backend' name, got {tier!r}",
            )
        require(not self.write_back, "chain: write_back is not implemented; saves are write-through to every tier")


@dataclasses.dataclass
class ChainStats(TransferStats):
    """:class:`TransferStats` plus tier failures absorbed and blocks promoted into faster tiers."""

    tier_failures: int = 0
    promoted_blocks: int = 0


_FAILED: Any = object()  # what a tier call that raised returns


TierShare = tuple[int, tuple[int, ...], Any]  # (tier, positions in the op, that tier's own payload)


@dataclasses.dataclass(frozen=True)
class ChainLoad:
    """``BlockLoad.source`` of a chain: per tier holding blocks, its share; per faster tier, the
    positions to promote into it and its reservation."""

    tiers: tuple[TierShare, ...] = ()
    promote: tuple[TierShare, ...] = ()

    @property
    def writes_back(self) -> bool:
        """Whether the worker promotes after the load (:meth:`kvbridge.store.StoreIO.write_back`)."""
        return bool(self.promote)


@dataclasses.dataclass(frozen=True)
class ChainSave:
    """``BlockSave.target`` of a chain: per tier, the positions it takes and its own target."""

    tiers: tuple[TierShare, ...] = ()


class _Tiers(Generic[S]):
    """One side of every tier, composed; ``tiers[i]`` is tier ``i``'s own handle (fastest first)."""

    stats: Any  # the side's ChainStats (typed by the side's own base)

    def __init__(self, tiers: Sequence[S], names: Sequence[str]):
        self.stats = ChainStats()
        self.tiers: list[S] = list(tiers)
        self.names = list(names)
        self._warned: set[tuple[int, str]] = set()

    def _call(self, tier: int, what: str, fn: Callable[..., T], *args: Any) -> T:
        """Run one tier's call; a raise is logged (once per tier and call), counted, and absorbed."""
        try:
            return fn(*args)
        except Exception as exc:
            self._tier_failed(tier, what, exc)
            return _FAILED  # type: ignore[no-any-return]

    def _tier_failed(self, tier: int, what: str, exc: Exception) -> None:
        """A tier's call raised: logged (once per tier and call), counted, absorbed."""
        self.stats.add(tier_failures=1)
        level = logging.DEBUG if (tier, what) in self._warned else logging.WARNING
        self._warned.add((tier, what))
        log.log(level, "chain: tier %d (%s) failed in %s: %s", tier, self.names[tier], what, exc)

    def close(self) -> None:
        for t, tier in enumerate(self.tiers):
            self._call(t, "close", tier.close)


class ChainIndex(_Tiers[StoreIndex], StoreIndex):
    """Scheduler side: every tier's index."""

    def __init__(self, engine: EngineInfo, tiers: Sequence[StoreIndex], names: Sequence[str], promote: bool):
        StoreIndex.__init__(self, engine)
        _Tiers.__init__(self, tiers, names)
        self.promote = promote

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        pos, dead = 0, set()
        advanced = True
        while advanced and pos < len(keys):  # each tier extends the prefix where the others stop
            advanced = False
            for t, tier in enumerate(self.tiers):
                if t in dead or pos >= len(keys):
                    continue
                m = self._call(t, "contains_prefix", tier.contains_prefix, keys[pos:])
                if m is _FAILED:
                    dead.add(t)
                elif m:
                    pos, advanced = pos + m, True
        return pos

    def _members(self, t: int, keys: Sequence[bytes]) -> list[int] | None:
        """Which of ``keys`` (positions) tier ``t`` holds; ``None`` if it failed."""
        out = self._call(t, "members", self.tiers[t].members, keys)
        return None if out is _FAILED else out

    def reserve_load(self, request_id: str, keys: Sequence[bytes]) -> ChainLoad:
        loads, first = [], dict[int, int]()  # first: position -> the fastest tier that reserved it
        for t, tier in enumerate(self.tiers):
            # every tier holding a block reserves it: the fastest serves it, the others stand by in
            # case it fails (pins in a slower tier last only as long as this load)
            mine = self._members(t, keys)
            if not mine:
                continue
            held = keys if len(mine) == len(keys) else [keys[i] for i in mine]
            source = self._call(t, "reserve_load", tier.reserve_load, request_id, held)
            if source is _FAILED:
                continue
            loads.append((t, tuple(mine), source))
            first = dict.fromkeys(mine, t) | first  # a faster tier's claim stands
        promote, faster = [], set[int]()  # faster: the positions tiers up to f reserved
        for f, tier in enumerate(self.tiers if self.promote else ()):
            faster.update(*(mine for t, mine, _ in loads if t == f))
            slower = sorted(first.keys() - faster)
            if not slower:
                continue
            reserved = self._call(f, "reserve_save", tier.reserve_save, request_id, [keys[i] for i in slower])
            if reserved is _FAILED:
                continue
            chosen, target = reserved
            if len(chosen):
                promote.append((f, tuple(slower[i] for i in chosen), target))
        return ChainLoad(tuple(loads), tuple(promote))

    def reserve_save(self, request_id: str, keys: Sequence[bytes]) -> tuple[Sequence[int], ChainSave]:
        per_tier = []
        for t, tier in enumerate(self.tiers):
            reserved = self._call(t, "reserve_save", tier.reserve_save, request_id, keys)
            if reserved is not _FAILED:
                per_tier.append((t, list(reserved[0]), reserved[1]))
        union = sorted({i for _, chosen, _ in per_tier for i in chosen})
        at = {p: i for i, p in enumerate(union)}  # the plan's save holds only the union, in order
        plan = tuple((t, tuple(at[p] for p in chosen), target) for t, chosen, target in per_tier if chosen)
        return union, ChainSave(plan)

    def release(self, request_id: str, failed: Sequence[bytes] = ()) -> None:
        for t, tier in enumerate(self.tiers):
            self._call(t, "release", tier.release, request_id, failed)


def _chain_load(op: BlockLoad) -> ChainLoad:
    """``op``'s plan across the tiers (a load the scheduler side planned none for: the empty plan)."""
    return op.source if isinstance(op.source, ChainLoad) else ChainLoad()


def _picked(op: BlockLoad | BlockSave, positions: Sequence[int]) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
    """The block ids and keys of ``op`` at ``positions``: ``op``'s own where that is all of them, in order
    (a tier that serves or stores the whole request, the common case, costs no loop)."""
    if len(positions) == len(op.block_ids) and list(positions) == list(range(len(positions))):
        return op.block_ids, op.keys
    return tuple(op.block_ids[i] for i in positions), tuple(op.keys[i] for i in positions)


class ChainIO(_Tiers[StoreIO], StoreIO):
    """Worker side: every tier's IO."""

    def __init__(self, engine: EngineInfo, tiers: Sequence[StoreIO], names: Sequence[str]):
        StoreIO.__init__(self, engine)
        _Tiers.__init__(self, tiers, names)

    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        source = _chain_load(op)
        return self._load_from(op, layout, source.tiers, set(range(len(op.block_ids))))

    def _load_from(self, op: BlockLoad, layout: KVLayout, shares: Sequence[TierShare], need: set[int]) -> list[int]:
        """Positions ``need`` of ``op`` asked of each tier's share in turn (a tier asked for what the ones
        before it failed); the block ids none of them served."""
        slot_bytes = layout.num_layers * layout.block_bytes
        for t, positions, tier_source in shares:
            todo = [i for i in positions if i in need]
            if not todo:
                continue
            if len(todo) < len(positions) and tier_source is not None:
                todo = list(positions)  # the tier's reservation covers its whole share: load all of it again
            sub = BlockLoad(op.request_id, *_picked(op, todo), tier_source)
            answer = self._call(t, "load", self.tiers[t].load, sub, layout)
            bad = set(sub.block_ids) if answer is _FAILED else set(answer)
            arrived = [i for i in todo if op.block_ids[i] not in bad]
            need.difference_update(arrived)
            self.tiers[t].stats.add(
                loads=1, load_blocks=len(arrived), load_bytes=len(arrived) * slot_bytes, failed_blocks=len(bad)
            )
        return [b for i, b in enumerate(op.block_ids) if i in need]

    def start_load(self, op: BlockLoad, layout: KVLayout) -> Transfer | None:
        """A load whose first tier serves every block and starts loads from the engine's thread (a P/D
        consumer's chain reading the shared fs, or its own cpu): started by that tier, and counted in its
        stats once over. The blocks it fails are asked of the next tiers on the IO thread, as :meth:`load`
        asks them: a :class:`~kvbridge.transfer.Fallback` the core starts. The worker promotes what arrived
        once the load is reported. ``None`` (the IO thread loads it) otherwise."""
        source = _chain_load(op)
        if not source.tiers or list(source.tiers[0][1]) != list(range(len(op.block_ids))):
            return None
        t, _, tier_source = source.tiers[0]
        sub = BlockLoad(op.request_id, op.block_ids, op.keys, tier_source)
        first = self._call(t, "start_load", self.tiers[t].start_load, sub, layout)
        if first is None or first is _FAILED:
            return None
        tier = Started(op, first, functools.partial(self._tier_loaded, t, first, layout))
        if len(source.tiers) == 1:
            return tier
        return Fallback(tier, functools.partial(self._next_tiers, op, layout, source.tiers[1:]))

    def _tier_loaded(self, t: int, load: Transfer, layout: KVLayout) -> frozenset[int]:
        """Tier ``t``'s started ``load`` is over (on the thread that polls): counted in its stats (one that
        raised, as a tier failure too); the block ids it failed."""
        bad = load.failed()
        if load.error is not None:
            self._tier_failed(t, "load", load.error)
        arrived = len(load.op.block_ids) - len(bad)
        slot_bytes = layout.num_layers * layout.block_bytes
        self.tiers[t].stats.add(loads=1, load_blocks=arrived, load_bytes=arrived * slot_bytes, failed_blocks=len(bad))
        return bad

    def _next_tiers(self, op: BlockLoad, layout: KVLayout, shares: Sequence[TierShare], first: Transfer) -> list[int]:
        """On the IO thread: the blocks the first tier failed, asked of the next ones; those none served."""
        bad = first.failed()
        return self._load_from(op, layout, shares, {i for i, b in enumerate(op.block_ids) if b in bad})

    def write_back(self, op: BlockLoad, layout: KVLayout, failed: Sequence[int]) -> None:
        """Promote what a slower tier served into the faster ones (the load was reported already)."""
        source = _chain_load(op)
        lost = set(failed)
        slot_bytes = layout.num_layers * layout.block_bytes
        for f, positions, target in source.promote:
            keep = [i for i in positions if op.block_ids[i] not in lost]
            if len(keep) < len(positions) and target is not None:
                continue  # the tier placed every block itself: all or nothing
            sub_save = BlockSave(op.request_id, *_picked(op, keep), target)
            if sub_save.block_ids and self._call(f, "save", self.tiers[f].save, sub_save, layout) is not _FAILED:
                n = len(sub_save.block_ids)
                self.stats.add(promoted_blocks=n)
                self.tiers[f].stats.add(saves=1, save_blocks=n, save_bytes=n * slot_bytes)

    def save(self, op: BlockSave, layout: KVLayout) -> None:
        """Write-through: every tier's share, at once where a tier starts its save on native threads (the cpu
        tier's copy runs while the fs tier writes here, instead of one after the other).
        Runs on the IO thread, and returns only once every tier's save is over, so nothing queued after it
        overtakes it."""
        plan: tuple[TierShare, ...] = op.target.tiers if isinstance(op.target, ChainSave) else ()
        subs = [(t, BlockSave(op.request_id, *_picked(op, positions), target)) for t, positions, target in plan]
        started = [(t, sub, self._call(t, "start_save", self.tiers[t].start_save, sub, layout)) for t, sub in subs]
        stored = False
        for t, sub, handle in started:
            if handle is None:  # this tier saves here, while the started ones copy
                stored |= self._saved(t, sub, layout, self.tiers[t].save, sub, layout)
        for t, sub, handle in started:
            if handle is not None and handle is not _FAILED:
                stored |= self._saved(t, sub, layout, _complete, handle)
        if plan and not stored:
            raise TransferError(f"chain: every tier failed to save {op.request_id}")  # counted by the worker

    def _saved(self, t: int, sub: BlockSave, layout: KVLayout, fn: Callable[..., Any], *args: Any) -> bool:
        """Tier ``t``'s save of ``sub`` by ``fn(*args)``, counted in its stats; whether it stored."""
        if self._call(t, "save", fn, *args) is _FAILED:
            return False
        n = len(sub.block_ids)
        self.tiers[t].stats.add(saves=1, save_blocks=n, save_bytes=n * layout.num_layers * layout.block_bytes)
        return True

    def attach(self, layout: KVLayout) -> None:
        for tier in self.tiers:  # a tier that cannot take this layout is a start-up error, not degraded
            tier.attach(layout)


def _complete(save: Transfer) -> None:
    """Wait for a tier's started save and complete it; raise what failed it."""
    save.wait()
    if save.failed():
        raise save.error or TransferError(f"chain: a tier did not store {save.op.request_id}")


class ChainBackend(StoreBackend):
    """The ``chain`` backend: builds its tiers at construction; ``tiers[i]`` is tier ``i``'s backend."""

    name = "chain"
    options_type = ChainOptions

    def __init__(self, options: ChainOptions):
        super().__init__(options)
        self.tiers: list[StoreBackend] = []
        for i, spec in enumerate(options.tiers):
            name = spec["backend"]
            try:
                backend = registry.create(name, {k: v for k, v in spec.items() if k != "backend"})
            except ConfigError as exc:  # the same error (UnknownBackend stays UnknownBackend), located
                raise type(exc)(f"chain tier {i}: {exc}") from exc
            if not isinstance(backend, StoreBackend):
                raise ConfigError(f"chain tier {i}: {name!r} is a {backend.kind} backend; a chain tier must be a store")
            self.tiers.append(backend)

    def _open_each(self, opener: Callable[[StoreBackend], S]) -> list[S]:
        opened: list[S] = []
        try:
            for tier in self.tiers:
                opened.append(opener(tier))
        except BaseException:
            for handle in opened:
                handle.close()
            raise
        return opened

    def open_index(self, engine: EngineInfo) -> ChainIndex:
        names = [t.name for t in self.tiers]
        return ChainIndex(engine, self._open_each(lambda t: t.open_index(engine)), names, self.options.promote)

    def open_io(self, engine: EngineInfo) -> ChainIO:
        return ChainIO(engine, self._open_each(lambda t: t.open_io(engine)), [t.name for t in self.tiers])


BACKEND = ChainBackend
