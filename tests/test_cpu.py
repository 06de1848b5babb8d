"""The ``cpu`` tier: capacity, LRU eviction, pins under pending loads, counters, bit-exact scattered moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvbridge.connectors.cpu import CpuBackend, CpuIndex, CpuOptions, CpuPool, CpuSlots

from kvbridge import native, registry
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import ConfigError, LayoutError
from kvbridge.layout import BLOCKS_FIRST, KV_FIRST, KVLayout
from kvbridge.testing import MiniEngine

# MiniEngine's default geometry: 4 layers x 2 heads x 16 tokens x 2*16 values x bf16
SLOT = 4 * 2 * 16 * 32 * 2


def tokens(n_blocks: int, seed: int, extra: int = 5) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n_blocks * 16 + extra).tolist()


def engine(slots: int, **kw) -> MiniEngine:
    return MiniEngine(CpuBackend(CpuOptions(capacity_bytes=slots * SLOT + SLOT // 2)), **kw)


def index(slots: int, eviction: str = "lru") -> CpuIndex:
    opts = registry.create("cpu", {"capacity_bytes": slots * 100, "block_bytes": 100, "eviction": eviction}).options
    return CpuIndex(EngineInfo("e", 16), opts)


def parts(e: MiniEngine) -> tuple[CpuIndex, CpuPool]:
    return e.scheduler.index, e.worker.io  # type: ignore[attr-defined,return-value]


KEYS = [bytes([i]) * 16 for i in range(10)]


# ---- options ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options,match",
    [
        ({}, "capacity_bytes"),
        ({"capacity_bytes": 0}, "positive"),
        ({"capacity_bytes": -5}, "positive"),
        ({"capacity_bytes": "lots"}, "integer"),
        ({"capacity_bytes": 1 << 20, "block_bytes": -1}, "block_bytes"),
        ({"capacity_bytes": 1 << 20, "eviction": "random"}, "eviction"),
        ({"capacity_bytes": 1 << 20, "capcity": 1}, "capcity"),
    ],
)
def test_bad_options_fail_at_construction(options, match):
    with pytest.raises(ConfigError, match=match):
        registry.create("cpu", options)


def test_capacity_below_one_block_is_refused():
    with pytest.raises(ConfigError, match="holds no block"):
        MiniEngine(CpuBackend(CpuOptions(capacity_bytes=SLOT - 1)))


def test_scheduler_needs_the_block_size_from_engine_or_option():
    backend = CpuBackend(CpuOptions(capacity_bytes=1 << 20))
    with pytest.raises(ConfigError, match="block_bytes"):
        backend.scheduler(EngineInfo("e", 16))  # the engine does not say, nor does the option
    sized = CpuBackend(CpuOptions(capacity_bytes=1000, block_bytes=100)).open_index(EngineInfo("e", 16))
    assert isinstance(sized, CpuIndex) and sized.num_slots == 10  # the option stands in for the engine


def test_worker_refuses_a_layout_other_than_the_declared_one():
    layout = KVLayout.from_tensors([torch.zeros(8, 2, 16, 32, dtype=torch.bfloat16) for _ in range(4)])
    pool = CpuPool(EngineInfo("e", 16), CpuOptions(capacity_bytes=1 << 20, block_bytes=SLOT * 2))
    with pytest.raises(LayoutError, match="declared"):
        pool.attach(layout)  # its blocks are SLOT bytes, the option says twice that: slot counts would differ
    with pytest.raises(ConfigError, match="engine reports"):  # and the scheduler refuses the contradiction
        CpuBackend(CpuOptions(capacity_bytes=1 << 20, block_bytes=SLOT * 2)).scheduler(
            EngineInfo("e", 16, block_bytes=SLOT)
        )


def test_pool_is_allocated_once_at_register_and_never_grows():
    e = engine(6)
    try:
        _, pool = parts(e)
        assert pool.pool is not None
        assert tuple(pool.pool.shape) == (4, 6, SLOT // 4)
        assert not pool.pool.is_pinned()  # the KV is on the CPU: plain memory
        ptr = pool.pool.data_ptr()
        for i in range(5):
            e.prefill(f"r{i}", tokens(4, seed=i))
        assert pool.pool.data_ptr() == ptr and tuple(pool.pool.shape) == (4, 6, SLOT // 4)
    finally:
        e.close()


# ---- the index: LRU order, pins, skipped saves --------------------------------------------------
def save(idx: CpuIndex, rid: str, keys: list[bytes]) -> tuple[list[int], tuple[int, ...]]:
    positions, target = idx.reserve_save(rid, keys)
    idx.release(rid)  # the saves are done: unpinned
    assert target is not None
    return list(positions), target.slots


def test_lru_evicts_least_recently_used_first():
    idx = index(4)
    save(idx, "w", KEYS[:4])
    idx.reserve_load("r", [KEYS[0]])  # a hit refreshes key 0
    idx.release("r")
    _, slots = save(idx, "w2", [KEYS[4]])
    assert idx.contains_prefix([KEYS[1]]) == 0  # key 1 was the least recently used
    assert slots == (1,)  # ... and its slot was reused
    assert all(idx.contains_prefix([k]) for k in (KEYS[0], KEYS[2], KEYS[3], KEYS[4]))
    save(idx, "w3", [KEYS[5], KEYS[6]])
    assert [idx.contains_prefix([k]) for k in KEYS[:7]] == [1, 0, 0, 0, 1, 1, 1]
    assert idx.stats.evictions == 3


def test_members_are_every_held_position_as_the_prefix_walk_finds_them():
    """``members`` (one set operation) names the held positions the generic walk over ``contains_prefix``
    finds, holes included: a chain asks it of each tier."""
    from kvbridge.store import StoreIndex

    idx = index(8)
    keys = [bytes([i]) * 4 for i in range(12)]
    save(idx, "r", [keys[i] for i in (1, 2, 5, 9, 10, 11)])
    for probe in (keys, keys[5:], keys[3:5], list(reversed(keys)), []):
        assert idx.members(probe) == StoreIndex.members(idx, probe)
    assert idx.members(keys) == [1, 2, 5, 9, 10, 11]


def test_a_save_of_new_keys_into_free_slots_takes_them_as_key_by_key_would():
    """``reserve_save``'s bulk path (every key new, a free slot for each) leaves the index exactly as the
    key-by-key path does: the same slots in the same order, pins, free list and recency."""
    fast, slow = index(16), index(16)
    slow._reserve_free = slow._reserve_each  # type: ignore[method-assign]
    keys = [bytes([i]) * 16 for i in range(20)]
    batches = [keys[:5], keys[5:9], keys[3:12], keys[12:16], keys[16:18]]  # new, new, mixed, new, evicting
    for n, batch in enumerate(batches):
        got = [idx.reserve_save(f"r{n}", batch) for idx in (fast, slow)]
        assert list(got[0][0]) == list(got[1][0]) and got[0][1] == got[1][1], n
        assert list(fast._slots.items()) == list(slow._slots.items()) and np.array_equal(fast._pins, slow._pins), n
        assert fast._free == slow._free and fast._held == slow._held, n
        if n % 2:
            for idx in (fast, slow):
                idx.release(f"r{n}")


def test_fifo_ignores_hits():
    idx = index(4, eviction="fifo")
    save(idx, "w", KEYS[:4])
    idx.reserve_load("r", [KEYS[0]])
    idx.release("r")
    save(idx, "w2", [KEYS[4]])
    assert idx.contains_prefix([KEYS[0]]) == 0


def test_pinned_slots_are_never_evicted_and_unsaveable_blocks_are_skipped():
    idx = index(4)
    save(idx, "w", KEYS[:4])
    idx.reserve_load("r", KEYS[:3])  # three slots pinned by a pending load
    positions, slots = save(idx, "w2", KEYS[4:7])
    assert positions == [0] and slots == (3,)  # only the unpinned slot could be reused
    assert idx.contains_prefix(KEYS[:3]) == 3
    assert idx.stats.skipped_saves == 2 and idx.stats.evictions == 1
    idx.release("r")
    positions, _ = save(idx, "w3", KEYS[5:7])
    assert positions == [0, 1]  # unpinned now: evictable again


def test_already_present_blocks_are_not_written_again():
    idx = index(4)
    save(idx, "w", KEYS[:2])
    positions, slots = save(idx, "w2", KEYS[:3])
    assert positions == [2] and slots == (2,)


def test_a_key_evicted_since_lookup_is_a_failed_block():
    idx = index(2)
    save(idx, "w", KEYS[:2])
    assert idx.contains_prefix(KEYS[:2]) == 2
    save(idx, "w2", [KEYS[5]])  # evicts key 0
    assert idx.reserve_load("r", KEYS[:2]) == CpuSlots((-1, 1))


# ---- end to end through the engine ----------------------------------------------------------------
def test_capacity_reached_while_a_load_is_pending():
    """A load pins its slots: saves that need room while it runs evict nothing it reads."""
    e = engine(6)
    try:
        idx, pool = parts(e)
        prompt = tokens(4, seed=1)
        e.prefill("a", prompt)  # 4 of the 6 slots
        req = e.request("b", prompt)
        n = e.scheduler.lookup(req, 0).num_tokens
        assert n == 4 * 16
        ids = e.allocate(5)
        e.scheduler.on_allocated(req, ids, n)
        e.worker.start_step(e.scheduler.plan_step([]))  # the load starts; nobody has polled it yet
        other = e.prefill("c", tokens(5, seed=2))  # needs 5 slots: 2 free, 4 pinned by the load
        assert idx.stats.skipped_saves == 3 and idx.stats.evictions == 0
        assert idx.contains_prefix(req.block_keys) == 4  # the loaded blocks survived
        assert idx.contains_prefix(other.keys) == 2
        assert e.worker.wait_idle(10)  # type: ignore[attr-defined]
        e.pump()  # the load's report reaches the scheduler: its pins are released
        assert torch.equal(e.read(ids[:4]), e.expected(req.block_keys[:4]))
        assert not e.scheduler.on_finished(req, ids).delay_free
        e.free(ids)
        e.prefill("d", tokens(3, seed=3))  # unpinned now: evictable, least recently used first
        assert idx.stats.evictions == 3
        assert [idx.contains_prefix([k]) for k in req.block_keys] == [0, 0, 0, 1]
        assert idx.contains_prefix(other.keys) == 2  # "c" saved after "b"'s load refreshed "a"'s blocks
        assert pool.stats.load_blocks == 4
    finally:
        e.close()


def test_counters():
    e = engine(16)
    try:
        idx, pool = parts(e)
        prompt = tokens(3, seed=4)
        e.prefill("a", prompt)
        got = e.prefill("b", prompt)
        assert got.loaded_tokens == 3 * 16
        assert (idx.stats.hits, idx.stats.misses) == (3, 3)
        assert (pool.stats.save_blocks, pool.stats.save_bytes) == (3, 3 * SLOT)
        assert (pool.stats.load_blocks, pool.stats.load_bytes) == (3, 3 * SLOT)
        assert idx.stats.evictions == 0 and idx.stats.skipped_saves == 0
        assert "skipped_saves" in idx.stats.as_dict()
    finally:
        e.close()


@pytest.mark.parametrize("copies", ["native", "torch"])
@pytest.mark.parametrize("kv_format,dtype", [(BLOCKS_FIRST, torch.bfloat16), (KV_FIRST, torch.float16)])
def test_scattered_blocks_and_scattered_slots_round_trip_bit_exact(kv_format, dtype, copies, monkeypatch):
    """Both ways a CPU KV moves: one native descriptor copy (kvbridge._core), or torch's per-layer ops
    where the native module is missing (forced here)."""
    if copies == "torch":
        monkeypatch.setattr(native, "load_core", lambda: (None, "forced off by the test"))
    elif native.load_core()[0] is None:
        pytest.skip(f"kvbridge._core: {native.load_core()[1]}")
    e = engine(8, kv_format=kv_format, dtype=dtype, num_blocks=128)
    try:
        idx, pool = parts(e)
        assert (pool._native is not None) == (copies == "native")
        first = tokens(8, seed=5, extra=0)
        e.prefill("a", first + [1])  # slots 0..7
        keys = e.request("x", first).block_keys
        idx.reserve_load("touch", keys[0::2])  # refresh every other slot: LRU order 1,3,5,7,0,2,4,6
        idx.release("touch")
        prompt = tokens(3, seed=6)
        sent = e.prefill("b", prompt)
        assert {idx._slots[k] for k in sent.keys} == {1, 3, 5}  # scattered slots (white-box check)
        got = e.prefill("c", prompt)
        assert got.loaded_blocks == got.block_ids[:3] and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :3], sent.snapshot[:, :3])
        assert torch.equal(got.snapshot[:, :3], e.expected(got.keys[:3]))
        assert pool.stats.load_blocks == 3
    finally:
        e.close()


def test_a_slot_without_the_expected_key_is_never_loaded():
    """The worker's tags catch a plan that disagrees with the pool (e.g. a save that failed)."""
    e = engine(4)
    try:
        _, pool = parts(e)
        sent = e.prefill("a", tokens(2, seed=7))
        before = e.read([10, 11])
        failed = pool.load(BlockLoad("x", (10, 11), (sent.keys[1], sent.keys[0]), CpuSlots((0, 1))), e.layout)
        assert list(failed) == [10, 11]
        assert torch.equal(e.read([10, 11]), before)
    finally:
        e.close()


def test_a_load_waits_for_a_native_save_of_its_slots_that_no_poll_saw_over():
    """A save on the native threads tags its slots when a poll sees it over; a load of those slots
    started before that (the next step's hit) waits for the save, then loads its bytes, bit-exact."""
    e = engine(8, num_blocks=64)
    try:
        idx, pool = parts(e)
        if pool._native is None:
            pytest.skip(f"kvbridge._core: {native.load_core()[1]}")
        keys = e.request("x", tokens(3, seed=8)).block_keys[:3]
        e.compute([5, 9, 2], keys)
        _, target = idx.reserve_save("s", keys)
        started = pool.start_save(BlockSave("s", (5, 9, 2), tuple(keys), target), e.layout)
        assert started is not None and pool._saving  # not tagged yet: nothing polled it
        source = idx.reserve_load("l", keys)
        load = pool.start_load(BlockLoad("l", (40, 41, 42), tuple(keys), source), e.layout)
        assert load is not None and not pool._saving  # the load completed the save first
        assert load.wait(30) and load.failed() == frozenset() and load.error is None
        assert torch.equal(e.read([40, 41, 42]), e.expected(keys))
        assert started.wait(30) and started.failed() == frozenset()  # the poll's completion, after the load did it
    finally:
        e.close()


def test_blocks_recomputed_after_a_failed_load_are_saved_again(tmp_path):
    """An engine playing both roles whose load failed from block 1 recomputes blocks 1.. and stores them
    again, so the next request with the prompt loads all of it (not one more recompute)."""
    from kvbridge.testing.targets import target_for

    target = target_for("cpu", tmp_path)
    assert target.corrupt is not None
    e = MiniEngine(target.producer, role="both")
    try:
        tokens = list(range(4 * 16 + 5))
        sent = e.prefill("a", tokens)
        assert target.corrupt(e, e, sent.keys[1:2]) > 0
        got = e.prefill("b", tokens)
        assert got.loaded_blocks == got.block_ids[:1] and got.block_ids[1] in got.failed_blocks
        again = e.prefill("c", tokens)
        assert len(again.loaded_blocks) == 4 and not again.failed_blocks
        assert torch.equal(again.snapshot[:, :4], sent.snapshot[:, :4])
    finally:
        e.close()


# ---- layerwise (synchronous) loads ------------------------------------------------------------------

def _layerwise_engine(num_layers: int = 6) -> MiniEngine:
    return MiniEngine(CpuBackend(CpuOptions(capacity_bytes=16 << 20, layerwise=True)), num_layers=num_layers)


def test_layerwise_round_trip_is_bit_exact_and_synchronous():
    e = _layerwise_engine()
    try:
        tokens = list(range(5 * 16 + 3))
        sent = e.prefill("a", tokens)
        req = e.request("probe", tokens)
        assert e.scheduler.lookup(req, 0).is_async is False, "a layerwise tier loads inside the step"
        got = e.prefill("b", tokens)
        assert got.loaded_tokens == 5 * 16 and not got.failed_blocks
        assert torch.equal(got.snapshot[:, :5], sent.snapshot[:, :5])
    finally:
        e.close()


def test_layerwise_wait_layer_returns_once_that_layer_is_in_place():
    """The forward pass of the loading step: layer i is read right after wait_layer(i), never before."""
    e = _layerwise_engine()
    try:
        tokens = list(range(4 * 16 + 1))
        sent = e.prefill("a", tokens)
        req, ids, n_ext = e.admit("b", tokens)
        assert n_ext == 64
        plan = e.scheduler.plan_step([])
        (op,) = plan.loads
        assert op.layerwise and op.block_ids == tuple(ids[:4])
        e.worker.start_step(plan)
        for layer in range(e.layout.num_layers):
            e.worker.wait_layer(layer)
            got = e.read(ids[:4])[layer]  # what this layer's attention would read now
            assert torch.equal(got, sent.snapshot[layer, :4]), f"layer {layer} not in place after wait_layer"
        e.worker.finish_step()
        assert e.worker.wait_idle(10)
        report = e.worker.poll()
        assert report.finished_loading == {"b"} and not report.failed_blocks
        e.scheduler.on_report(report)
        e.finish(req, ids)
    finally:
        e.close()


def test_a_layerwise_load_of_a_slot_that_lost_its_key_fails_from_there():
    e = _layerwise_engine()
    try:
        tokens = list(range(4 * 16 + 1))
        sent = e.prefill("a", tokens)
        pool = e.worker.io  # type: ignore[attr-defined]
        slot = pool._tags.index(sent.keys[2])
        pool._tags[slot] = None  # as an interrupted write leaves it (a fault that cannot be made real here)
        got = e.prefill("b", tokens)
        assert got.loaded_blocks == got.block_ids[:2] and got.block_ids[2] in got.failed_blocks
        assert torch.equal(got.snapshot[:, :4], e.expected(got.keys[:4]))
        assert got.reoffered == 0
    finally:
        e.close()


def test_pin_counts_count_a_slot_named_twice_twice() -> None:
    """The cpu index's pin counts move by one per slot named, repeats included (a request whose holds name a
    slot twice unpins it twice), and only the slots named move."""
    from kvbridge.connectors.cpu import _count

    pins = [0] * 6
    _count(pins, [1, 4, 1], 1)
    assert pins == [0, 2, 0, 0, 1, 0]
    _count(pins, (1, 4), -1)
    assert pins == [0, 1, 0, 0, 0, 0]
    _count(pins, [], 1)
    assert pins == [0, 1, 0, 0, 0, 0]
