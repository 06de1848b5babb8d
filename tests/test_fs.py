"""The ``fs`` store: processes sharing a directory, chunk objects (prefix hits inside a chunk, a damaged
block inside one, saves that start inside one), damaged objects, v1 objects, O_DIRECT, full disks,
vanished directories.

The conformance suite (tests/test_conformance.py -k fs) covers the contract; these cover what a
shared filesystem adds.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from kvbridge.connectors import fs
from kvbridge.connectors.fs import HEADER_BYTES, MAGIC, VERSION, FsOptions, FsSave, FsStore

import kvbridge
from kvbridge import codec, native
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo, ScheduledRequest
from kvbridge.errors import ConfigError, StoreFull
from kvbridge.keys import block_keys
from kvbridge.layout import KVLayout, LayoutFingerprint
from kvbridge.testing import MiniEngine

WORKER = Path(__file__).parent / "helpers" / "fs_worker.py"
FIXED = struct.Struct("<8sHHIHHQIII")  # the documented header: magic, version, kind, header len, count, fp len, payload, 0, crc, 0
ENTRY = struct.Struct("<IH")  # per block: checksum, key length (the key follows)


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def _keys(tokens: list[int]) -> list[bytes]:
    return block_keys(tokens, 16, namespace="mini")  # MiniEngine's


def _chunks(keys: list[bytes]) -> list[int]:
    """The lengths of the chunks fs cuts ``keys`` into, 16 blocks each on average."""
    return fs.chunk_lengths(keys, 16)


def _prompt(n: int, want: Callable[[list[int]], bool], seed: int = 0) -> list[int]:
    """Tokens of ``n`` blocks (and 3 more) whose chunk lengths satisfy ``want`` (the first such seed from ``seed``)."""
    while True:
        tokens = _tokens(n * 16 + 3, seed)
        if want(_chunks(_keys(tokens))):
            return tokens
        seed += 1


def _pair(root: Path, *, num_blocks: int = 64, **options: object) -> tuple[MiniEngine, MiniEngine]:
    opts = {"path": str(root), **options}
    producer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="p", role="producer", seed=1, num_blocks=num_blocks)
    consumer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="c", role="consumer", seed=2, num_blocks=num_blocks)
    return producer, consumer


def _store(engine: MiniEngine) -> FsStore:
    store = engine.worker.io  # type: ignore[attr-defined]
    assert isinstance(store, FsStore)
    return store


def _index(engine: MiniEngine) -> fs.FsIndex:
    index = engine.scheduler.index  # type: ignore[attr-defined]
    assert isinstance(index, fs.FsIndex)
    return index


def _objects(root: Path) -> list[Path]:
    """The objects under ``root`` (regular files; the links to them left out)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _links(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_symlink())


def _object_of(store: FsStore, key: bytes) -> Path:
    """The object holding ``key``'s block (its locator, followed)."""
    return Path(os.path.realpath(store.path_of(key)))


def _header(path: Path) -> tuple[tuple[int, ...], list[tuple[int, bytes]], bytes]:
    """(fixed fields, [(checksum, key)] per block, fingerprint JSON) of an object, read as documented."""
    data = path.read_bytes()
    fixed = FIXED.unpack_from(data)
    fp_len, count = fixed[5], fixed[4]
    at = FIXED.size + fp_len
    entries = []
    for _ in range(count):
        crc, key_len = ENTRY.unpack_from(data, at)
        at += ENTRY.size
        entries.append((crc, data[at : at + key_len]))
        at += key_len
    return fixed, entries, data[FIXED.size : FIXED.size + fp_len]


def _block_offset(path: Path, i: int) -> int:
    fixed = FIXED.unpack_from(path.read_bytes())
    return fixed[3] + i * fixed[6]


def _block_of(store: FsStore, key: bytes) -> tuple[Path, int]:
    """(the object holding ``key``'s block, where that block starts in it)."""
    obj = _object_of(store, key)
    pos = [k for _, k in _header(obj)[1]].index(key)
    return obj, _block_offset(obj, pos)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x04]))


def _run(role: str, root: Path, out: Path, seed: int, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(WORKER.parent), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, str(WORKER), role, str(root), str(out), str(seed), *extra], env=env, stderr=subprocess.PIPE)


def _wait(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-3000:]


# ---- options -------------------------------------------------------------------------------------
def test_options_are_checked_at_start_up(tmp_path):
    backend = kvbridge.create_backend("fs", {"path": str(tmp_path), "capacity_bytes": "1000", "fsync": "true", "chunk_tokens": "64"})
    assert backend.options == FsOptions(path=str(tmp_path), capacity_bytes=1000, fsync=True, chunk_tokens=64)
    with pytest.raises(ConfigError, match="path"):
        kvbridge.create_backend("fs", {})
    with pytest.raises(ConfigError, match="capacity_bytes"):
        kvbridge.create_backend("fs", {"path": str(tmp_path), "capacity_bytes": -1})
    with pytest.raises(ConfigError, match="capcity"):
        kvbridge.create_backend("fs", {"path": str(tmp_path), "capcity": 1})
    with pytest.raises(ConfigError, match="checksum"):
        kvbridge.create_backend("fs", {"path": str(tmp_path), "checksum": "md5"})
    with pytest.raises(ConfigError, match="chunk_tokens"):
        kvbridge.create_backend("fs", {"path": str(tmp_path), "chunk_tokens": 0})
    with pytest.raises(ConfigError, match="io_threads"):
        kvbridge.create_backend("fs", {"path": str(tmp_path), "io_threads": 0})
    assert fs.chunk_blocks(16, 256) == 16 and fs.chunk_blocks(128, 256) == 2 and fs.chunk_blocks(512, 256) == 1


# ---- processes sharing the directory --------------------------------------------------------------
def test_producer_process_to_consumer_process_is_bit_exact(tmp_path):
    root = tmp_path / "store"
    _wait(_run("produce", root, tmp_path / "sent.pt", 1))
    _wait(_run("consume", root, tmp_path / "got.pt", 2))
    sent, got = torch.load(tmp_path / "sent.pt"), torch.load(tmp_path / "got.pt")
    assert sent.keys() == got.keys() and len(got) == 6
    for rid in sent:
        n = sent[rid]["snapshot"].shape[1]
        assert got[rid]["loaded"] == n and got[rid]["failed"] == 0, rid
        assert torch.equal(got[rid]["snapshot"], sent[rid]["snapshot"]), f"{rid}: bytes that arrived != bytes that left"


def test_concurrent_processes_never_see_torn_objects(tmp_path):
    root = tmp_path / "store"
    procs = [_run("churn", root, tmp_path / f"churn{i}.pt", 10 + i) for i in range(3)]
    _wait(*procs)
    results = [torch.load(tmp_path / f"churn{i}.pt") for i in range(3)]
    assert all(r["corrupt"] == 0 for r in results), results
    assert sum(r["loaded"] for r in results) > 0  # they did read each other's objects
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_concurrent_writers_of_the_same_chunk(tmp_path):
    """Processes writing the very same chunks at the same moments (each removes them first, so every
    round rewrites them) while reading them back: every read is a miss or bit-exact, none is torn."""
    root = tmp_path / "store"
    start = time.time() + 2.0  # the processes start their rounds together
    procs = [_run("race", root, tmp_path / f"race{i}.pt", 20 + i, str(start)) for i in range(3)]
    _wait(*procs)
    results = [torch.load(tmp_path / f"race{i}.pt") for i in range(3)]
    assert all(r["corrupt"] == 0 and r["bad"] == 0 for r in results), results
    assert sum(r["loaded"] for r in results) > 0
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]
    assert len(_objects(root)) <= 2  # one object per chunk, whoever renamed last


# ---- chunks ----------------------------------------------------------------------------------------
def test_a_link_another_writer_makes_while_its_folder_is_made_again(tmp_path, monkeypatch):
    """A link's folder is gone (an eviction, another engine's clean-up) and, while this writer makes it
    again, another writer links the same block: this writer takes that link as it takes any existing
    one, never fails the save (it did once in CI, under test_concurrent_writers_of_the_same_chunk; the
    interleaving is forced here by a hook in ``Shelf.mkdir``: processes cannot be made to meet there)."""
    producer, _ = _pair(tmp_path / "store")
    store = _store(producer)
    folder = tmp_path / "store" / "links"
    path, target = str(folder / "k"), "../ab/object"
    made = store.shelf.mkdir

    def mkdir_then_another_writer_links(name: str) -> None:
        made(name)
        os.symlink(target, path)

    monkeypatch.setattr(store.shelf, "mkdir", mkdir_then_another_writer_links)
    store.shelf.link(path, target)
    assert os.readlink(path) == target


def test_one_object_per_chunk_and_one_stat_per_chunk(tmp_path, monkeypatch):
    producer, consumer = _pair(tmp_path, num_blocks=160)
    try:
        tokens = _tokens(64 * 16 + 3, seed=1)
        chunks = _chunks(_keys(tokens))
        assert sum(chunks) == 64 and 2 <= len(chunks) <= 12  # 16 blocks on average (crc32 of the key)
        sent = producer.prefill("a", tokens)
        assert sorted(len(_header(p)[1]) for p in _objects(tmp_path)) == sorted(chunks)  # one object per chunk
        assert len(_links(tmp_path)) == 64 - len(chunks)  # a locator per block; a chunk's last is its object
        stats = []
        real = os.stat
        monkeypatch.setattr(os, "stat", lambda p, *a, **k: (stats.append(p), real(p, *a, **k))[1])
        assert _index(consumer).contains_prefix(sent.keys) == 64
        assert len(stats) == len(chunks), stats
        stats.clear()
        # a chain asks which blocks a tier holds right after its lookup: what that lookup found costs no stat
        assert _index(consumer).members(sent.keys[10:30]) == list(range(20)) and not stats
        other = sent.keys[:5] + [os.urandom(16) for _ in range(3)]  # a prompt that goes on elsewhere: stats again
        assert _index(consumer).members(other) == [0, 1, 2, 3, 4] and stats
        stats.clear()
        assert _index(consumer).contains_prefix(sent.keys[:40] + [os.urandom(16) for _ in range(24)]) == 40
        assert len(stats) <= len(chunks) + 2 + max(chunks).bit_length()  # whole chunks, then a bisection
        stats.clear()
        tail = sent.keys[21:]  # a prompt's tail (what a tier of a chain is asked about): the same chunks
        assert _index(consumer).contains_prefix(tail) == 43 and len(stats) <= len(chunks)
        stats.clear()
        miss = [os.urandom(16) for _ in range(64)]
        assert _index(consumer).contains_prefix(miss) == 0
        assert len(stats) == (1 if fs.chunk_end(miss, 0, 16) == 0 else 2)  # a miss: its chunk's last block, then its first
        monkeypatch.undo()
        got = consumer.prefill("b", tokens)
        assert len(got.loaded_blocks) == 64 and torch.equal(got.snapshot, sent.snapshot)
    finally:
        producer.close()
        consumer.close()


def test_prefix_hit_that_ends_inside_a_chunk(tmp_path):
    """A prompt that shares only part of a stored chunk loads that part: through the links of the chunk's
    blocks, whatever the other prompt went on with."""
    producer, consumer = _pair(tmp_path, num_blocks=128)
    try:
        tokens = _prompt(40, lambda c: len(c) >= 2 and c[-1] >= 6)  # a last chunk of 6 blocks or more
        keys = _keys(tokens)
        sent = producer.prefill("a", tokens)
        d = 40 - _chunks(keys)[-1] + 3  # three blocks into the last chunk
        inside = tokens[: d * 16] + _tokens(20 * 16 + 7, seed=3)
        got = consumer.prefill("b", inside)
        assert got.loaded_tokens == d * 16 and len(got.loaded_blocks) == d and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :d], sent.snapshot[:, :d])
        assert torch.equal(got.snapshot[:, d : d + 20], consumer.expected(got.keys[d : d + 20]))
        first = _chunks(keys)[0]
        if first > 2:  # inside the first chunk too
            early = consumer.prefill("c", tokens[: (first - 1) * 16] + _tokens(40, seed=4))
            assert early.loaded_tokens == (first - 1) * 16
            assert torch.equal(early.snapshot[:, : first - 1], sent.snapshot[:, : first - 1])
        short = consumer.prefill("d", tokens[: (d - 1) * 16 + 9])  # a shorter prompt, ending inside a chunk
        assert short.loaded_tokens == (d - 1) * 16 and torch.equal(short.snapshot[:, : d - 1], sent.snapshot[:, : d - 1])
    finally:
        producer.close()
        consumer.close()


def test_a_load_that_starts_inside_a_chunk(tmp_path):
    """An engine that already holds the first blocks (its own prefix cache) loads from the middle of a chunk."""
    producer, consumer = _pair(tmp_path, num_blocks=64)
    try:
        tokens = _tokens(30 * 16 + 1, seed=5)
        sent = producer.prefill("a", tokens)
        ids = consumer.allocate(30)
        load = BlockLoad("r", tuple(ids[7:30]), tuple(sent.keys[7:30]))
        assert list(_store(consumer).load(load, consumer.layout)) == []
        assert torch.equal(consumer.read(ids[7:30]), sent.snapshot[:, 7:30])
    finally:
        producer.close()
        consumer.close()


def test_saves_that_start_inside_a_chunk(tmp_path):
    """A chunked prefill: its first step saves 10 blocks (a partial chunk), the next 14 more. The second
    save rewrites the first chunk whole (its first 10 blocks read back from their object), so a lookup
    finds all 24 blocks with one stat per chunk."""
    producer, consumer = _pair(tmp_path, num_blocks=64)
    try:
        tokens = _prompt(24, lambda c: c[0] > 10, seed=6)  # the first chunk goes on past block 10
        chunks = _chunks(_keys(tokens))
        req = producer.request("a", tokens)
        ids = producer.allocate(25)
        sched, worker = producer.scheduler, producer.worker
        assert sched.lookup(req, 0).num_tokens == 0
        sched.on_allocated(req, ids, 0)
        for done, step in ((0, 10 * 16), (10 * 16, 14 * 16 + 3)):
            producer.compute(ids[: (done + step) // 16], req.block_keys[: (done + step) // 16])
            plan = sched.plan_step([ScheduledRequest("a", tuple(ids), done, step)])
            assert [type(op.target) for op in plan.saves] == [FsSave]
            worker.start_step(plan)
            worker.finish_step()
            assert worker.wait_idle(30)
            sched.on_report(worker.poll())
            if done == 0:
                assert [len(_header(p)[1]) for p in _objects(tmp_path)] == [10]
        assert sorted(len(_header(p)[1]) for p in _objects(tmp_path)) == sorted(chunks)  # the 10-block object was replaced
        assert _index(consumer).contains_prefix(req.block_keys) == 24
        got = consumer.prefill("b", tokens)
        assert len(got.loaded_blocks) == 24 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :24], producer.read(ids[:24]))
        producer.finish(req, ids)
    finally:
        producer.close()
        consumer.close()


def test_a_save_whose_chunk_start_is_unknown_skips_that_chunk(tmp_path):
    """A save that starts inside a chunk whose first blocks it cannot name (FsSave.head None) writes the
    chunks after it, never an object that would not start where its chunk does."""
    producer, consumer = _pair(tmp_path, num_blocks=64)
    try:
        tokens = _prompt(30, lambda c: len(c) >= 2 and c[0] > 4, seed=12)
        keys = _keys(tokens)
        first = _chunks(keys)[0]
        ids = producer.allocate(30)
        producer.compute(ids, keys)
        _store(producer).save(BlockSave("r", tuple(ids[2:]), tuple(keys[2:]), FsSave(None)), producer.layout)
        assert sorted(len(_header(p)[1]) for p in _objects(tmp_path)) == sorted(_chunks(keys)[1:])
        assert _index(consumer).contains_prefix(keys) == 0 and _index(consumer).contains_prefix(keys[first:]) == 30 - first
    finally:
        producer.close()
        consumer.close()


def test_a_damaged_block_inside_an_object(tmp_path):
    """Block 3 of a 6-block object is damaged: blocks 0-2 load from that very object, 3-5 are recomputed;
    the object is deleted, and rewritten whole by the next producer."""
    producer, consumer = _pair(tmp_path)
    try:
        tokens = _prompt(6, lambda c: c == [6], seed=7)  # one chunk
        sent = producer.prefill("a", tokens)
        (victim,) = _objects(tmp_path)
        _flip(victim, _block_offset(victim, 3) + 1000)
        got = consumer.prefill("b", tokens)
        assert got.loaded_blocks == got.block_ids[:3]
        assert got.failed_blocks == sorted(got.block_ids[3:6])
        assert torch.equal(got.snapshot[:, :3], sent.snapshot[:, :3])
        assert torch.equal(got.snapshot[:, :6], consumer.expected(got.keys)), "damaged bytes reached the KV"
        assert _store(consumer).stats.corrupt == 1 and not victim.exists()
        producer.prefill("a2", tokens)
        again = consumer.prefill("c", tokens)
        assert again.failed_blocks == [] and len(again.loaded_blocks) == 6 and torch.equal(again.snapshot, sent.snapshot)
    finally:
        producer.close()
        consumer.close()


def test_locate_names_the_bytes_of_a_block(tmp_path):
    """``locate`` (for tools and fault injection): the object, offset and length of one block's bytes; flipping
    the last of them fails that block and the ones after it, never those before."""
    producer, consumer = _pair(tmp_path)
    try:
        tokens = _prompt(4, lambda c: c == [4], seed=14)
        sent = producer.prefill("a", tokens)
        store = _store(producer)
        path, offset, length = store.locate(sent.keys[1])  # type: ignore[misc]
        assert Path(path) == _object_of(store, sent.keys[1]) and length == 4 * 2048 and offset == HEADER_BYTES + length
        assert store.locate(b"never stored") is None
        _flip(Path(path), offset + length - 1)
        got = consumer.prefill("b", tokens)
        assert got.loaded_blocks == got.block_ids[:1] and got.block_ids[1] in got.failed_blocks
    finally:
        producer.close()
        consumer.close()


# ---- damaged and foreign objects -----------------------------------------------------------------
def _rewrite(path: Path, *, fmt: codec.ChunkFormat = fs.FORMAT, fp: LayoutFingerprint | None = None, fill: int | None = None) -> None:
    """Rewrite an object with consistent checksums, so only the changed field can make it fail."""
    data = path.read_bytes()
    fixed, entries, fp_json = _header(path)
    kind, header_len, payload = fixed[2], fixed[3], fixed[6]
    blocks = [data[header_len + i * payload : header_len + (i + 1) * payload] for i in range(len(entries))]
    if fill is not None:
        blocks = [bytes([fill]) * payload for _ in blocks]
    fingerprint = fp or LayoutFingerprint.from_json(fp_json)
    sums = [codec.checksum(kind, [b]) for b in blocks]
    path.write_bytes(fmt.pack([k for _, k in entries], fingerprint, sums, kind) + b"".join(blocks))


def _payload_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 777] ^= 0x10
    path.write_bytes(bytes(data))


def _header_flip(path: Path) -> None:  # a key's byte: only the header's own checksum can tell
    data = bytearray(path.read_bytes())
    data[FIXED.size + FIXED.unpack_from(data)[5] + ENTRY.size] ^= 0x01
    path.write_bytes(bytes(data))


def _foreign_layout(path: Path) -> None:
    # a layout with other heads but the same bytes per block, and payloads of 0xAB
    fp = LayoutFingerprint.from_json(_header(path)[2])
    other = LayoutFingerprint(fp.dtype, fp.num_layers, fp.num_kv_heads * 2, fp.head_size // 2, fp.block_size, fp.block_bytes, fp.kv_format)
    _rewrite(path, fp=other, fill=0xAB)


DAMAGE = {
    "bit_flip": (_payload_flip, True),
    "header_flip": (_header_flip, True),
    "truncated": (lambda p: os.truncate(p, HEADER_BYTES + 100), True),
    "too_long": (lambda p: p.write_bytes(p.read_bytes() + b"\0"), True),
    "bad_magic": (lambda p: _rewrite(p, fmt=codec.ChunkFormat(b"NOTKVBR!", VERSION), fill=0xAB), True),
    "empty": (lambda p: os.truncate(p, 0), True),
    "foreign_version": (lambda p: _rewrite(p, fmt=codec.ChunkFormat(MAGIC, VERSION + 1), fill=0xAB), False),
    "foreign_layout": (_foreign_layout, False),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_or_foreign_object_is_a_failed_block_never_loaded(tmp_path, damage):
    spoil, deleted = DAMAGE[damage]
    producer, consumer = _pair(tmp_path, chunk_tokens=16)  # a block per object: the object of block 2 only
    try:
        tokens = _tokens(4 * 16 + 3, seed=1)
        sent = producer.prefill("a", tokens)
        victim = _object_of(_store(producer), sent.keys[2])
        spoil(victim)
        got = consumer.prefill("b", tokens)
        assert got.offered_tokens == 4 * 16  # lookup only stats: it cannot know
        assert got.loaded_blocks == got.block_ids[:2]
        assert got.failed_blocks == sorted(got.block_ids[2:4])  # the engine recomputes from the bad block on
        assert torch.equal(got.snapshot[:, :4], consumer.expected(got.keys)), "foreign bytes reached the KV"
        assert torch.equal(got.snapshot[:, :2], sent.snapshot[:, :2])
        assert _store(consumer).stats.corrupt == 1
        assert victim.exists() != deleted  # damaged objects are deleted; foreign ones belong to someone else
        if deleted:  # so the next producer stores it again, and the next consumer loads everything
            producer.prefill("a2", tokens)
            again = consumer.prefill("b2", tokens)
            assert again.failed_blocks == [] and len(again.loaded_blocks) == 4
            assert torch.equal(again.snapshot, sent.snapshot)
    finally:
        producer.close()
        consumer.close()


def test_a_link_to_an_object_without_its_key_is_a_failed_block(tmp_path):
    producer, consumer = _pair(tmp_path)
    try:
        a = _prompt(4, lambda c: c == [4], seed=8)
        b = _prompt(4, lambda c: c == [4], seed=100)
        sent, other = producer.prefill("a", a), producer.prefill("b", b)
        link = Path(_store(producer).path_of(sent.keys[1]))
        assert link.is_symlink()
        link.unlink()
        link.symlink_to(os.readlink(_store(producer).path_of(other.keys[0])))  # to b's object
        ids = consumer.allocate(3)
        failed = _store(consumer).load(BlockLoad("r", tuple(ids), tuple(sent.keys[1:4])), consumer.layout)  # starts at block 1
        assert list(failed) == ids and _store(consumer).stats.corrupt == 1
        assert not link.exists() and not link.is_symlink() and _object_of(_store(producer), other.keys[0]).exists()  # only the bad link goes
        assert _object_of(_store(producer), sent.keys[0]).exists()
    finally:
        producer.close()
        consumer.close()


def test_what_a_locator_must_not_make_us_do(tmp_path):
    """A link planted to a file outside the store is not loadable, and that file is never deleted (only the
    link goes); a FIFO at a locator does not hang the load; a writer's leftover temporary link is swept."""
    producer, consumer = _pair(tmp_path / "store")
    try:
        tokens = _tokens(2 * 16 + 1, seed=15)
        keys = _keys(tokens)
        outside = tmp_path / "precious"
        outside.write_bytes(b"not a kvbridge object" * 300)
        first = Path(_store(consumer).path_of(keys[0]))
        first.parent.mkdir(parents=True, exist_ok=True)  # made at start-up by the engines that write
        first.symlink_to(outside)
        ids = consumer.allocate(2)
        assert list(_store(consumer).load(BlockLoad("r", tuple(ids), tuple(keys[:2])), consumer.layout)) == ids
        assert outside.exists() and not first.is_symlink()
        os.mkfifo(first)
        t0 = time.monotonic()
        assert list(_store(consumer).load(BlockLoad("r", tuple(ids), tuple(keys[:2])), consumer.layout)) == ids
        assert time.monotonic() - t0 < 5 and first.exists()  # foreign: left alone
        first.unlink()
        stale = first.parent / ".stale.1.abcd.tmp"
        stale.symlink_to(outside)
        os.utime(stale, (1, 1), follow_symlinks=False)
        store = FsStore(EngineInfo("e", 16, namespace="mini"), FsOptions(path=str(tmp_path / "store"), capacity_bytes=1 << 30))
        list(store.shelf.scan())
        assert not stale.is_symlink() and outside.exists()
        store.close()
    finally:
        producer.close()
        consumer.close()


def test_version_1_objects_are_misses(tmp_path):
    """Objects of the one-file-per-block format (v1) where that format kept them: never looked at, never an
    error; eviction removes them like any object."""
    producer, consumer = _pair(tmp_path)
    try:
        tokens = _tokens(3 * 16 + 1, seed=9)
        req = producer.request("old", tokens)
        v1 = Path(_store(producer).ns_dir) / "0"  # <root>/<namespace>/<rank>: where v1 put its objects
        layout = producer.layout
        ids = producer.allocate(3)
        producer.compute(ids, req.block_keys)
        staging = layout.gather(ids)
        for i, key in enumerate(req.block_keys):
            rows = [memoryview(staging[layer, i].numpy()) for layer in range(layout.num_layers)]
            name = fs.object_name(key)
            (v1 / name[:2]).mkdir(parents=True, exist_ok=True)
            header = codec.FS_V1.pack(key, layout.fingerprint, rows, codec.CRC32)
            (v1 / name[:2] / name).write_bytes(header + b"".join(bytes(r) for r in rows))
        got = consumer.prefill("b", tokens)
        assert got.offered_tokens == 0 and got.failed_blocks == [] and _store(consumer).stats.corrupt == 0
        assert len(list(v1.glob("*/*"))) >= 3  # left alone
        sent = producer.prefill("new", tokens)  # today's objects beside them
        assert torch.equal(consumer.prefill("c", tokens).snapshot, sent.snapshot)
        store = FsStore(EngineInfo("e", 16, namespace=producer.info.namespace), FsOptions(path=str(tmp_path), capacity_bytes=1 << 30))
        assert len([p for p in store.shelf.scan() if "/v2-" not in p[2]]) == 3  # counted (and evictable) like any object
        store.close()
    finally:
        producer.close()
        consumer.close()


# ---- O_DIRECT ----------------------------------------------------------------------------------------
def test_o_direct_round_trip(tmp_path):
    try:
        producer, consumer = _pair(tmp_path / "store", o_direct=True)
    except ConfigError as exc:
        pytest.skip(f"no O_DIRECT here: {exc}")
    try:
        tokens = _tokens(20 * 16 + 3, seed=10)
        sent = producer.prefill("a", tokens)
        got = consumer.prefill("b", tokens)
        assert len(got.loaded_blocks) == 20 and torch.equal(got.snapshot, sent.snapshot)
        victim, offset = _block_of(_store(producer), sent.keys[17])
        _flip(victim, offset + 5)
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


# ---- keys, paths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key", [b"../../../etc/passwd", b"/abs/path", b"", b"\0" * 3, b"a/../../b" * 40, bytes(range(256))])
def test_keys_cannot_escape_the_directory(tmp_path, key):
    root = tmp_path / "store"
    producer, consumer = _pair(root)
    try:
        store = _store(producer)
        path = Path(store.path_of(key))
        assert path.resolve().is_relative_to(root.resolve())
        assert set(path.name) <= set("0123456789abcdefh") and len(path.name) <= 65
        ids = producer.allocate(2)
        producer.compute(ids, [b"first", key])
        store.save(BlockSave("r", tuple(ids), (b"first", key)), producer.layout)
        assert Path(os.path.realpath(path)) in _objects(root) and len(_objects(root)) <= 2
        assert all(p.resolve().is_relative_to(root.resolve()) for p in root.rglob("*"))
        assert consumer.scheduler.index.contains_prefix([b"first", key, b"other"]) == 2  # type: ignore[attr-defined]
        dst = consumer.allocate(2)
        assert list(_store(consumer).load(BlockLoad("r", tuple(dst), (b"first", key)), consumer.layout)) == []
        assert torch.equal(consumer.read(dst), producer.read(ids))
    finally:
        producer.close()
        consumer.close()


def test_engines_of_other_namespaces_or_ranks_do_not_meet(tmp_path):
    options = FsOptions(path=str(tmp_path))
    a = FsStore(EngineInfo("a", 16, namespace="llama"), options)
    b = FsStore(EngineInfo("b", 16, namespace="mistral"), options)
    c = FsStore(EngineInfo("c", 16, namespace="llama", rank=1, world_size=2), options)
    d = FsStore(EngineInfo("d", 16, namespace="llama"), FsOptions(path=str(tmp_path), chunk_tokens=128))  # other chunks
    assert len({os.path.dirname(os.path.dirname(s.path_of(b"k"))) for s in (a, b, c, d)}) == 4


# ---- capacity, full disk, vanished directory ------------------------------------------------------
def test_capacity_evicts_the_oldest_objects(tmp_path):
    probe = MiniEngine(kvbridge.create_backend("memory", {"name": "fs-probe"}))
    size = HEADER_BYTES + probe.layout.num_layers * probe.layout.block_bytes  # an object of one block
    probe.close()
    producer, consumer = _pair(tmp_path, capacity_bytes=10 * size, chunk_tokens=16)
    try:
        old = producer.prefill("old", _tokens(6 * 16, seed=1))
        new = producer.prefill("new", _tokens(6 * 16, seed=2))
        assert sum(p.stat().st_size for p in _objects(tmp_path)) <= 10 * size
        assert _store(producer).stats.evictions >= 2
        got = consumer.prefill("c-new", _tokens(6 * 16, seed=2))
        assert len(got.loaded_blocks) == 6 and torch.equal(got.snapshot, new.snapshot)
        assert consumer.scheduler.index.contains_prefix(old.keys) < 6  # type: ignore[attr-defined]  # the oldest went first
        store = _store(producer)
        list(store.shelf.scan())
        assert all(p.exists() for p in _links(tmp_path))  # scans remove the links left pointing nowhere
        with pytest.raises(StoreFull, match="capacity"):  # more than the whole capacity in one save
            store.save(BlockSave("big", tuple(range(11)), tuple(bytes([i]) for i in range(11))), producer.layout)
    finally:
        producer.close()
        consumer.close()


def test_scans_remove_links_to_evicted_objects(tmp_path):
    producer = MiniEngine(kvbridge.create_backend("fs", {"path": str(tmp_path)}), engine_id="p", role="producer")
    try:
        sent = producer.prefill("a", _prompt(5, lambda c: c == [5], seed=13))
        (obj,) = _objects(tmp_path)
        assert len(_links(tmp_path)) == 4
        obj.unlink()  # as another process's eviction would
        store = FsStore(EngineInfo("e", 16, namespace="mini"), FsOptions(path=str(tmp_path), capacity_bytes=1 << 20))
        assert list(store.shelf.scan()) == [] and _links(tmp_path) == []
        assert _index(producer).contains_prefix(sent.keys) == 0
        store.close()
    finally:
        producer.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a 4 MiB tmpfs here: {res.stderr.strip() or res.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_fails_the_save_cleanly(small_tmpfs):
    layout = {"head_size": 64, "num_blocks": 128}  # 32 KiB blocks: ~120 fit in 4 MiB
    opts = {"path": str(small_tmpfs / "store")}
    producer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="p", role="producer", seed=1, **layout)
    consumer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="c", role="consumer", seed=2, **layout)
    try:
        first = producer.prefill("first", _tokens(60 * 16, seed=1))
        assert _store(producer).stats.save_failures == 0
        producer.prefill("second", _tokens(100 * 16, seed=2))  # does not fit: the save fails, the request does not
        assert _store(producer).stats.save_failures == 1
        assert not [p for p in small_tmpfs.rglob("*") if p.name.endswith(".tmp")], "temp file left behind"
        got = consumer.prefill("c", _tokens(60 * 16, seed=1))  # nothing already stored was lost
        assert len(got.loaded_blocks) == 60 and torch.equal(got.snapshot, first.snapshot)
        partial = consumer.prefill("c2", _tokens(100 * 16, seed=2))  # the chunks that did fit load exactly
        assert partial.failed_blocks == []
        assert torch.equal(partial.snapshot, consumer.expected(partial.keys))
        store = _store(producer)
        ids = producer.allocate(120)  # more than the room left, whichever chunks the failed save freed
        with pytest.raises(StoreFull):
            store.save(BlockSave("third", tuple(ids), tuple(bytes([7, i]) for i in range(120))), producer.layout)
        assert not [p for p in small_tmpfs.rglob("*") if p.name.endswith(".tmp")]
    finally:
        producer.close()
        consumer.close()


def test_directory_removed_mid_run(tmp_path):
    root = tmp_path / "store"
    producer, consumer = _pair(root)
    try:
        tokens = _tokens(4 * 16 + 1, seed=3)
        producer.prefill("a", tokens)
        req = consumer.request("b", tokens)
        assert consumer.scheduler.lookup(req, 0).num_tokens == 4 * 16
        shutil.rmtree(root)  # between the lookup and the load
        ids = consumer.allocate(5)
        consumer.scheduler.on_allocated(req, ids, 4 * 16)
        consumer.worker.start_step(consumer.scheduler.plan_step([]))
        consumer.worker.finish_step()
        assert consumer.worker.wait_idle(10)  # type: ignore[attr-defined]
        report = consumer.worker.poll()
        consumer.scheduler.on_report(report)
        assert "b" in report.finished_loading and report.failed_blocks == frozenset(ids[:4])
        consumer.scheduler.on_finished(req, ids)
        consumer.free(ids)
        assert consumer.prefill("c", tokens).loaded_tokens == 0  # now a plain miss
        sent = producer.prefill("a2", tokens)  # a producer makes the directories again
        got = consumer.prefill("d", tokens)
        assert len(got.loaded_blocks) == 4 and torch.equal(got.snapshot[:, :4], sent.snapshot[:, :4])
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("checksum", ["crc32", "crc32c"])
def test_checksum_kinds_round_trip_and_catch_a_flip(tmp_path, checksum, threads):
    if checksum == "crc32c" and not codec.have_crc32c():
        pytest.skip("checksum='crc32c' needs kvbridge's native module or google-crc32c")
    producer, consumer = _pair(tmp_path, checksum=checksum, fsync=True, io_threads=threads)
    try:
        tokens = _tokens(3 * 16 + 1, seed=9)
        sent = producer.prefill("a", tokens)
        assert torch.equal(consumer.prefill("b", tokens).snapshot, sent.snapshot)
        _payload_flip(_object_of(_store(producer), sent.keys[0]))  # in block 0
        got = consumer.prefill("c", tokens)
        assert got.loaded_blocks == [] and len(got.failed_blocks) == 3
        assert torch.equal(got.snapshot[:, :3], consumer.expected(got.keys)) and _store(consumer).stats.corrupt == 1
    finally:
        producer.close()
        consumer.close()


def test_layers_of_separate_allocations(tmp_path):
    """Layers that are not evenly spaced in memory (no one view of every layer) move the same bytes,
    layer by layer."""
    producer = MiniEngine(kvbridge.create_backend("fs", {"path": str(tmp_path)}), engine_id="p", role="producer")
    try:
        tokens = _tokens(5 * 16 + 8, seed=11)
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
        tokens = _tokens(5 * 16 + 8, seed=11)
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
        tokens = _tokens(9 * 16 + 3, seed=p * 10 + c)
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
        tokens = _tokens(8 * 16 + 3, seed=5)
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
    producer, consumer = _pair(tmp_path)
    try:
        tokens = _prompt(6, lambda c: c == [6], seed=7)  # one chunk
        sent = producer.prefill("a", tokens)
        monkeypatch.setattr(_store(consumer), "load", lambda *a: pytest.fail("loaded on the IO thread"))
        got = consumer.prefill("b", tokens)
        assert got.failed_blocks == [] and torch.equal(got.snapshot[:, :6], sent.snapshot[:, :6])
        (victim,) = _objects(tmp_path)
        _flip(victim, _block_offset(victim, 4) + 77)
        bad = consumer.prefill("c", tokens)
        assert bad.loaded_blocks == bad.block_ids[:4] and bad.failed_blocks == sorted(bad.block_ids[4:6])
        assert torch.equal(bad.snapshot[:, :6], consumer.expected(bad.keys[:6])), "damaged bytes reached the KV"
        assert _store(consumer).stats.corrupt == 1 and not victim.exists()
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
    producer, consumer = _pair(tmp_path)
    try:
        tokens = _prompt(12, lambda c: len(c) >= 3, seed=3)
        sent = producer.prefill("a", tokens)
        objects = _objects(tmp_path)
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
    producer, consumer = _pair(tmp_path)
    try:
        producer.prefill("a", _tokens(3 * 16 + 1, seed=40))
        shard = Path(_store(producer).dir)
        assert sorted(p.name for p in shard.iterdir()) == [f"{i:02x}" for i in range(256)]
        made: list[str] = []
        real = os.makedirs
        monkeypatch.setattr(os, "makedirs", lambda path, *a, **k: (made.append(str(path)), real(path, *a, **k))[1])
        sent = producer.prefill("b", tokens := _tokens(40 * 16 + 1, seed=41))
        assert made == []
        for folder in shard.iterdir():
            shutil.rmtree(folder)
        again = producer.prefill("c", _tokens(3 * 16 + 1, seed=42))
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
        tokens = _prompt(6, lambda c: c == [6], seed=7)  # one chunk
        sent = producer.prefill("a", tokens)
        assert moves == [staged != "consumer"], "the save went natively, through staging where chosen"
        got = consumer.prefill("b", tokens)
        assert moves[1:] == [staged != "producer"], "the load went natively, through staging where chosen"
        assert got.failed_blocks == [] and got.loaded_tokens == 96
        assert torch.equal(got.snapshot[:, :6], sent.snapshot[:, :6])
        (victim,) = _objects(tmp_path)
        _flip(victim, _block_offset(victim, 4) + 77)
        bad = consumer.prefill("c", tokens)
        assert bad.loaded_blocks == bad.block_ids[:4] and bad.failed_blocks == sorted(bad.block_ids[4:6])
        assert torch.equal(bad.snapshot[:, :6], consumer.expected(bad.keys[:6])), "damaged bytes reached the KV"
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("chunk", [1, 2, 16, 64])
def test_chunk_ends_cut_where_chunk_end_does(chunk):
    """``chunk_ends`` (every chunk at once, the lookup's and the save's cut) agrees with ``chunk_end`` walked
    key by key, whatever the keys and the chunk size; the last key always ends a chunk."""
    rng = np.random.default_rng(chunk)
    for n in (0, 1, 2, 17, 200):
        keys = [rng.bytes(16) for _ in range(n)]
        walked, i = [], 0
        while i < n:
            walked.append(fs.chunk_end(keys, i, chunk))
            i = walked[-1] + 1
        assert fs.chunk_ends(keys, chunk) == walked
        assert sum(fs.chunk_lengths(keys, chunk)) == n and all(x > 0 for x in fs.chunk_lengths(keys, chunk))
