"""How the ``fs`` store moves bytes: O_DIRECT, each checksum kind, layers of separate allocations, K/V-first
KV by address or through staging, another tensor-parallel size, loads started from the engine's thread,
the page cache and read-ahead, folders made once, and a KV the host cannot address.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
from fskit import (
    block_of,
    block_offset,
    flip_byte,
    flip_payload,
    fs_pair,
    object_of,
    objects_in,
    prompt_with,
    random_tokens,
    store_of,
)
from kvbridge.connectors import fs
from kvbridge.connectors.fs import FsOptions, FsStore

import kvbridge
from kvbridge import codec, native
from kvbridge.contract import BlockLoad, EngineInfo
from kvbridge.errors import ConfigError
from kvbridge.layout import KVLayout
from kvbridge.testing import MiniEngine


# ---- O_DIRECT ----------------------------------------------------------------------------------------
def test_o_direct_round_trip(tmp_path):
    try:
        producer, consumer = fs_pair(tmp_path / "store", o_direct=True)
    except ConfigError as exc:
        pytest.skip(f"no O_DIRECT here: {exc}")
    try:
        tokens = random_tokens(20 * 16 + 3, seed=10)
        sent = producer.prefill("a", tokens)
        got = consumer.prefill("b", tokens)
        assert len(got.loaded_blocks) == 20 and torch.equal(got.snapshot, sent.snapshot)
        victim, offset = block_of(store_of(producer), sent.keys[17])
        flip_byte(victim, offset + 5)
        bad = consumer.prefill("c", tokens)
        assert bad.loaded_blocks == bad.block_ids[:17] and bad.failed_blocks == sorted(bad.block_ids[17:20])
        assert torch.equal(bad.snapshot[:, :20], consumer.expected(bad.keys))
    finally:
        producer.close()
        consumer.close()


def test_o_direct_where_the_filesystem_refuses_it_is_a_config_error(tmp_path, monkeypatch):
    real = os.open

    def no_direct(path, flags, *args):  # what tmpfs answered before Linux 6.6
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(ConfigError, match="does not support O_DIRECT"):
        kvbridge.create_backend("fs", {"path": str(tmp_path), "o_direct": True})
    assert not list(tmp_path.iterdir())  # the probe left nothing behind
    kvbridge.create_backend("fs", {"path": str(tmp_path)})  # without it, fine



@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("checksum", ["crc32", "crc32c"])
def test_checksum_kinds_round_trip_and_catch_a_flip(tmp_path, checksum, threads):
    if checksum == "crc32c" and not codec.have_crc32c():
        pytest.skip("checksum='crc32c' needs kvbridge's native module or google-crc32c")
    producer, consumer = fs_pair(tmp_path, checksum=checksum, fsync=True, io_threads=threads)
    try:
        tokens = random_tokens(3 * 16 + 1, seed=9)
        sent = producer.prefill("a", tokens)
        assert torch.equal(consumer.prefill("b", tokens).snapshot, sent.snapshot)
        flip_payload(object_of(store_of(producer), sent.keys[0]))  # in block 0
        got = consumer.prefill("c", tokens)
        assert got.loaded_blocks == [] and len(got.failed_blocks) == 3
        assert torch.equal(got.snapshot[:, :3], consumer.expected(got.keys)) and store_of(consumer).stats.corrupt == 1
    finally:
        producer.close()
        consumer.close()


def test_layers_of_separate_allocations(tmp_path):
    """Layers that are not evenly spaced in memory (no one view of every layer) move the same bytes,
    layer by layer."""
    producer = MiniEngine(kvbridge.create_backend("fs", {"path": str(tmp_path)}), engine_id="p", role="producer")
    try:
        tokens = random_tokens(5 * 16 + 8, seed=11)
        sent = producer.prefill("a", tokens)
        shape = tuple(producer.layout.layers[0].shape)  # [blocks, heads, tokens, 2 * head]
        base = torch.zeros((4 * shape[0] + 7, *shape[1:]), dtype=torch.bfloat16)
        views = [base[o : o + shape[0]] for o in (0, shape[0] + 1, 2 * shape[0] + 3, 3 * shape[0] + 7)]
        layout = KVLayout.from_tensors(views, block_size=16)
        blocks = fs.kv.Blocks.of(layout)
        assert blocks is not None and blocks.slab is None
        store = FsStore(EngineInfo("c", 16, namespace=producer.info.namespace), FsOptions(path=str(tmp_path)))
        store.attach(layout)
        dst = (9, 3, 17, 0, 40)
        assert list(store.load(BlockLoad("r", dst, tuple(sent.keys[:5])), layout)) == []
        assert torch.equal(layout.gather(dst), sent.snapshot[:, :5])
        store.close()
    finally:
        producer.close()


@pytest.mark.parametrize("writer, reader", [("native", "native"), ("native", "staging"), ("staging", "native")])
def test_kv_first_moves_by_address_or_through_staging_alike(tmp_path, writer, reader):
    """kv_first (K and V of a block apart): kvbridge._core moves each block's pieces by address where it is
    built (vLLM's CPU KV has this layout), else staging and one scatter. The objects are the same either
    way: each path reads what the other wrote, bit-exact."""
    if native.crc32c_module() is None:
        pytest.skip("kvbridge._core with crc32c is not here")
    opts = {"path": str(tmp_path), "checksum": "crc32c"}
    producer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="p", role="producer", seed=1, kv_format="kv_first")
    consumer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="c", role="consumer", seed=2, kv_format="kv_first")
    try:
        assert fs.kv.Blocks.of(consumer.layout) is None  # no view per block: K and V apart
        for engine, path in ((producer, writer), (consumer, reader)):
            if path == "staging":
                engine.worker.io._native = None  # type: ignore[attr-defined]
        tokens = random_tokens(5 * 16 + 8, seed=11)
        sent = producer.prefill("a", tokens)
        got = consumer.prefill("b", tokens)
        assert len(got.loaded_blocks) == 5 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :5], sent.snapshot[:, :5])
    finally:
        producer.close()
        consumer.close()


# ---- another tensor-parallel size ---------------------------------------------------------------------

def _tp_pair(root: Path, p: int, c: int, heads: int) -> tuple[MiniEngine, MiniEngine]:
    opts = {"path": str(root), "chunk_tokens": 64}
    producer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="p", role="producer", seed=1, tp=p, num_kv_heads=heads)
    consumer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="c", role="consumer", seed=2, tp=c, num_kv_heads=heads)
    return producer, consumer


@pytest.mark.parametrize("p,c,heads", [(2, 1, 4), (1, 2, 4), (4, 2, 4), (3, 2, 6)])
def test_a_consumer_of_another_tp_size_cuts_its_heads_out_of_the_shards(tmp_path, p, c, heads):
    producer, consumer = _tp_pair(tmp_path, p, c, heads)
    try:
        tokens = random_tokens(9 * 16 + 3, seed=p * 10 + c)
        sent = producer.prefill("a", tokens)
        shards = {d.name for d in Path(_store_dir(producer)).parent.parent.iterdir()}
        assert shards == {f"tp{p}.{r}" for r in range(p)}
        got = consumer.prefill("b", tokens)
        assert got.loaded_tokens == 9 * 16 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :9], sent.snapshot[:, :9]), "every head of every layer, bit for bit"
        assert torch.equal(got.snapshot[:, :9], consumer.expected(got.keys[:9]))
    finally:
        producer.close()
        consumer.close()


def test_a_shard_missing_blocks_fails_them_for_every_rank(tmp_path):
    """A tp=2 producer's rank 1 lost the tail of the prompt: a tp=1 consumer (which needs both ranks'
    heads for every block) loads only what both shards hold, and recomputes the rest."""
    producer, consumer = _tp_pair(tmp_path, 2, 1, 4)
    try:
        tokens = random_tokens(8 * 16 + 3, seed=5)
        sent = producer.prefill("a", tokens)
        rank1 = producer.worker.workers[1].io  # type: ignore[attr-defined]
        for key in sent.keys[4:]:  # the objects of the second chunk and after, in rank 1's shard only
            Path(rank1.path_of(key)).unlink(missing_ok=True)
        got = consumer.prefill("b", tokens)
        assert 0 < len(got.loaded_blocks) < 8 and got.failed_blocks
        n = len(got.loaded_blocks)
        assert torch.equal(got.snapshot[:, :n], sent.snapshot[:, :n])
        assert torch.equal(got.snapshot[:, :8], consumer.expected(got.keys[:8]))
    finally:
        producer.close()
        consumer.close()


def _store_dir(engine: MiniEngine) -> str:
    workers = getattr(engine.worker, "workers", [engine.worker])
    return str(workers[0].io.dir)  # type: ignore[attr-defined]


@pytest.mark.skipif(native.crc32c_module() is None, reason="kvbridge._core (crc32c) not here")
def test_a_load_is_started_from_the_engines_thread(tmp_path, monkeypatch):
    """With the native module and a CPU KV, the worker's load never goes to its IO thread (``load`` is
    broken on purpose): the objects are opened by ``start_step``, the bytes read on the native threads
    and checked by the poll that sees them over, bit-exact; a block damaged on disk fails from itself."""
    producer, consumer = fs_pair(tmp_path)
    try:
        tokens = prompt_with(6, lambda c: c == [6], seed=7)  # one chunk
        sent = producer.prefill("a", tokens)
        monkeypatch.setattr(store_of(consumer), "load", lambda *a: pytest.fail("loaded on the IO thread"))
        got = consumer.prefill("b", tokens)
        assert got.failed_blocks == [] and torch.equal(got.snapshot[:, :6], sent.snapshot[:, :6])
        (victim,) = objects_in(tmp_path)
        flip_byte(victim, block_offset(victim, 4) + 77)
        bad = consumer.prefill("c", tokens)
        assert bad.loaded_blocks == bad.block_ids[:4] and bad.failed_blocks == sorted(bad.block_ids[4:6])
        assert torch.equal(bad.snapshot[:, :6], consumer.expected(bad.keys[:6])), "damaged bytes reached the KV"
        assert store_of(consumer).stats.corrupt == 1 and not victim.exists()
    finally:
        producer.close()
        consumer.close()


def test_cached_says_whether_a_byte_is_in_the_page_cache(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert fs.files.cached(fd, (1 << 20) - 1)  # just written
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if fs.files.cached(fd, (1 << 20) - 1):
            pytest.skip(f"{tmp_path} keeps pages after POSIX_FADV_DONTNEED (tmpfs)")
        os.pread(fd, 1, (1 << 20) - 1)
        assert fs.files.cached(fd, (1 << 20) - 1)  # read again
        assert not fs.files.cached(fd, 2 << 20)  # past the end: nothing to read
    finally:
        os.close(fd)


def test_read_ahead_is_asked_only_for_objects_out_of_the_page_cache(tmp_path, monkeypatch):
    """A load advises the kernel to read ahead the objects after its first (``POSIX_FADV_WILLNEED``) only where
    they are not in the page cache: for a cached object the advice only walks its pages, on the engine's
    thread. Either way the load is bit-exact. (Objects this small are read ahead whole by the
    read of their header, so the second load is told they are not cached: ``_cached`` is replaced.)"""
    producer, consumer = fs_pair(tmp_path)
    try:
        tokens = prompt_with(12, lambda c: len(c) >= 3, seed=3)
        sent = producer.prefill("a", tokens)
        objects = objects_in(tmp_path)
        assert len(objects) >= 3
        advised: list[int] = []
        real = os.posix_fadvise
        monkeypatch.setattr(os, "posix_fadvise", lambda fd, *a: (advised.append(fd), real(fd, *a))[1])
        got = consumer.prefill("b", tokens)
        assert len(got.loaded_blocks) == 12 and torch.equal(got.snapshot[:, :12], sent.snapshot[:, :12])
        assert advised == [], "objects in the page cache were advised"
        monkeypatch.setattr(fs.files, "cached", lambda fd, at: False)
        again = consumer.prefill("c", tokens)
        assert len(again.loaded_blocks) == 12 and torch.equal(again.snapshot[:, :12], sent.snapshot[:, :12])
        assert len(advised) == len(objects) - 1  # every object after the first
    finally:
        producer.close()
        consumer.close()


def test_the_first_save_makes_every_folder_later_saves_make_none(tmp_path, monkeypatch):
    """A save into a folder not made yet paid a mkdir (and each link into one a failed symlink first):
    the first save makes the shard's 256 folders, and the saves after it make none; a folder removed
    behind the store's back is made again by the save that needs it."""
    producer, consumer = fs_pair(tmp_path)
    try:
        producer.prefill("a", random_tokens(3 * 16 + 1, seed=40))
        shard = Path(store_of(producer).dir)
        assert sorted(p.name for p in shard.iterdir()) == [f"{i:02x}" for i in range(256)]
        made: list[str] = []
        real = os.makedirs
        monkeypatch.setattr(os, "makedirs", lambda path, *a, **k: (made.append(str(path)), real(path, *a, **k))[1])
        sent = producer.prefill("b", tokens := random_tokens(40 * 16 + 1, seed=41))
        assert made == []
        for folder in shard.iterdir():
            shutil.rmtree(folder)
        again = producer.prefill("c", random_tokens(3 * 16 + 1, seed=42))
        assert made and again.failed_blocks == []
        got = consumer.prefill("d", tokens)
        assert got.failed_blocks == [] and torch.equal(got.snapshot[:, :40], sent.snapshot[:, :40])
    finally:
        producer.close()
        consumer.close()


@pytest.mark.skipif(native.crc32c_module() is None, reason="kvbridge._core (crc32c) not here")
@pytest.mark.parametrize("staged", ["producer", "consumer", "both"])
@pytest.mark.parametrize("kv_format", ["blocks_first", "kv_first"])
def test_a_kv_the_host_cannot_address_moves_through_staging(tmp_path, monkeypatch, staged, kv_format):
    """A KV on a GPU is saved and loaded by the native path through a staging buffer (gathered, then
    written by address; read by address, then scattered). Here the engines' KV is on the CPU and only the
    decision is forced (``plan.host_addressable``: CI has no GPU), for one side or both: objects written one way
    read back the other way bit for bit, and a damaged block still fails from itself."""
    layout = {} if kv_format == "blocks_first" else {"kv_format": "kv_first"}
    opts = {"path": str(tmp_path)}
    producer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="p", role="producer", seed=1, **layout)
    consumer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="c", role="consumer", seed=2, **layout)
    chosen = {id(e.layout) for e, side in ((producer, "producer"), (consumer, "consumer")) if staged in (side, "both")}
    monkeypatch.setattr(fs.plan, "host_addressable", lambda lay: id(lay) not in chosen)
    moves: list[bool] = []
    start_move = fs.native.start_move

    def spy(mod, lay, block_ids, runs, *, write, addressing=None):  # type: ignore[no-untyped-def]
        moves.append(addressing is not None)
        return start_move(mod, lay, block_ids, runs, write=write, addressing=addressing)

    monkeypatch.setattr(fs.native, "start_move", spy)
    try:
        tokens = prompt_with(6, lambda c: c == [6], seed=7)  # one chunk
        sent = producer.prefill("a", tokens)
        assert moves == [staged != "consumer"], "the save went natively, through staging where chosen"
        got = consumer.prefill("b", tokens)
        assert moves[1:] == [staged != "producer"], "the load went natively, through staging where chosen"
        assert got.failed_blocks == [] and got.loaded_tokens == 96
        assert torch.equal(got.snapshot[:, :6], sent.snapshot[:, :6])
        (victim,) = objects_in(tmp_path)
        flip_byte(victim, block_offset(victim, 4) + 77)
        bad = consumer.prefill("c", tokens)
        assert bad.loaded_blocks == bad.block_ids[:4] and bad.failed_blocks == sorted(bad.block_ids[4:6])
        assert torch.equal(bad.snapshot[:, :6], consumer.expected(bad.keys[:6])), "damaged bytes reached the KV"
    finally:
        producer.close()
        consumer.close()


