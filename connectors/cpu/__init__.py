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
  (``start_load`` / ``start_save``: a :class:`~kvbridge.transfer.Started` handle): no hand-off to the IO thread and back, a cost each way that is a
  large share of a small move (``kvbridge bench --backends cpu --ops load``, its 8 MiB rows). A poll that sees it over reports it (a save's slots get their tags
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
  a pool so fragmented that a request spans more than :data:`~.copies.MAX_RUNS` runs goes through one
  ``index_select``/``index_copy_`` on the host instead. A layerwise load on a GPU copies every layer
  up at its first layer (a layer of a slot run is not one stretch), then scatters layer by layer.
"""

from __future__ import annotations

from kvbridge.connectors.cpu.index import CpuIndex, _count
from kvbridge.connectors.cpu.options import CpuOptions, CpuSlots, CpuStats
from kvbridge.connectors.cpu.pool import CpuPool

from kvbridge.contract import EngineInfo
from kvbridge.store import StoreBackend


class CpuBackend(StoreBackend):
    """The ``cpu`` backend: :class:`CpuIndex` on the scheduler side, :class:`CpuPool` on the worker side."""

    name = "cpu"
    options_type = CpuOptions

    def open_index(self, engine: EngineInfo) -> CpuIndex:
        return CpuIndex(engine, self.options)

    def open_io(self, engine: EngineInfo) -> CpuPool:
        return CpuPool(engine, self.options)


BACKEND = CpuBackend

__all__ = ["BACKEND", "CpuBackend", "CpuIndex", "CpuOptions", "CpuPool", "CpuSlots", "CpuStats", "_count"]
