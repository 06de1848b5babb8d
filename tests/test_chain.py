"""The ``chain`` backend: tiers built from the registry, longest prefix across tiers, fastest-tier loads,
promotion, write-through, and degradation when a tier fails."""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from kvbridge.connectors import memory
from kvbridge.connectors.chain import ChainBackend, ChainIndex, ChainIO, ChainOptions
from kvbridge.connectors.memory import MemoryBackend, MemoryOptions

from kvbridge import native, registry
from kvbridge.contract import Backend, BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import ConfigError, UnknownBackend
from kvbridge.layout import KVLayout
from kvbridge.store import StoreBackend, StoreIndex, StoreIO
from kvbridge.testing import MiniEngine
from kvbridge.transfer import Started

CPU = {"backend": "cpu", "capacity_bytes": 4 << 20}
_names = itertools.count()


@pytest.fixture
def mem() -> Iterator[str]:
    """A fresh shared ``memory`` store name, forgotten afterwards."""
    name = f"chain-test-{next(_names)}"
    yield name
    memory.clear(name)


def tokens(n_blocks: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n_blocks * 16 + 5).tolist()


def chain(*tiers: dict[str, Any], **options: Any) -> ChainBackend:
    backend = registry.create("chain", {"tiers": list(tiers), **options})
    assert isinstance(backend, ChainBackend)
    return backend


def stores(e: MiniEngine) -> tuple[ChainIndex, ChainIO]:
    return e.scheduler.index, e.worker.io  # type: ignore[attr-defined,return-value]


def fill(name: str, prompt: list[int]) -> list[bytes]:
    """Save ``prompt``'s blocks into memory store ``name`` from a separate engine (same geometry)."""
    e = MiniEngine(MemoryBackend(MemoryOptions(name)), engine_id="filler")
    try:
        return e.prefill("fill", prompt).keys
    finally:
        e.close()


def forget(name: str, keys: Sequence[bytes]) -> None:
    for key in keys:
        memory._SHARED[name].pop(("mini", 0, key))


# ---- construction -------------------------------------------------------------------------------
def test_unknown_tier_fails_at_construction():
    with pytest.raises(UnknownBackend, match="nosuch"):
        chain(CPU, {"backend": "nosuch"})


@pytest.mark.parametrize(
    "options,match",
    [
        ({"tiers": []}, "at least one"),
        ({"tiers": [{"capacity_bytes": 1}]}, "'backend'"),
        ({"tiers": [{"backend": "cpu"}]}, "tier 0.*capacity_bytes"),
        ({"tiers": [CPU], "write_back": True}, "not implemented"),
        ({"tiers": [CPU], "promot": False}, "promot"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ConfigError, match=match):
        registry.create("chain", options)


def test_a_peer_tier_is_refused(monkeypatch):
    class Peer(Backend):
        name, kind, options_type = "peerish", "peer", dict

        def scheduler(self, engine):  # pragma: no cover - never reached
            raise AssertionError

        worker = scheduler

    real = registry.create
    monkeypatch.setattr(registry, "create", lambda n, o=None: Peer(o) if n == "peerish" else real(n, o))
    with pytest.raises(ConfigError, match="must be a store"):
        ChainBackend(ChainOptions(({"backend": "peerish"},)))


# ---- lookup and loads ----------------------------------------------------------------------------
def test_longest_prefix_across_tiers(mem):
    """Blocks 0-3 only in the first tier, 4-7 only in the second: a prefix of 8."""
    first, second = mem + "-a", mem + "-b"
    prompt = tokens(8, seed=1)
    keys = fill(first, prompt)
    forget(first, keys[4:])
    fill(second, prompt)
    forget(second, keys[:4])
    e = MiniEngine(chain({"backend": "memory", "name": first}, {"backend": "memory", "name": second}))
    try:
        got = e.prefill("r", prompt)
        assert got.loaded_tokens == 8 * 16 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :8], e.expected(keys))
        _, worker = stores(e)
        assert [t.stats.load_blocks for t in worker.tiers] == [4, 4]
    finally:
        e.close()
        memory.clear(first)
        memory.clear(second)


def test_write_through_then_loads_from_the_fastest_tier(mem):
    e = MiniEngine(chain(CPU, {"backend": "memory", "name": mem}))
    try:
        prompt = tokens(4, seed=2)
        sent = e.prefill("a", prompt)
        sched, worker = stores(e)
        assert [t.contains_prefix(sent.keys) for t in sched.tiers] == [4, 4]  # both tiers got every block
        assert [t.stats.save_blocks for t in worker.tiers] == [4, 4]
        got = e.prefill("b", prompt)
        assert got.loaded_tokens == 4 * 16
        assert torch.equal(got.snapshot[:, :4], sent.snapshot[:, :4])
        assert [t.stats.load_blocks for t in worker.tiers] == [4, 0]  # all from cpu, none from memory
    finally:
        e.close()


def test_a_tier_that_starts_its_save_natively_copies_while_the_next_one_saves(mem, monkeypatch):
    """Write-through does not add the tiers' times: the cpu tier's save is started on the native threads, the
    slower tier saves meanwhile (its save sees the cpu one started and not yet completed), and the chain's save
    returns only once both are over: each tier then serves the prompt bit-exact."""
    e = MiniEngine(chain(CPU, {"backend": "memory", "name": mem}))
    try:
        sched, worker = stores(e)
        if worker.tiers[0]._native is None:  # type: ignore[attr-defined]
            pytest.skip(f"kvbridge._core: {native.load_core()[1]}")
        seen: list[int] = []
        real_save = worker.tiers[1].save

        def save_beside(*args: Any) -> None:
            seen.append(len(worker.tiers[0]._saving))  # type: ignore[attr-defined]
            real_save(*args)

        monkeypatch.setattr(worker.tiers[1], "save", save_beside)
        prompt = tokens(4, seed=2)
        sent = e.prefill("a", prompt)
        assert seen == [1] and not worker.tiers[0]._saving  # type: ignore[attr-defined]
        assert [t.contains_prefix(sent.keys) for t in sched.tiers] == [4, 4]
        assert [t.stats.save_blocks for t in worker.tiers] == [4, 4]
        got = e.prefill("b", prompt)  # from the cpu tier
        assert torch.equal(got.snapshot[:, :4], sent.snapshot[:, :4])
        assert [t.stats.load_blocks for t in worker.tiers] == [4, 0]
        other = MiniEngine(chain(CPU, {"backend": "memory", "name": mem}))
        try:  # another engine's chain: its own empty cpu tier, the shared memory tier
            again = other.prefill("c", prompt)
            assert again.loaded_tokens == 4 * 16 and torch.equal(again.snapshot[:, :4], sent.snapshot[:, :4])
            assert [t.stats.load_blocks for t in stores(other)[1].tiers] == [0, 4]
        finally:
            other.close()
    finally:
        e.close()


@pytest.mark.parametrize("promote", [True, False])
def test_a_hit_in_a_slower_tier_is_promoted(mem, promote):
    prompt = tokens(5, seed=3)
    keys = fill(mem, prompt)
    e = MiniEngine(chain(CPU, {"backend": "memory", "name": mem}, promote=promote))
    try:
        sched, worker = stores(e)
        got = e.prefill("a", prompt)
        assert got.loaded_tokens == 5 * 16
        assert torch.equal(got.snapshot[:, :5], e.expected(keys))
        assert [t.stats.load_blocks for t in worker.tiers] == [0, 5]
        assert sched.tiers[0].contains_prefix(keys) == (5 if promote else 0)
        assert worker.stats.promoted_blocks == (5 if promote else 0)
        again = e.prefill("b", prompt)
        assert torch.equal(again.snapshot[:, :5], e.expected(keys))
        assert [t.stats.load_blocks for t in worker.tiers] == ([5, 5] if promote else [0, 10])
    finally:
        e.close()


def test_promotion_runs_after_the_load_is_reported_and_holds_the_request(mem, monkeypatch):
    """The load reports as soon as the slower tier's bytes are in; the copy into the faster tier follows
    on the IO thread (held here by a gate on the cpu tier's real save), and the request's blocks are
    held until it is over: a request that ends meanwhile is freed only then."""
    prompt = tokens(5, seed=4)
    keys = fill(mem, prompt)
    e = MiniEngine(chain(CPU, {"backend": "memory", "name": mem}))
    gate = threading.Event()
    try:
        sched, worker = stores(e)
        real_save = worker.tiers[0].save

        def gated_save(*args: Any) -> None:
            gate.wait(10)
            real_save(*args)

        monkeypatch.setattr(worker.tiers[0], "save", gated_save)
        req, ids, n_ext = e.admit("a", prompt)
        assert n_ext == 5 * 16
        e.worker.start_step(e.scheduler.plan_step([]))
        e.worker.finish_step()
        e.wait_for(lambda r: "a" in r.finished_loading, 10)
        assert worker.stats.promoted_blocks == 0, "reported before the promotion ran"
        assert torch.equal(e.read(ids[:5]), e.expected(keys))
        assert e.finish(req, ids).delay_free, "the promotion still reads the request's blocks"
        for _ in range(5):
            e.pump()
        assert "a" in e.held
        gate.set()
        deadline = time.monotonic() + 10
        while "a" in e.held:
            assert time.monotonic() < deadline, "never released after the promotion"
            e.pump()
        assert worker.stats.promoted_blocks == 5 and sched.tiers[0].contains_prefix(keys) == 5
        again = e.prefill("b", prompt)
        assert torch.equal(again.snapshot[:, :5], e.expected(keys))
        assert [t.stats.load_blocks for t in worker.tiers] == [5, 5]
    finally:
        gate.set()
        e.close()


# ---- degradation ---------------------------------------------------------------------------------
class _Faults:
    faults: set[str]

    def _maybe_fail(self, what: str) -> None:
        if what in self.faults:
            raise OSError(f"injected fault in {what}")


class FaultyIndex(_Faults, StoreIndex):
    """A memory store's index with faults injected on purpose: each method in ``faults`` raises."""

    def __init__(self, engine: EngineInfo, name: str, faults: set[str]):
        super().__init__(engine)
        self.inner = MemoryBackend(MemoryOptions(name)).open_index(engine)
        self.faults = faults

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        self._maybe_fail("contains_prefix")
        return self.inner.contains_prefix(keys)


class FaultyIO(_Faults, StoreIO):
    """A memory store's IO with faults injected on purpose."""

    def __init__(self, engine: EngineInfo, name: str, faults: set[str]):
        super().__init__(engine)
        self.inner = MemoryBackend(MemoryOptions(name)).open_io(engine)
        self.faults = faults

    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        self._maybe_fail("load")
        return self.inner.load(op, layout)

    def save(self, op: BlockSave, layout: KVLayout) -> None:
        self._maybe_fail("save")
        self.inner.save(op, layout)


class FaultyBackend(StoreBackend):
    name, options_type = "faulty", dict

    def __init__(self, name: str):
        super().__init__({})
        self.store_name = name
        self.faults: set[str] = set()  # shared by every store it opens: flip faults mid-run

    def open_index(self, engine: EngineInfo) -> FaultyIndex:
        return FaultyIndex(engine, self.store_name, self.faults)

    def open_io(self, engine: EngineInfo) -> FaultyIO:
        return FaultyIO(engine, self.store_name, self.faults)


def faulty_chain(mem: str) -> tuple[ChainBackend, FaultyBackend]:
    backend = chain({"backend": "memory", "name": mem})
    faulty = FaultyBackend(mem + "-faulty")
    backend.tiers.insert(0, faulty)  # the fastest tier is the one that will break
    return backend, faulty


@pytest.mark.parametrize("fault", ["contains_prefix", "load", "save"])
def test_a_failing_tier_degrades_to_the_others(mem, fault):
    backend, faulty = faulty_chain(mem)
    e = MiniEngine(backend)
    try:
        prompt = tokens(4, seed=4)
        if fault == "save":
            faulty.faults.add(fault)
        sent = e.prefill("a", prompt)  # write-through; with a failing save only the memory tier has them
        faulty.faults.add(fault)
        got = e.prefill("b", prompt)
        assert got.loaded_tokens == 4 * 16 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :4], sent.snapshot[:, :4])
        sched, worker = stores(e)
        assert sched.stats.tier_failures + worker.stats.tier_failures > 0
        assert worker.tiers[1].stats.load_blocks == 4  # served by the healthy tier
        assert worker.stats.save_failures == 0 and worker.stats.load_failures == 0
    finally:
        e.close()
        memory.clear(mem + "-faulty")


def test_every_tier_failing_is_a_miss_or_failed_blocks_never_an_error(mem):
    backend, faulty = faulty_chain(mem)
    e = MiniEngine(backend)
    try:
        prompt = tokens(3, seed=5)
        e.prefill("a", prompt)
        faulty.faults.add("load")
        memory._SHARED[mem].clear()  # the only other tier lost everything
        got = e.prefill("b", prompt)  # the faulty tier still claims the blocks, then fails to load them
        assert got.loaded_blocks == [] and len(got.failed_blocks) == 3
        assert torch.equal(got.snapshot[:, :3], e.expected(got.keys[:3]))  # recomputed, not garbage
    finally:
        e.close()
        memory.clear(mem + "-faulty")


@pytest.mark.skipif(importlib.util.find_spec("kvbridge.connectors.fs") is None, reason="fs backend not present")
def test_fs_directory_removed_mid_run(mem, tmp_path):
    root = tmp_path / "fs"
    e = MiniEngine(chain({"backend": "fs", "path": str(root)}, {"backend": "memory", "name": mem}))
    try:
        prompt = tokens(4, seed=6)
        sent = e.prefill("a", prompt)
        _, worker = stores(e)
        assert worker.tiers[0].stats.save_blocks == 4
        shutil.rmtree(root)
        got = e.prefill("b", prompt)
        assert got.loaded_tokens == 4 * 16 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :4], sent.snapshot[:, :4])
        assert worker.tiers[1].stats.load_blocks == 4
        later = e.prefill("c", tokens(2, seed=7))  # saves while the directory is gone: not an error
        assert later.failed_blocks == []
    finally:
        e.close()


@pytest.mark.skipif(native.crc32c_module() is None, reason="kvbridge._core (crc32c) not here")
@pytest.mark.parametrize("damaged", [False, True])
def test_a_consumer_reads_fs_from_its_own_thread_then_promotes(tmp_path, monkeypatch, damaged):
    """A P/D consumer's chain (its cpu, then the shared fs) that misses in cpu: fs starts the read from
    the engine's thread (no IO-thread load: the chain's ``load`` is broken on purpose), and the blocks
    that arrived are promoted into cpu once the load is reported. A block damaged on disk fails from
    itself on, and none of the request is promoted (the cpu tier's reservation is all or nothing; the
    engine's recomputed blocks are saved as any are)."""
    fs_tier = {"backend": "fs", "path": str(tmp_path / "fs")}
    producer = MiniEngine(registry.create("fs", {"path": fs_tier["path"]}), engine_id="p", seed=1)
    consumer = MiniEngine(chain(CPU, fs_tier), engine_id="c", seed=2)
    try:
        prompt = tokens(4, seed=8)
        sent = producer.prefill("a", prompt)
        if damaged:  # block 2 of the one object the prompt made
            from kvbridge.connectors.fs import FsStore

            store = producer.worker.io  # type: ignore[attr-defined]
            assert isinstance(store, FsStore)
            path = os.path.realpath(store.path_of(sent.keys[2]))
            reads = store.reader.locate(sent.keys, producer.layout.fingerprint)
            for r in reads:
                os.close(r.fd)
            with open(path, "r+b") as f:
                f.seek(reads[0].chunk.offset(2) + 100)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 1]))
        sched, worker = stores(consumer)
        monkeypatch.setattr(worker, "load", lambda *a: pytest.fail("the chain's load ran on the IO thread"))
        got = consumer.prefill("b", prompt)
        good = 2 if damaged else 4
        assert got.loaded_blocks == got.block_ids[:good] and got.failed_blocks == sorted(got.block_ids[good:4])
        assert torch.equal(got.snapshot[:, :good], sent.snapshot[:, :good])
        assert torch.equal(got.snapshot[:, :4], consumer.expected(got.keys[:4])), "damaged bytes reached the KV"
        assert [t.stats.load_blocks for t in worker.tiers] == [0, good]
        assert worker.stats.promoted_blocks == (0 if damaged else 4)
        if not damaged:
            assert sched.tiers[0].contains_prefix(sent.keys[:4]) == 4
            again = consumer.prefill("c", prompt)  # from its cpu tier now
            assert torch.equal(again.snapshot[:, :4], sent.snapshot[:, :4])
            assert [t.stats.load_blocks for t in worker.tiers] == [4, 4]
    finally:
        producer.close()
        consumer.close()


@pytest.mark.skipif(native.crc32c_module() is None, reason="kvbridge._core (crc32c) not here")
def test_blocks_a_natively_started_tier_fails_are_asked_of_the_next(tmp_path, monkeypatch):
    """The cpu tier starts a load of 4 blocks from the engine's thread and reports the last 2 failed (a
    fault made on purpose: its copy cannot fail for real here); those 2 are read from fs on the IO
    thread, as a load the IO thread ran would ask them, and nothing is recomputed."""
    e = MiniEngine(chain(CPU, {"backend": "fs", "path": str(tmp_path / "fs")}))
    try:
        prompt = tokens(4, seed=9)
        sent = e.prefill("a", prompt)
        _, worker = stores(e)
        real = worker.tiers[0].start_load

        def half_failed(op: BlockLoad, layout: KVLayout) -> Any:
            started = real(op, layout)
            return Started(op, started, lambda: sorted({*started.failed(), *op.block_ids[2:]}))

        monkeypatch.setattr(worker.tiers[0], "start_load", half_failed)
        got = e.prefill("b", prompt)
        assert got.failed_blocks == [] and got.loaded_blocks == got.block_ids[:4]
        assert torch.equal(got.snapshot[:, :4], sent.snapshot[:, :4])
        assert [t.stats.load_blocks for t in worker.tiers] == [2, 2]
    finally:
        e.close()
