"""The ``lmcache`` tier's chunk objects (format 2): how a prompt is cut, saved over several steps, found
(whole, and as a prefix that ends inside a chunk) and checked block by block; old objects; the option.

Two media: LMCache's local disk tier (producer and consumer in one process share one manager, as the
conformance target does), and an ``lm://`` server with a manager each (every consumer read crosses the
server, and partial chunks are found through the locator objects there).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

if importlib.util.find_spec("lmcache") is None:
    pytest.skip("lmcache is not installed: pip install 'kvbridge[lmcache]'", allow_module_level=True)

from kvbridge.connectors import fs  # noqa: E402
from kvbridge.connectors import lmcache as lmc  # noqa: E402

from kvbridge import codec, registry  # noqa: E402
from kvbridge.contract import BlockLoad, ScheduledRequest  # noqa: E402
from kvbridge.errors import ConfigError  # noqa: E402
from kvbridge.keys import block_keys  # noqa: E402
from kvbridge.testing import MiniEngine  # noqa: E402
from kvbridge.testing.lmcache_server import serving  # noqa: E402

C = 4  # blocks per chunk in these tests (chunk_tokens=64, block_size 16)
_names = itertools.count()


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def _keys(tokens: list[int]) -> list[bytes]:
    return block_keys(tokens, 16, namespace="mini")  # MiniEngine's


def _chunks(keys: list[bytes], chunk: int = C) -> list[int]:
    """The lengths of the chunks ``keys`` are cut into (as fs cuts them)."""
    return fs.chunk_lengths(keys, chunk)


def _prompt(n: int, want: Callable[[list[int]], bool], seed: int = 0, chunk: int = C) -> list[int]:
    """Tokens of ``n`` blocks (and 3 more) whose chunk lengths satisfy ``want`` (the first such seed from ``seed``)."""
    while True:
        tokens = _tokens(n * 16 + 3, seed)
        if want(_chunks(_keys(tokens), chunk)):
            return tokens
        seed += 1


# -- media -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving() as url:
        yield url


def _disk_pair(tmp_path: Path, layout: dict[str, Any] | None = None, **extra: Any) -> tuple[MiniEngine, MiniEngine]:
    """Producer and consumer over one disk tier (one manager: equal options); the arena only stages."""
    opts = {"local_cpu_bytes": 16 << 20, "cpu_cache": False, "local_disk": str(tmp_path / "disk"),
            "local_disk_bytes": 256 << 20, "model_name": f"d{next(_names)}", "chunk_tokens": 64, **extra}
    shape = {"num_blocks": 64, **(layout or {})}
    producer = MiniEngine(registry.create("lmcache", opts), engine_id="p", role="producer", seed=1, **shape)
    consumer = MiniEngine(registry.create("lmcache", opts), engine_id="c", role="consumer", seed=2, **shape)
    assert producer.worker.io.storage_manager is consumer.worker.io.storage_manager
    return producer, consumer


def _server_pair(url: str) -> tuple[MiniEngine, MiniEngine]:
    """Producer and consumer with a manager each, sharing only the server."""
    model = f"s{next(_names)}"

    def backend(arena_mib: int) -> Any:
        return registry.create("lmcache", {"remote_url": url, "local_cpu_bytes": arena_mib << 20, "model_name": model,
                                           "chunk_tokens": 64})

    producer = MiniEngine(backend(16), engine_id="p", role="producer", seed=1, num_blocks=64)
    consumer = MiniEngine(backend(24), engine_id="c", role="consumer", seed=2, num_blocks=64)
    assert producer.worker.io.storage_manager is not consumer.worker.io.storage_manager
    return producer, consumer


@pytest.fixture(params=["disk", "server"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[MiniEngine, MiniEngine]]:
    engines = _disk_pair(tmp_path) if request.param == "disk" else _server_pair(request.getfixturevalue("server"))
    try:
        yield engines
    finally:
        for engine in engines:
            engine.close()


def _chunked_prefill(engine: MiniEngine, request_id: str, tokens: list[int], steps: list[int]) -> tuple[Any, list[int]]:
    """Prefill ``tokens`` over several steps of ``steps`` tokens each, saving after every step; the request and
    its blocks (still allocated)."""
    req = engine.request(request_id, tokens)
    ids = engine.allocate(-(-len(tokens) // 16))
    sched, worker = engine.scheduler, engine.worker
    assert sched.lookup(req, 0).num_tokens == 0
    sched.on_allocated(req, ids, 0)
    done = 0
    for step in steps:
        engine.compute(ids[: (done + step) // 16], req.block_keys[: (done + step) // 16])
        plan = sched.plan_step([ScheduledRequest(request_id, tuple(ids), done, step)])
        assert plan.saves
        worker.start_step(plan)
        worker.finish_step()
        assert worker.wait_idle(30)
        sched.on_report(worker.poll())
        assert worker.io.stats.save_failures == 0
        done += step
    assert done == len(tokens)
    return req, ids


# -- a prompt in several chunks, saved over several steps ------------------------------------------------
def test_chunked_prefill_then_whole_and_inside_a_chunk(pair):
    """24 blocks in chunks of 4 on average, saved in steps of 5, 7 and 12+ blocks (each step ends inside a
    chunk): the whole prompt loads, and a prompt that shares 10 blocks (ending inside a chunk, not where a step
    ended) loads those 10; every loaded byte is what the producer computed."""
    producer, consumer = pair

    def cut(chunks: list[int]) -> bool:  # steps end inside chunks, and block 10 is inside one too
        ends = list(itertools.accumulate(chunks))
        return len(chunks) >= 4 and not {5, 12, 10} & set(ends) and max(chunks) <= 2 * C

    tokens = _prompt(24, cut, seed=100)
    req, ids = _chunked_prefill(producer, "a", tokens, [5 * 16, 7 * 16, len(tokens) - 12 * 16])
    keys = req.block_keys
    assert producer.worker.io.stats.save_blocks == 24
    whole = consumer.prefill("b", tokens)
    assert whole.loaded_tokens == 24 * 16 and whole.failed_blocks == []
    assert torch.equal(whole.snapshot[:, :24], producer.read(ids[:24]))
    assert torch.equal(whole.snapshot[:, :24], consumer.expected(keys[:24]))
    other = tokens[: 10 * 16] + _tokens(5 * 16 + 1, seed=7)
    part = consumer.prefill("c", other)
    assert part.loaded_tokens == 10 * 16 and part.failed_blocks == []
    assert torch.equal(part.snapshot[:, :10], producer.read(ids[:10]))
    assert torch.equal(part.snapshot[:, 10:15], consumer.expected(part.keys[10:15]))
    producer.finish(req, ids)


def test_a_load_that_starts_inside_a_chunk(pair):
    """An engine that already holds the first blocks (its own prefix cache) loads from inside a chunk."""
    producer, consumer = pair
    tokens = _prompt(20, lambda c: c[0] > 2 and len(c) >= 3, seed=200)
    sent = producer.prefill("a", tokens)
    ids = consumer.allocate(20)
    load = BlockLoad("r", tuple(ids[2:20]), tuple(sent.keys[2:20]))
    assert list(consumer.worker.io.load(load, consumer.layout)) == []
    assert torch.equal(consumer.read(ids[2:20]), sent.snapshot[:, 2:20])


def test_one_object_per_chunk_and_a_contains_per_chunk(tmp_path):
    """A prompt of n blocks is as many LMCache objects as chunks (the last, unfinished one included), and a
    lookup of it asks LMCache about one key per chunk."""
    producer, consumer = _disk_pair(tmp_path)
    try:
        tokens = _prompt(40, lambda c: len(c) >= 6 and max(c) <= 2 * C, seed=300)
        chunks = _chunks(_keys(tokens))
        producer.prefill("a", tokens)
        disk = producer.worker.io.storage_manager.storage_backends["LocalDiskBackend"]
        assert len(disk.dict) == len(chunks)
        sm = consumer.scheduler.index.storage_manager
        real, calls = sm.contains, []
        sm.contains = lambda key, *a, **k: calls.append(key) or real(key, *a, **k)
        try:
            assert consumer.scheduler.index.contains_prefix(_keys(tokens)) == 40
        finally:
            del sm.contains
        assert len(calls) == len(chunks)
    finally:
        producer.close()
        consumer.close()


# -- damage -------------------------------------------------------------------------------------------
def test_a_damaged_block_inside_a_chunk(tmp_path):
    """Block 3 of a 6-block object is damaged on disk: blocks 0-2 load from that very object, 3-5 are
    recomputed, the object is dropped from the disk tier (the next producer writes it again)."""
    producer, consumer = _disk_pair(tmp_path, chunk_tokens=256)
    try:
        tokens = _prompt(6, lambda c: c == [6], seed=400, chunk=16)  # one chunk
        sent = producer.prefill("a", tokens)
        store = producer.worker.io
        obj_key, offset, length = store.locate(sent.keys[3])
        assert obj_key == store.lmcache_key(sent.keys[5])  # the object ending the chunk holds block 3
        disk = store.storage_manager.storage_backends["LocalDiskBackend"]
        with open(disk._key_to_path(obj_key), "r+b") as f:
            f.seek(offset + length // 2)
            byte = f.read(1)
            f.seek(offset + length // 2)
            f.write(bytes([byte[0] ^ 0x10]))
        got = consumer.prefill("b", tokens)
        assert got.loaded_blocks == got.block_ids[:3]
        assert got.failed_blocks == sorted(got.block_ids[3:6])
        assert torch.equal(got.snapshot[:, :3], sent.snapshot[:, :3])
        assert torch.equal(got.snapshot[:, :6], consumer.expected(got.keys[:6]))  # recomputed, never the damage
        assert consumer.worker.io.stats.corrupt == 1
        assert disk.contains(obj_key) is False
        again = producer.prefill("c", tokens)  # written again whole
        assert again.loaded_tokens == 0
        assert consumer.prefill("d", tokens).loaded_tokens == 6 * 16  # every full block
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("writer, reader", [("native", "numpy"), ("numpy", "native"), ("numpy", "numpy")])
def test_native_and_numpy_copies_make_and_read_the_same_objects(tmp_path, writer, reader):
    """A KV in host memory moves into and out of objects by address (kvbridge._core, each block checked where
    it lands) or, where that module is missing (forced here), by numpy and torch copies checked in the
    arena first. Both make the same objects, bit-exact either way, kv_first too (K and V of a block apart);
    a damaged block fails from itself on whichever path reads it."""
    from kvbridge import native

    if native.load_core()[0] is None:
        pytest.skip("kvbridge._core is not here")
    producer, consumer = _disk_pair(tmp_path, {"kv_format": "kv_first"}, chunk_tokens=256)
    try:
        for engine, path in ((producer, writer), (consumer, reader)):
            if path == "numpy":
                engine.worker.io._native = None
        tokens = _prompt(6, lambda c: c == [6], seed=400, chunk=16)  # one chunk
        sent = producer.prefill("a", tokens)
        got = consumer.prefill("b", tokens)
        assert got.loaded_blocks == got.block_ids[:6] and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :6], sent.snapshot[:, :6])
        store = producer.worker.io
        obj_key, offset, length = store.locate(sent.keys[4])
        disk = store.storage_manager.storage_backends["LocalDiskBackend"]
        with open(disk._key_to_path(obj_key), "r+b") as f:
            f.seek(offset + length - 1)
            byte = f.read(1)
            f.seek(offset + length - 1)
            f.write(bytes([byte[0] ^ 0x01]))
        again = consumer.prefill("c", tokens)
        assert again.loaded_blocks == again.block_ids[:4] and again.failed_blocks == sorted(again.block_ids[4:6])
        assert torch.equal(again.snapshot[:, :6], consumer.expected(again.keys[:6]))  # recomputed, never the damage
    finally:
        producer.close()
        consumer.close()


def test_large_objects(tmp_path):
    """Objects of megabytes (blocks of 512 KiB, as the copies and checksums see them in real models): a round
    trip is bit-exact, and a block damaged in the middle of a 6 MiB object fails from itself on, the blocks
    before it loaded."""
    layout = {"num_layers": 8, "num_kv_heads": 8, "head_size": 128, "num_blocks": 40}  # 512 KiB per block
    producer, consumer = _disk_pair(tmp_path, layout, local_cpu_bytes=64 << 20, chunk_tokens=256)
    try:
        tokens = _prompt(12, lambda c: c == [12], seed=700, chunk=16)  # one object of 12 blocks (6 MiB)
        sent = producer.prefill("a", tokens)
        got = consumer.prefill("b", tokens)
        assert got.loaded_tokens == 12 * 16 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :12], sent.snapshot[:, :12])
        store = producer.worker.io
        obj_key, offset, length = store.locate(sent.keys[5])
        disk = store.storage_manager.storage_backends["LocalDiskBackend"]
        with open(disk._key_to_path(obj_key), "r+b") as f:
            f.seek(offset + 12345)
            byte = f.read(1)
            f.seek(offset + 12345)
            f.write(bytes([byte[0] ^ 0x01]))
        again = consumer.prefill("c", tokens)
        assert again.loaded_blocks == again.block_ids[:5]
        assert again.failed_blocks == sorted(again.block_ids[5:12])
        assert torch.equal(again.snapshot[:, :5], sent.snapshot[:, :5])
        assert torch.equal(again.snapshot[:, :12], consumer.expected(again.keys[:12]))  # recomputed over what landed
        assert consumer.worker.io.stats.corrupt == 1
    finally:
        producer.close()
        consumer.close()


# -- old objects ----------------------------------------------------------------------------------------
def _put(store: lmc.LMCacheStore, key: Any, data: bytes) -> None:
    from lmcache.v1.memory_management import MemoryFormat

    sm = store.storage_manager
    obj = sm.allocate(torch.Size([1, 1, 1, len(data)]), torch.uint8, fmt=MemoryFormat.KV_2LTD, busy_loop=False)
    obj.tensor.view(-1).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    sm.batched_put([key], [obj])
    store._open().drain([key])


def test_objects_of_format_1_are_misses(tmp_path):
    """Objects an older kvbridge wrote (format 1: one per block, under keys without the format version) are
    never found: a miss, no failed block, nothing counted corrupt, nothing deleted."""
    producer, consumer = _disk_pair(tmp_path)
    try:
        tokens = _tokens(5 * 16 + 1, seed=500)
        keys = _keys(tokens)
        store, layout = producer.worker.io, producer.layout
        old_model = f"{store.options.model_name}-{hashlib.sha256(producer.info.namespace.encode()).hexdigest()[:16]}"
        old_keys = []
        for i, key in enumerate(keys):  # what format 1 put for block i (its bytes: anything well-formed)
            payload = np.full(layout.num_layers * layout.block_bytes, i, dtype=np.uint8)
            header = codec.LMCACHE.pack(key, layout.fingerprint, [payload], codec.CRC32)
            lkey = store._lib.CacheEngineKey(old_model, 1, 0, key, torch.uint8)
            _put(store, lkey, header + payload.tobytes())
            old_keys.append(lkey)
        got = consumer.prefill("b", tokens)
        assert got.offered_tokens == 0 and got.loaded_tokens == 0 and got.failed_blocks == []
        assert consumer.worker.io.stats.corrupt == 0
        assert all(store.storage_manager.contains(k) is not None for k in old_keys)
    finally:
        producer.close()
        consumer.close()


def test_an_object_of_another_version_under_our_key_fails_and_stays(tmp_path):
    """A chunk object whose header names another format version (a later kvbridge's) is not loaded: its blocks
    are failed and recomputed, it is counted, and it is left alone (another engine may read it)."""
    producer, consumer = _disk_pair(tmp_path, chunk_tokens=256)
    try:
        tokens = _prompt(3, lambda c: c == [3], seed=600, chunk=16)
        keys = _keys(tokens)
        store, layout = producer.worker.io, producer.layout
        later = codec.ChunkFormat(magic=lmc.MAGIC, version=lmc.VERSION + 1, align=64)
        payload = np.zeros(3 * layout.num_layers * layout.block_bytes, dtype=np.uint8)
        per = layout.num_layers * layout.block_bytes
        sums = [codec.checksum(codec.CRC32, [payload[i * per : (i + 1) * per]]) for i in range(3)]
        obj_key = store.lmcache_key(keys[2])
        _put(store, obj_key, later.pack(keys, layout.fingerprint, sums, codec.CRC32) + payload.tobytes())
        got = consumer.prefill("b", tokens)
        assert got.loaded_blocks == [] and got.failed_blocks == sorted(got.block_ids[:3])
        assert torch.equal(got.snapshot[:, :3], consumer.expected(got.keys[:3]))
        assert consumer.worker.io.stats.corrupt == 1
        assert store.storage_manager.contains(obj_key) is not None
    finally:
        producer.close()
        consumer.close()


# -- the option ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -16, 1 << 16, "many"])
def test_bad_chunk_tokens_is_a_config_error(value):
    with pytest.raises(ConfigError, match="chunk_tokens"):
        registry.create("lmcache", {"chunk_tokens": value})


def test_chunk_tokens_parses_from_a_string():
    assert registry.create("lmcache", {"chunk_tokens": "128"}).options.chunk_tokens == 128


def test_an_arena_that_cannot_hold_two_objects_is_refused():
    """Two objects of the largest size (2 * chunk_tokens tokens) must fit the arena: said at register, naming
    both options."""
    backend = registry.create("lmcache", {"local_cpu_bytes": 1 << 20, "model_name": "tight", "chunk_tokens": 512})
    engine = None
    with pytest.raises(ConfigError, match="local_cpu_bytes.*chunk_tokens|chunk_tokens.*local_cpu_bytes"):
        engine = MiniEngine(backend, num_layers=8, num_kv_heads=8, head_size=64)  # 256 KiB blocks, 64 per object
    if engine is not None:
        engine.close()
