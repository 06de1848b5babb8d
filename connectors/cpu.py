"""``cpu`` — a bounded host-memory offload tier for one engine (prefix caching beyond device memory).

The worker side allocates, once, at :meth:`CpuPool.attach`, a pool of ``capacity_bytes //
slot_bytes`` fixed-size *slots* — uint8 ``[num_slots, num_layers, block_bytes]``, pinned when the KV
lives on a GPU, handled as its ``[num_layers, num_slots, block_bytes]`` view — where one slot holds one
block in every layer, in one stretch of memory (a run of slots is one stretch too). It never grows.

The *index* (key -> slot, recency order, pins) lives on the scheduler side (:class:`CpuIndex`), which
has no KV tensors but must answer :meth:`~kvbridge.store.StoreIndex.contains_prefix`. It assigns
slots in :meth:`~CpuIndex.reserve_save` and looks them up in :meth:`~CpuIndex.reserve_load`; the slot
ids travel to the worker in ``BlockSave.target`` / ``BlockLoad.source`` as :class:`CpuSlots`.
Both sides must agree on the slot count, so both derive it from ``capacity_bytes`` and the bytes
of one block across all layers (``slot_bytes``), which the scheduler learns from
``EngineInfo.block_bytes`` (filled in by the engine adapter) or, failing that, from the
``block_bytes`` option; the worker checks the value against its registered layout.

Semantics:

- A slot is *pinned* from its reservation until :meth:`~CpuIndex.release` of the request: slots a
  load reads until the load is reported, slots a save writes until the request ends and the worker
  reports its saves over. Pinned slots are never evicted.
- When no slot is free, the least recently used unpinned one is evicted (``eviction="lru"``; with
  ``"fifo"`` a hit does not refresh an entry). When nothing can be evicted, the save of those blocks
  is skipped and counted in ``stats.skipped_saves`` — never an error for the request.
- The worker tags every slot with the key it holds, set only once the copy is complete: a load
  whose slot does not carry the expected key (a failed or skipped write) is a failed block, so
  the pool never hands out bytes that are not the key's.
- ``layerwise=True`` loads *synchronously*, inside the step that computes the rest of the prompt: the
  slots' tags are checked first, then the IO thread copies layer after layer and the forward pass's
  ``wait_layer(i)`` waits only for layer ``i`` (vLLM: ``Lookup(is_async=False)``, no extra engine step
  for the request to wait in). Default off: the load runs a step ahead, asynchronously.
- Moves are vectorized, never a Python loop over blocks: with a CPU KV, one native call copies every
  piece of every layer (``kvbridge._core.copy_start``: addresses from block ids and slots in one numpy
  expression each); else one ``index_select``/``index_copy_`` per layer (or one slice copy when the
  slots are consecutive).
- With a CPU KV a load or save *starts* on the native module's threads from the engine's own call
  (``start_load`` / ``start_save``): no hand-off to the IO thread and back, which cost ~0.1-0.2 ms
  each way of an 8 MiB move here. A poll that sees it over reports it (a save's slots get their tags
  then; a load of such a slot planned earlier waits for its save first). Copies from 8 MiB are cut
  between the two threads; saves write the pool with streaming stores (the pool is not read soon:
  no read-for-ownership of its lines), loads from 32 MiB too. Where something is queued on the IO
  thread, or the KV is on a GPU, the IO thread moves it, in plan order (a save there, as a chain's
  promotion, copies on the IO thread itself: background work leaves the native threads to loads).
- With a KV on a GPU the pool is pinned and every copy is one DMA per run of consecutive slots, on the
  store's own streams (loads and saves each have one, so neither waits for the forward pass queued
  after it): a save gathers its blocks on the device into the pool's order (slot-major), then copies
  each run down; a load copies each run up, then scatters on the device. Slots come in runs (free
  slots are handed out 0, 1, 2, ...; LRU evicts old runs together), so a request costs a few copies;
  a pool so fragmented that a request spans more than :data:`_MAX_RUNS` runs goes through one
  ``index_select``/``index_copy_`` on the host instead. A layerwise load on a GPU copies every layer
  up at its first layer (a layer of a slot run is not one stretch), then scatters layer by layer.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from kvbridge import native
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import ConfigError, KVBridgeError, LayoutError
from kvbridge.layout import BlockAddressing, KVLayout, block_words, coalesce
from kvbridge.options import require
from kvbridge.stats import TransferStats
from kvbridge.store import StoreBackend, StoreIndex, StoreIO


@dataclasses.dataclass(frozen=True)
class CpuOptions:
    """``capacity_bytes``: size of the host pool (required). ``block_bytes``: bytes of one block across
    all layers of a rank, for when the engine does not report it (0: take it from the engine)."""

    capacity_bytes: int
    block_bytes: int = 0
    eviction: Literal["lru", "fifo"] = "lru"
    layerwise: bool = False  # load inside the step, layer by layer, while the forward pass runs (see the module)

    def __post_init__(self) -> None:
        require(self.capacity_bytes > 0, f"cpu: capacity_bytes must be positive, got {self.capacity_bytes}")
        require(self.block_bytes >= 0, f"cpu: block_bytes must be >= 0, got {self.block_bytes}")


@dataclasses.dataclass
class CpuStats(TransferStats):
    """:class:`TransferStats` plus the saves skipped because every slot was pinned."""

    skipped_saves: int = 0


def _declared_slot_bytes(engine: EngineInfo, options: CpuOptions) -> int:
    """The slot size both sides can know before any KV exists; 0 when nobody said."""
    from_engine = int(getattr(engine, "block_bytes", 0) or 0)  # optional EngineInfo field
    if from_engine and options.block_bytes and from_engine != options.block_bytes:
        raise ConfigError(f"cpu: option block_bytes={options.block_bytes} but the engine reports {from_engine}")
    return from_engine or options.block_bytes


def _num_slots(capacity_bytes: int, slot_bytes: int) -> int:
    slots = capacity_bytes // slot_bytes
    require(slots > 0, f"cpu: capacity_bytes={capacity_bytes} holds no block of {slot_bytes} bytes")
    return slots


class CpuIndex(StoreIndex):
    """Scheduler side: which key sits in which slot, in recency order, and which slots are pinned."""

    def __init__(self, engine: EngineInfo, options: CpuOptions):
        super().__init__(engine)
        self.stats: CpuStats = CpuStats()
        self.layerwise = options.layerwise
        slot_bytes = _declared_slot_bytes(engine, options)
        if not slot_bytes:
            raise ConfigError(
                "cpu: the scheduler side cannot size the pool: the engine reports no block_bytes "
                "(bytes of one block across all layers); set the cpu option 'block_bytes'"
            )
        self.num_slots = _num_slots(options.capacity_bytes, slot_bytes)
        self._touch = options.eviction == "lru"
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...: runs
        self._pins = [0] * self.num_slots  # loads and saves reading or writing each slot (_count)
        self._held: dict[str, list[int]] = {}  # request -> slots it pinned
        self._orphans: set[int] = set()  # forgotten slots still pinned by someone
        self._lock = threading.Lock()

    # The scheduler's calls go through C (map, set and numpy operations), not a Python loop per block:
    # at 1024 tokens (64 blocks) a loop cost ~0.1 ms of every request's step.
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        here = list(map(self._slots.__contains__, keys))
        try:
            return here.index(False)
        except ValueError:
            return len(here)

    def members(self, keys: Sequence[bytes]) -> list[int]:
        held = self._slots.keys() & keys  # one set operation in C: a prompt this tier lacks costs no loop
        if len(held) == len(keys):  # all of them (keys are distinct: each names its whole prefix)
            return list(range(len(keys)))
        return [i for i, key in enumerate(keys) if key in held] if held else []

    def _pin(self, request_id: str, slots: Sequence[int]) -> None:
        _count(self._pins, slots, 1)
        self._held.setdefault(request_id, []).extend(slots)

    def reserve_load(self, request_id: str, keys: Sequence[bytes]) -> CpuSlots:
        with self._lock:
            slots = tuple(map(self._slots.get, keys, itertools.repeat(-1)))  # -1: gone since lookup (the worker fails it)
            held = keys if -1 not in slots else list(itertools.compress(keys, [s >= 0 for s in slots]))
            if held:
                self._pin(request_id, [s for s in slots if s >= 0] if held is not keys else slots)
                if self._touch:
                    collections.deque(map(self._slots.move_to_end, held), maxlen=0)  # each one used now
        return CpuSlots(slots)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, slot in self._slots.items():  # oldest first; pinned ones are skipped, never evicted
            if not self._pins[slot]:
                del self._slots[key]
                self.stats.add(evictions=1)
                return slot
        return None

    def reserve_save(self, request_id: str, keys: Sequence[bytes]) -> tuple[Sequence[int], CpuSlots]:
        with self._lock:
            if len(self._free) >= len(keys) and self._slots.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
                return self._reserve_free(request_id, keys)
            return self._reserve_each(request_id, keys)

    def _reserve_free(self, request_id: str, keys: Sequence[bytes]) -> tuple[Sequence[int], CpuSlots]:
        """Every key new and a free slot for each (the common case: a prompt this tier lacks): the slots
        taken at once, as ``_take_slot`` would hand them out one by one (the lock held)."""
        n = len(keys)
        slots = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        self._slots.update(zip(keys, slots))
        self._pin(request_id, slots)
        return range(n), CpuSlots(tuple(slots))

    def _reserve_each(self, request_id: str, keys: Sequence[bytes]) -> tuple[Sequence[int], CpuSlots]:
        """Key by key: held ones refreshed, new ones given a free or an evicted slot (the lock held)."""
        positions, slots = [], []
        for i, key in enumerate(keys):
            if key in self._slots:  # already held: a use, not a write
                if self._touch:
                    self._slots.move_to_end(key)
                continue
            slot = self._take_slot()
            if slot is None:  # nothing evictable now; the rest would fail the same way
                self.stats.add(skipped_saves=sum(k not in self._slots for k in keys[i:]))
                break
            self._slots[key] = slot
            self._pin(request_id, [slot])
            positions.append(i)
            slots.append(slot)
        return positions, CpuSlots(tuple(slots))

    def release(self, request_id: str, failed: Sequence[bytes] = ()) -> None:
        with self._lock:
            held = self._held.pop(request_id, ())
            _count(self._pins, held, -1)
            for slot in self._orphans.intersection(held) if self._orphans else ():
                if not self._pins[slot]:  # its last pin went: free it now
                    self._orphans.discard(slot)
                    self._free.append(slot)
            for key in failed:  # a reservation whose bytes never came, or a slot that failed its check
                slot = self._slots.pop(key, -1)
                if slot < 0:
                    continue
                if self._pins[slot]:
                    self._orphans.add(slot)  # freed when its last pin goes
                else:
                    self._free.append(slot)


def _count(pins: list[int], slots: Sequence[int], delta: int) -> None:
    """``pins[s] += delta`` for each ``s`` of ``slots``, a slot named twice counted twice, iterated in C (``map``
    pulls one slot through the get, the add and the set before the next). ``np.add.at`` did the same in
    100-400 us of a cold call here against 20-180 (a release after each load, on the scheduler's step)."""
    collections.deque(map(pins.__setitem__, slots, map(delta.__add__, map(pins.__getitem__, slots))), maxlen=0)


@dataclasses.dataclass(frozen=True)
class CpuSlots:
    """The cpu tier's plan payload (``BlockLoad.source`` / ``BlockSave.target``): a slot per block,
    -1 for a block gone from the index since lookup (the worker reports it failed)."""

    slots: tuple[int, ...]


def _slots(payload: Any, n: int) -> list[int]:
    if not isinstance(payload, CpuSlots) or len(payload.slots) != n:
        raise KVBridgeError(f"cpu: the plan names no slot for each of its {n} blocks ({payload!r})")
    return list(payload.slots)


class CpuPool(StoreIO):
    """Worker side: the slot pool itself, and the key each slot holds (so a load can verify it)."""

    def __init__(self, engine: EngineInfo, options: CpuOptions):
        super().__init__(engine)
        self.stats: CpuStats = CpuStats()
        self.options = options
        self.layerwise = options.layerwise
        self.pool: torch.Tensor | None = None
        self._tags: list[bytes | None] = []
        self._stream: Any = None  # the loads' own CUDA stream
        self._save_stream: Any = None  # the saves' (a save runs on the IO thread while loads run)
        # per layer: (KV, pool) as rows of int32 words, the targets of index_copy_ on the CPU (on the CPU,
        # index_copy_ into rows of int32 runs ~1.3-2x faster than into a 4-d bf16 block view; index_select
        # is the other way round, so gathers keep the layout's typed views)
        self._words: list[tuple[Any, Any]] | None = None
        # a CPU KV: (native module, the KV's addressing, the pool's) for one memcpy call per load or save
        self._native: tuple[Any, BlockAddressing, BlockAddressing] | None = None
        # saves running on the native threads whose slots are not tagged yet (the poll completes them;
        # a load of one of their slots waits for it first): the running copy, its slots and keys
        self._saving: list[tuple[Any, list[int], Sequence[bytes]]] = []
        self._saving_lock = threading.Lock()  # the polling thread, the IO thread

    def attach(self, layout: KVLayout) -> None:
        slot_bytes = layout.num_layers * layout.block_bytes
        declared = _declared_slot_bytes(self.engine, self.options)
        if declared and declared != slot_bytes:  # the scheduler would count a different number of slots
            raise LayoutError(f"cpu: KV blocks are {slot_bytes} bytes over all layers, the engine declared {declared}")
        num_slots = _num_slots(self.options.capacity_bytes, slot_bytes)
        pin = layout.device_type == "cuda"  # pinned memory only pays (and only works) beside a GPU
        slots = torch.empty((num_slots, layout.num_layers, layout.block_bytes), dtype=torch.uint8, pin_memory=pin)
        if not pin:  # fault every page in now, once: a first touch during a save costs more than the copy
            slots.zero_()
        self.pool = slots.permute(1, 0, 2)  # [layers, slots, block_bytes]; _slot_major gives the storage back
        self._tags = [None] * num_slots
        if pin:
            self._stream = torch.cuda.Stream(layout.device)
            self._save_stream = torch.cuda.Stream(layout.device)
        self._words, self._native = None, None
        if layout.device_type == "cpu":
            kv = [block_words(v, torch.int32) for v in layout.layers]
            if all(w is not None for w in kv):
                self._words = list(zip(kv, (block_words(self.pool[i], torch.int32) for i in range(layout.num_layers))))
            mod, _ = native.load_core()
            if mod is not None:
                self._native = (mod, layout.addressing(), _slot_addressing(self.pool, layout.addressing()))

    def _pool(self) -> torch.Tensor:
        if self.pool is None:
            raise KVBridgeError("cpu: the pool is allocated when the worker registers its KV cache")
        return self.pool

    def _valid(self, op: BlockLoad) -> tuple[list[int], int]:
        """The op's slots, and how many leading ones hold their key (a prefix: the rest are failed)."""
        slots = _slots(op.source, len(op.block_ids))
        if self._saving:  # a save of some of these slots may still be running: it counts once it is over
            wanted = set(slots)
            for save in [s for s in self._saving if wanted.intersection(s[1])]:
                with contextlib.suppress(OSError):  # a failed save leaves its slots untagged: failed blocks
                    self._complete(save)
        n = 0
        while n < len(slots) and slots[n] >= 0 and self._tags[slots[n]] == op.keys[n]:
            n += 1
        return slots, n

    def load_layers(self, op: BlockLoad, layout: KVLayout) -> tuple[int, Callable[[int], None]]:
        """A layerwise load: how many leading blocks are valid (checked now, before any byte moves: their
        slots are pinned until the load is released) and a copy of one layer of them."""
        pool = self._pool()
        slots, n = self._valid(op)
        ids, runs = layout.check_ids(op.block_ids[:n]), coalesce(op.block_ids[:n])
        slot_runs, at = coalesce(slots[:n]), torch.as_tensor(slots[:n])
        up: list[torch.Tensor] = []  # a KV on a GPU: every layer of the slots, on the device (layer 0 copies them)

        def copy(layer: int) -> None:
            if not n:
                return
            if _dma(pool, slot_runs):
                if not up:
                    up.append(_runs_up(_slot_major(pool), slot_runs, layout.device))
                layout.scatter_layer(layer, ids, up[0][:, layer].contiguous(), runs)
                _sync(layout)
                return
            if len(slot_runs) == 1:  # the layer's rows of a slot run lie a slot apart: made one stretch
                src = pool[layer, slot_runs[0][0] : slot_runs[0][0] + n].contiguous()
            else:
                src = pool[layer].index_select(0, at)
            if layout.device_type != "cpu":
                src = src.to(layout.device, non_blocking=pool.is_pinned())
            layout.scatter_layer(layer, ids, src, runs)
            _sync(layout)

        return n, copy

    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        pool = self._pool()
        slots, n = self._valid(op)
        if n and self._stream is not None:
            # a side stream lets the load overlap the forward pass; it first waits for work still
            # queued on these blocks (their previous owner's kernels)
            self._stream.wait_stream(torch.cuda.default_stream(layout.device))
            with torch.cuda.stream(self._stream):
                _copy_in(pool, slots[:n], op.block_ids[:n], layout)
        elif n and self._native is not None:  # one call, GIL released: every piece of every layer
            self._native_load(slots[:n], op.block_ids[:n], layout).result()
        elif n and self._words is not None:
            ids, slot_runs = layout.check_ids(op.block_ids[:n]), coalesce(slots[:n])
            at = torch.as_tensor(slots[:n])
            for layer, (kv, slab) in enumerate(self._words):
                if len(slot_runs) == 1:
                    src = _int32_rows(pool[layer, slot_runs[0][0] : slot_runs[0][0] + n])
                else:  # a select of int32 rows: torch's uint8 select over the pool's slot axis crawls
                    src = slab.index_select(0, at)
                kv.index_copy_(0, ids, src)
        elif n:
            _copy_in(pool, slots[:n], op.block_ids[:n], layout)
        return op.block_ids[n:]

    def start_load(self, op: BlockLoad, layout: KVLayout) -> tuple[Any, Callable[[], Sequence[int]]] | None:
        """With a CPU KV, the load runs on the native module's threads, checked now (the slots' tags: they
        are pinned until the load is released) and reported by the poll that sees it over."""
        if self._native is None or self._stream is not None:
            return None
        slots, n = self._valid(op)
        if not n:
            return None
        running = self._native_load(slots[:n], op.block_ids[:n], layout)

        def failed() -> Sequence[int]:
            running.result()  # raises if the copy failed: every block of the op is then failed
            return op.block_ids[n:]

        return running, failed

    def _native_load(self, slots: Sequence[int], block_ids: Sequence[int], layout: KVLayout) -> Any:
        """Slots into blocks, started on the native threads (``copy_start``: cut between them from 8 MiB;
        streaming stores from :data:`_STREAM_LOAD_BYTES`, where the KV cannot stay cached anyway)."""
        assert self._native is not None
        mod, kv, pool_at = self._native
        blocks = layout.check_range(block_ids)
        lengths = kv.lengths(len(blocks))
        streaming = len(blocks) * layout.num_layers * layout.block_bytes >= _STREAM_LOAD_BYTES
        return mod.copy_start(pool_at.addresses(np.asarray(slots)), kv.addresses(blocks), lengths, streaming=streaming)

    def start_save(self, op: BlockSave, layout: KVLayout) -> tuple[Any, Callable[[], None]] | None:
        """With a CPU KV, the save runs on the native module's threads; its slots are tagged once the
        poll sees it over (or a load of one of them waits for it)."""
        if self._native is None:
            return None
        slots = _slots(op.target, len(op.block_ids))
        if not slots:
            return None
        for slot in slots:  # invalid until the copy is complete
            self._tags[slot] = None
        save = (self._native_save(slots, op.block_ids, layout), slots, op.keys)
        with self._saving_lock:
            self._saving.append(save)
        return save[0], lambda: self._complete(save)

    def _complete(self, save: tuple[Any, list[int], Sequence[bytes]]) -> None:
        """Tag the slots of a native save once it is over (waits for it); raises if its copy failed."""
        running, slots, keys = save
        running.wait()
        with self._saving_lock:
            if not any(s is save for s in self._saving):
                return  # completed already: by the poll, or by a load that waited for it
            self._saving = [s for s in self._saving if s is not save]
        running.result()
        for slot, key in zip(slots, keys):
            self._tags[slot] = key

    def _save_args(self, slots: Sequence[int], block_ids: Sequence[int], layout: KVLayout) -> tuple[Any, tuple[Any, ...]]:
        """The native module, and its copy's arguments (sources, destinations, lengths): blocks into slots."""
        assert self._native is not None
        mod, kv, pool_at = self._native
        blocks = layout.check_range(block_ids)
        return mod, (kv.addresses(blocks), pool_at.addresses(np.asarray(slots)), kv.lengths(len(blocks)))

    def _native_save(self, slots: Sequence[int], block_ids: Sequence[int], layout: KVLayout) -> Any:
        """Blocks into slots, started on the native threads, with streaming stores: the pool is not read
        soon, so its lines need not be read into the cache first."""
        mod, args = self._save_args(slots, block_ids, layout)
        return mod.copy_start(*args, streaming=True)

    def save(self, op: BlockSave, layout: KVLayout) -> None:
        pool = self._pool()
        slots = _slots(op.target, len(op.block_ids))
        if not slots:
            return
        for slot in slots:  # invalid until the copy is complete
            self._tags[slot] = None
        if self._native is not None:
            # one call, GIL released, on this (the IO) thread: a save here is background work nobody waits
            # on (a chain's promotion, a save queued behind other work). Cut between the native threads it
            # took both cores of two, and the engine's thread, still handling the load it follows, learnt
            # of that load ~1.5 ms later at 32 MiB; the native threads stay free for loads the engine waits on.
            mod, args = self._save_args(slots, op.block_ids, layout)
            mod.copy(*args, streaming=True)
        elif _dma(pool, slot_runs := coalesce(slots)):
            self._dma_out(pool, slot_runs, op.block_ids, layout)
        else:
            self._copy_out(pool, slots, op.block_ids, layout)
        _sync(layout)
        for slot, key in zip(slots, op.keys):
            self._tags[slot] = key

    def _dma_out(
        self, pool: torch.Tensor, slot_runs: list[tuple[int, int]], block_ids: Sequence[int], layout: KVLayout
    ) -> None:
        """A KV on a GPU into slots: gathered on the device in the pool's order, then one DMA per run of slots."""
        stream = self._save_stream
        stream.wait_stream(torch.cuda.current_stream(layout.device))  # the forward pass that wrote the blocks
        with torch.cuda.stream(stream):
            rows = layout.gather(block_ids).transpose(0, 1).contiguous()  # [n, layers, block_bytes] on the device
            _runs_down(rows, _slot_major(pool), slot_runs)
            stream.synchronize()  # the pool holds the bytes before the slots are tagged

    def _copy_out(self, pool: torch.Tensor, slots: list[int], block_ids: Sequence[int], layout: KVLayout) -> None:
        """Blocks into slots with torch (a KV on a GPU, or no native module)."""
        slot_runs = coalesce(slots)
        if self._words is not None and len(slot_runs) > 1:
            staging, at = layout.gather(block_ids), torch.as_tensor(slots)
            for layer, (_, slab) in enumerate(self._words):
                slab.index_copy_(0, at, _int32_rows(staging[layer]))
        elif len(slot_runs) == 1:  # consecutive slots
            start, n = slot_runs[0]
            pool[:, start : start + n].copy_(layout.gather(block_ids))
        else:
            pool.index_copy_(1, torch.as_tensor(slots), layout.gather(block_ids).cpu())

    def close(self) -> None:
        self.pool = None


def _slot_major(pool: torch.Tensor) -> torch.Tensor:
    """The pool's storage, ``[slots, layers, block_bytes]`` (contiguous: a run of slots is one stretch)."""
    return pool.permute(1, 0, 2)


def _slot_addressing(pool: torch.Tensor, kv: BlockAddressing) -> BlockAddressing:
    """Where each slot of ``pool`` (``[layers, slots, block_bytes]``) keeps a block: per layer, the KV
    block's pieces one after another, in the order :meth:`KVLayout.gather` yields them."""
    lengths = [n for _, n in kv.pieces]
    offsets = np.cumsum([0, *lengths[:-1]]).tolist()
    return BlockAddressing(tuple(int(pool[i].data_ptr()) for i in range(pool.shape[0])), pool.stride(1),
                           tuple(zip(offsets, lengths)))


def _int32_rows(blocks: torch.Tensor) -> torch.Tensor:
    # a freshly selected or gathered (contiguous) [n, ...] stretch of blocks, as the int32 rows of _words
    rows = block_words(blocks, torch.int32)
    if rows is None:
        raise LayoutError(f"cpu: blocks {tuple(blocks.shape)} of {blocks.dtype} are not rows of int32 words")
    return rows


def _dma(pool: torch.Tensor, slot_runs: list[tuple[int, int]]) -> bool:
    """Whether slots move by a DMA per run: a pinned pool (the KV is on a GPU), not too fragmented."""
    return pool.is_pinned() and len(slot_runs) <= _MAX_RUNS


def _runs_down(rows: torch.Tensor, storage: torch.Tensor, slot_runs: list[tuple[int, int]]) -> None:
    """``rows`` (``[n, layers, block_bytes]`` on the device, in slot order) into the pinned storage's slot runs:
    a DMA per run, on the current stream (:func:`_runs_up`'s other way)."""
    at = 0
    for start, n in slot_runs:
        storage[start : start + n].copy_(rows[at : at + n], non_blocking=True)
        at += n


def _runs_up(storage: torch.Tensor, slot_runs: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Slots (runs of the pinned ``[slots, layers, block_bytes]`` storage) on the device, in slot order: a
    DMA per run, on the current stream."""
    out = torch.empty((sum(n for _, n in slot_runs), *storage.shape[1:]), dtype=torch.uint8, device=device)
    at = 0
    for start, n in slot_runs:
        out[at : at + n].copy_(storage[start : start + n], non_blocking=True)
        at += n
    return out


def _copy_in(pool: torch.Tensor, slots: list[int], block_ids: Sequence[int], layout: KVLayout) -> None:
    ids = layout.check_ids(block_ids)
    slot_runs = coalesce(slots)
    if _dma(pool, slot_runs):
        up = _runs_up(_slot_major(pool), slot_runs, layout.device)  # up run by run, then scattered on the device
        layout.scatter(block_ids, up.transpose(0, 1).contiguous())
        _sync(layout)
        return
    if len(slot_runs) == 1:  # consecutive slots: each layer's source is one contiguous slice
        src = pool[:, slot_runs[0][0] : slot_runs[0][0] + len(slots)]
    else:
        src = pool.index_select(1, torch.as_tensor(slots))
    if layout.device_type != "cpu":
        src = src.to(layout.device, non_blocking=pool.is_pinned())
    runs = coalesce(block_ids)
    for layer in range(layout.num_layers):  # (a slot run's rows of a layer lie a slot apart: made one stretch)
        layout.scatter_layer(layer, ids, src[layer].contiguous(), runs)
    _sync(layout)


# From here a load's copy into the KV uses streaming stores too: a copy this large cannot stay in the cache
# (32 MiB of L3 here), so skipping the read-for-ownership only gains (measured 10 -> 16 GB/s at 128 MiB).
_STREAM_LOAD_BYTES = 32 << 20

# A KV on a GPU: a request whose slots fall in more runs than this goes through the host (index_select or
# index_copy_, then one copy), not a DMA per run (each costs ~5-10 us to issue from Python; a request of
# 1024 tokens has 64 blocks, so it always takes the DMAs).
_MAX_RUNS = 64


def _sync(layout: KVLayout) -> None:
    # loads must be in the KV before they are reported, saves out of it before finish_step returns
    if layout.device_type == "cuda":
        torch.cuda.current_stream(layout.device).synchronize()  # inside a load: the load stream


class CpuBackend(StoreBackend):
    """The ``cpu`` backend: :class:`CpuIndex` on the scheduler side, :class:`CpuPool` on the worker side."""

    name = "cpu"
    options_type = CpuOptions

    def open_index(self, engine: EngineInfo) -> CpuIndex:
        return CpuIndex(engine, self.options)

    def open_io(self, engine: EngineInfo) -> CpuPool:
        return CpuPool(engine, self.options)


BACKEND = CpuBackend
