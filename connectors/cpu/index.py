"""The cpu tier's scheduler side: which key sits in which slot, recency, pins (see the package docstring)."""

from __future__ import annotations

import collections
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvbridge.connectors.cpu.options import CpuOptions, CpuSlots, CpuStats, declared_slot_bytes, slot_count

from kvbridge.contract import EngineInfo
from kvbridge.errors import ConfigError
from kvbridge.store import StoreIndex


class CpuIndex(StoreIndex):
    """Scheduler side: which key sits in which slot, in recency order, and which slots are pinned."""

    def __init__(self, engine: EngineInfo, options: CpuOptions):
        super().__init__(engine)
        self.stats: CpuStats = CpuStats()
        self.layerwise = options.layerwise
        slot_bytes = declared_slot_bytes(engine, options)
        if not slot_bytes:
            raise ConfigError(
                "cpu: the scheduler side cannot size the pool: the engine reports no block_bytes "
                "(bytes of one block across all layers); set the cpu option 'block_bytes'"
            )
        self.num_slots = slot_count(options.capacity_bytes, slot_bytes)
        self._touch = options.eviction == "lru"
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...: runs
        self._pins = [0] * self.num_slots  # loads and saves reading or writing each slot (_count)
        self._held: dict[str, list[int]] = {}  # request -> slots it pinned
        self._orphans: set[int] = set()  # forgotten slots still pinned by someone
        self._lock = threading.Lock()

    # The scheduler's calls go through C (map, set and numpy operations), not a Python loop per block:
    # every request pays them in the scheduler's step (``kvbridge bench --backends cpu --ops sched_step``).
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
    pulls one slot through the get, the add and the set before the next). ``np.add.at`` costs more on a cold
    call, and a release runs after each load on the scheduler's step (``kvbridge bench --backends chain --ops
    sched_step``)."""
    collections.deque(map(pins.__setitem__, slots, map(delta.__add__, map(pins.__getitem__, slots))), maxlen=0)

