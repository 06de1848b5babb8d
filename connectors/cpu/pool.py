"""The cpu tier's worker side: the slot pool, the key each slot holds, and the moves in and out of it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from kvbridge.connectors.cpu import copies
from kvbridge.connectors.cpu.options import CpuOptions, CpuStats, declared_slot_bytes, slot_count, slots_of

from kvbridge import native
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import KVBridgeError, LayoutError
from kvbridge.layout import BlockAddressing, KVLayout, block_words, coalesce
from kvbridge.store import StoreIO
from kvbridge.transfer import Started, Transfer


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
        # index_copy_ into rows of int32 is faster than into a 4-d bf16 block view; index_select is the
        # other way round, so gathers keep the layout's typed views)
        self._words: list[tuple[Any, Any]] | None = None
        # a CPU KV: (native module, the KV's addressing, the pool's) for one memcpy call per load or save
        self._native: tuple[Any, BlockAddressing, BlockAddressing] | None = None
        # saves running on the native threads whose slots are not tagged yet (the poll completes them;
        # a load of one of their slots waits for it first): the running copy, its slots and keys
        self._saving: list[tuple[Any, list[int], Sequence[bytes]]] = []
        self._saving_lock = threading.Lock()  # the polling thread, the IO thread

    def attach(self, layout: KVLayout) -> None:
        slot_bytes = layout.num_layers * layout.block_bytes
        declared = declared_slot_bytes(self.engine, self.options)
        if declared and declared != slot_bytes:  # the scheduler would count a different number of slots
            raise LayoutError(f"cpu: KV blocks are {slot_bytes} bytes over all layers, the engine declared {declared}")
        num_slots = slot_count(self.options.capacity_bytes, slot_bytes)
        pin = layout.device_type == "cuda"  # pinned memory only pays (and only works) beside a GPU
        slots = torch.empty((num_slots, layout.num_layers, layout.block_bytes), dtype=torch.uint8, pin_memory=pin)
        if not pin:  # fault every page in now, once: a first touch during a save costs more than the copy
            slots.zero_()
        self.pool = slots.permute(1, 0, 2)  # [layers, slots, block_bytes]; copies.slot_major gives the storage back
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
                self._native = (mod, layout.addressing(), copies.slot_addressing(self.pool, layout.addressing()))

    def _pool(self) -> torch.Tensor:
        if self.pool is None:
            raise KVBridgeError("cpu: the pool is allocated when the worker registers its KV cache")
        return self.pool

    def _valid(self, op: BlockLoad) -> tuple[list[int], int]:
        """The op's slots, and how many leading ones hold their key (a prefix: the rest are failed)."""
        slots = slots_of(op.source, len(op.block_ids))
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
            if copies.dma(pool, slot_runs):
                if not up:
                    up.append(copies.runs_up(copies.slot_major(pool), slot_runs, layout.device))
                layout.scatter_layer(layer, ids, up[0][:, layer].contiguous(), runs)
                copies.sync(layout)
                return
            if len(slot_runs) == 1:  # the layer's rows of a slot run lie a slot apart: made one stretch
                src = pool[layer, slot_runs[0][0] : slot_runs[0][0] + n].contiguous()
            else:
                src = pool[layer].index_select(0, at)
            if layout.device_type != "cpu":
                src = src.to(layout.device, non_blocking=pool.is_pinned())
            layout.scatter_layer(layer, ids, src, runs)
            copies.sync(layout)

        return n, copy

    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        pool = self._pool()
        slots, n = self._valid(op)
        if n and self._stream is not None:
            # a side stream lets the load overlap the forward pass; it first waits for work still
            # queued on these blocks (their previous owner's kernels)
            self._stream.wait_stream(torch.cuda.default_stream(layout.device))
            with torch.cuda.stream(self._stream):
                copies.copy_in(pool, slots[:n], op.block_ids[:n], layout)
        elif n and self._native is not None:  # one call, GIL released: every piece of every layer
            self._native_load(slots[:n], op.block_ids[:n], layout).result()
        elif n and self._words is not None:
            ids, slot_runs = layout.check_ids(op.block_ids[:n]), coalesce(slots[:n])
            at = torch.as_tensor(slots[:n])
            for layer, (kv, slab) in enumerate(self._words):
                if len(slot_runs) == 1:
                    src = copies.int32_rows(pool[layer, slot_runs[0][0] : slot_runs[0][0] + n])
                else:  # a select of int32 rows: torch's uint8 select over the pool's slot axis crawls
                    src = slab.index_select(0, at)
                kv.index_copy_(0, ids, src)
        elif n:
            copies.copy_in(pool, slots[:n], op.block_ids[:n], layout)
        return op.block_ids[n:]

    def start_load(self, op: BlockLoad, layout: KVLayout) -> Transfer | None:
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

        return Started(op, running, failed)

    def _native_load(self, slots: Sequence[int], block_ids: Sequence[int], layout: KVLayout) -> Any:
        """Slots into blocks, started on the native threads (``copy_start``: cut between them from 8 MiB;
        streaming stores from :data:`~.copies.STREAM_LOAD_BYTES`, where the KV cannot stay cached anyway)."""
        assert self._native is not None
        mod, kv, pool_at = self._native
        blocks = layout.check_range(block_ids)
        lengths = kv.lengths(len(blocks))
        streaming = len(blocks) * layout.num_layers * layout.block_bytes >= copies.STREAM_LOAD_BYTES
        return mod.copy_start(pool_at.addresses(np.asarray(slots)), kv.addresses(blocks), lengths, streaming=streaming)

    def start_save(self, op: BlockSave, layout: KVLayout) -> Transfer | None:
        """With a CPU KV, the save runs on the native module's threads; its slots are tagged once the
        poll sees it over (or a load of one of them waits for it)."""
        if self._native is None:
            return None
        slots = slots_of(op.target, len(op.block_ids))
        if not slots:
            return None
        for slot in slots:  # invalid until the copy is complete
            self._tags[slot] = None
        save = (self._native_save(slots, op.block_ids, layout), slots, op.keys)
        with self._saving_lock:
            self._saving.append(save)
        return Started(op, save[0], lambda: self._complete(save))

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
        slots = slots_of(op.target, len(op.block_ids))
        if not slots:
            return
        for slot in slots:  # invalid until the copy is complete
            self._tags[slot] = None
        if self._native is not None:
            # one call, GIL released, on this (the IO) thread: a save here is background work nobody waits
            # on (a chain's promotion, a save queued behind other work). Cut between the native threads it
            # would take every core from the engine's thread, still handling the load it follows, which then
            # learns of that load later (``kvbridge bench --backends chain --ops load``); the native threads
            # stay free for loads the engine waits on.
            mod, args = self._save_args(slots, op.block_ids, layout)
            mod.copy(*args, streaming=True)
        elif copies.dma(pool, slot_runs := coalesce(slots)):
            self._dma_out(pool, slot_runs, op.block_ids, layout)
        else:
            self._copy_out(pool, slots, op.block_ids, layout)
        copies.sync(layout)
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
            copies.runs_down(rows, copies.slot_major(pool), slot_runs)
            stream.synchronize()  # the pool holds the bytes before the slots are tagged

    def _copy_out(self, pool: torch.Tensor, slots: list[int], block_ids: Sequence[int], layout: KVLayout) -> None:
        """Blocks into slots with torch (a KV on a GPU, or no native module)."""
        slot_runs = coalesce(slots)
        if self._words is not None and len(slot_runs) > 1:
            staging, at = layout.gather(block_ids), torch.as_tensor(slots)
            for layer, (_, slab) in enumerate(self._words):
                slab.index_copy_(0, at, copies.int32_rows(staging[layer]))
        elif len(slot_runs) == 1:  # consecutive slots
            start, n = slot_runs[0]
            pool[:, start : start + n].copy_(layout.gather(block_ids))
        else:
            pool.index_copy_(1, torch.as_tensor(slots), layout.gather(block_ids).cpu())

    def close(self) -> None:
        self.pool = None

