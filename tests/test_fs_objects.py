"""The ``fs`` store's chunk objects: prefix hits, loads and saves that start inside a chunk, a damaged block
inside one, damaged and foreign objects (never loaded), version-1 objects (misses), and where chunks end.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fskit import (
    ENTRY,
    FIXED,
    block_offset,
    chunk_lengths_of,
    flip_byte,
    flip_payload,
    fs_pair,
    index_of,
    keys_of,
    links_in,
    object_of,
    objects_in,
    prompt_with,
    random_tokens,
    read_header,
    store_of,
)
from kvbridge.connectors import fs
from kvbridge.connectors.fs import HEADER_BYTES, MAGIC, VERSION, FsOptions, FsSave, FsStore

from kvbridge import codec
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo, ScheduledRequest
from kvbridge.layout import LayoutFingerprint


# ---- chunks ----------------------------------------------------------------------------------------
def test_a_link_another_writer_makes_while_its_folder_is_made_again(tmp_path, monkeypatch):
    """A link's folder is gone (an eviction, another engine's clean-up) and, while this writer makes it
    again, another writer links the same block: this writer takes that link as it takes any existing
    one, never fails the save (it did once in CI, under test_concurrent_writers_of_the_same_chunk; the
    interleaving is forced here by a hook in ``Shelf.mkdir``: processes cannot be made to meet there)."""
    producer, _ = fs_pair(tmp_path / "store")
    store = store_of(producer)
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
    producer, consumer = fs_pair(tmp_path, num_blocks=160)
    try:
        tokens = random_tokens(64 * 16 + 3, seed=1)
        chunks = chunk_lengths_of(keys_of(tokens))
        assert sum(chunks) == 64 and 2 <= len(chunks) <= 12  # 16 blocks on average (crc32 of the key)
        sent = producer.prefill("a", tokens)
        assert sorted(len(read_header(p)[1]) for p in objects_in(tmp_path)) == sorted(chunks)  # one object per chunk
        assert len(links_in(tmp_path)) == 64 - len(chunks)  # a locator per block; a chunk's last is its object
        stats = []
        real = os.stat
        monkeypatch.setattr(os, "stat", lambda p, *a, **k: (stats.append(p), real(p, *a, **k))[1])
        assert index_of(consumer).contains_prefix(sent.keys) == 64
        assert len(stats) == len(chunks), stats
        stats.clear()
        # a chain asks which blocks a tier holds right after its lookup: what that lookup found costs no stat
        assert index_of(consumer).members(sent.keys[10:30]) == list(range(20)) and not stats
        other = sent.keys[:5] + [os.urandom(16) for _ in range(3)]  # a prompt that goes on elsewhere: stats again
        assert index_of(consumer).members(other) == [0, 1, 2, 3, 4] and stats
        stats.clear()
        assert index_of(consumer).contains_prefix(sent.keys[:40] + [os.urandom(16) for _ in range(24)]) == 40
        assert len(stats) <= len(chunks) + 2 + max(chunks).bit_length()  # whole chunks, then a bisection
        stats.clear()
        tail = sent.keys[21:]  # a prompt's tail (what a tier of a chain is asked about): the same chunks
        assert index_of(consumer).contains_prefix(tail) == 43 and len(stats) <= len(chunks)
        stats.clear()
        miss = [os.urandom(16) for _ in range(64)]
        assert index_of(consumer).contains_prefix(miss) == 0
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
    producer, consumer = fs_pair(tmp_path, num_blocks=128)
    try:
        tokens = prompt_with(40, lambda c: len(c) >= 2 and c[-1] >= 6)  # a last chunk of 6 blocks or more
        keys = keys_of(tokens)
        sent = producer.prefill("a", tokens)
        d = 40 - chunk_lengths_of(keys)[-1] + 3  # three blocks into the last chunk
        inside = tokens[: d * 16] + random_tokens(20 * 16 + 7, seed=3)
        got = consumer.prefill("b", inside)
        assert got.loaded_tokens == d * 16 and len(got.loaded_blocks) == d and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :d], sent.snapshot[:, :d])
        assert torch.equal(got.snapshot[:, d : d + 20], consumer.expected(got.keys[d : d + 20]))
        first = chunk_lengths_of(keys)[0]
        if first > 2:  # inside the first chunk too
            early = consumer.prefill("c", tokens[: (first - 1) * 16] + random_tokens(40, seed=4))
            assert early.loaded_tokens == (first - 1) * 16
            assert torch.equal(early.snapshot[:, : first - 1], sent.snapshot[:, : first - 1])
        short = consumer.prefill("d", tokens[: (d - 1) * 16 + 9])  # a shorter prompt, ending inside a chunk
        assert short.loaded_tokens == (d - 1) * 16 and torch.equal(short.snapshot[:, : d - 1], sent.snapshot[:, : d - 1])
    finally:
        producer.close()
        consumer.close()


def test_a_load_that_starts_inside_a_chunk(tmp_path):
    """An engine that already holds the first blocks (its own prefix cache) loads from the middle of a chunk."""
    producer, consumer = fs_pair(tmp_path, num_blocks=64)
    try:
        tokens = random_tokens(30 * 16 + 1, seed=5)
        sent = producer.prefill("a", tokens)
        ids = consumer.allocate(30)
        load = BlockLoad("r", tuple(ids[7:30]), tuple(sent.keys[7:30]))
        assert list(store_of(consumer).load(load, consumer.layout)) == []
        assert torch.equal(consumer.read(ids[7:30]), sent.snapshot[:, 7:30])
    finally:
        producer.close()
        consumer.close()


def test_saves_that_start_inside_a_chunk(tmp_path):
    """A chunked prefill: its first step saves 10 blocks (a partial chunk), the next 14 more. The second
    save rewrites the first chunk whole (its first 10 blocks read back from their object), so a lookup
    finds all 24 blocks with one stat per chunk."""
    producer, consumer = fs_pair(tmp_path, num_blocks=64)
    try:
        tokens = prompt_with(24, lambda c: c[0] > 10, seed=6)  # the first chunk goes on past block 10
        chunks = chunk_lengths_of(keys_of(tokens))
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
                assert [len(read_header(p)[1]) for p in objects_in(tmp_path)] == [10]
        assert sorted(len(read_header(p)[1]) for p in objects_in(tmp_path)) == sorted(chunks)  # the 10-block object was replaced
        assert index_of(consumer).contains_prefix(req.block_keys) == 24
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
    producer, consumer = fs_pair(tmp_path, num_blocks=64)
    try:
        tokens = prompt_with(30, lambda c: len(c) >= 2 and c[0] > 4, seed=12)
        keys = keys_of(tokens)
        first = chunk_lengths_of(keys)[0]
        ids = producer.allocate(30)
        producer.compute(ids, keys)
        store_of(producer).save(BlockSave("r", tuple(ids[2:]), tuple(keys[2:]), FsSave(None)), producer.layout)
        assert sorted(len(read_header(p)[1]) for p in objects_in(tmp_path)) == sorted(chunk_lengths_of(keys)[1:])
        assert index_of(consumer).contains_prefix(keys) == 0 and index_of(consumer).contains_prefix(keys[first:]) == 30 - first
    finally:
        producer.close()
        consumer.close()


def test_a_damaged_block_inside_an_object(tmp_path):
    """Block 3 of a 6-block object is damaged: blocks 0-2 load from that very object, 3-5 are recomputed;
    the object is deleted, and rewritten whole by the next producer."""
    producer, consumer = fs_pair(tmp_path)
    try:
        tokens = prompt_with(6, lambda c: c == [6], seed=7)  # one chunk
        sent = producer.prefill("a", tokens)
        (victim,) = objects_in(tmp_path)
        flip_byte(victim, block_offset(victim, 3) + 1000)
        got = consumer.prefill("b", tokens)
        assert got.loaded_blocks == got.block_ids[:3]
        assert got.failed_blocks == sorted(got.block_ids[3:6])
        assert torch.equal(got.snapshot[:, :3], sent.snapshot[:, :3])
        assert torch.equal(got.snapshot[:, :6], consumer.expected(got.keys)), "damaged bytes reached the KV"
        assert store_of(consumer).stats.corrupt == 1 and not victim.exists()
        producer.prefill("a2", tokens)
        again = consumer.prefill("c", tokens)
        assert again.failed_blocks == [] and len(again.loaded_blocks) == 6 and torch.equal(again.snapshot, sent.snapshot)
    finally:
        producer.close()
        consumer.close()


def test_locate_names_the_bytes_of_a_block(tmp_path):
    """``locate`` (for tools and fault injection): the object, offset and length of one block's bytes; flipping
    the last of them fails that block and the ones after it, never those before."""
    producer, consumer = fs_pair(tmp_path)
    try:
        tokens = prompt_with(4, lambda c: c == [4], seed=14)
        sent = producer.prefill("a", tokens)
        store = store_of(producer)
        path, offset, length = store.locate(sent.keys[1])  # type: ignore[misc]
        assert Path(path) == object_of(store, sent.keys[1]) and length == 4 * 2048 and offset == HEADER_BYTES + length
        assert store.locate(b"never stored") is None
        flip_byte(Path(path), offset + length - 1)
        got = consumer.prefill("b", tokens)
        assert got.loaded_blocks == got.block_ids[:1] and got.block_ids[1] in got.failed_blocks
    finally:
        producer.close()
        consumer.close()


# ---- damaged and foreign objects -----------------------------------------------------------------
def _rewrite(path: Path, *, fmt: codec.ChunkFormat = fs.FORMAT, fp: LayoutFingerprint | None = None, fill: int | None = None) -> None:
    """Rewrite an object with consistent checksums, so only the changed field can make it fail."""
    data = path.read_bytes()
    fixed, entries, fp_json = read_header(path)
    kind, header_len, payload = fixed[2], fixed[3], fixed[6]
    blocks = [data[header_len + i * payload : header_len + (i + 1) * payload] for i in range(len(entries))]
    if fill is not None:
        blocks = [bytes([fill]) * payload for _ in blocks]
    fingerprint = fp or LayoutFingerprint.from_json(fp_json)
    sums = [codec.checksum(kind, [b]) for b in blocks]
    path.write_bytes(fmt.pack([k for _, k in entries], fingerprint, sums, kind) + b"".join(blocks))


def _header_flip(path: Path) -> None:  # a key's byte: only the header's own checksum can tell
    data = bytearray(path.read_bytes())
    data[FIXED.size + FIXED.unpack_from(data)[5] + ENTRY.size] ^= 0x01
    path.write_bytes(bytes(data))


def _foreign_layout(path: Path) -> None:
    # a layout with other heads but the same bytes per block, and payloads of 0xAB
    fp = LayoutFingerprint.from_json(read_header(path)[2])
    other = LayoutFingerprint(fp.dtype, fp.num_layers, fp.num_kv_heads * 2, fp.head_size // 2, fp.block_size, fp.block_bytes, fp.kv_format)
    _rewrite(path, fp=other, fill=0xAB)


DAMAGE = {
    "bit_flip": (flip_payload, True),
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
    producer, consumer = fs_pair(tmp_path, chunk_tokens=16)  # a block per object: the object of block 2 only
    try:
        tokens = random_tokens(4 * 16 + 3, seed=1)
        sent = producer.prefill("a", tokens)
        victim = object_of(store_of(producer), sent.keys[2])
        spoil(victim)
        got = consumer.prefill("b", tokens)
        assert got.offered_tokens == 4 * 16  # lookup only stats: it cannot know
        assert got.loaded_blocks == got.block_ids[:2]
        assert got.failed_blocks == sorted(got.block_ids[2:4])  # the engine recomputes from the bad block on
        assert torch.equal(got.snapshot[:, :4], consumer.expected(got.keys)), "foreign bytes reached the KV"
        assert torch.equal(got.snapshot[:, :2], sent.snapshot[:, :2])
        assert store_of(consumer).stats.corrupt == 1
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
    producer, consumer = fs_pair(tmp_path)
    try:
        a = prompt_with(4, lambda c: c == [4], seed=8)
        b = prompt_with(4, lambda c: c == [4], seed=100)
        sent, other = producer.prefill("a", a), producer.prefill("b", b)
        link = Path(store_of(producer).path_of(sent.keys[1]))
        assert link.is_symlink()
        link.unlink()
        link.symlink_to(os.readlink(store_of(producer).path_of(other.keys[0])))  # to b's object
        ids = consumer.allocate(3)
        failed = store_of(consumer).load(BlockLoad("r", tuple(ids), tuple(sent.keys[1:4])), consumer.layout)  # starts at block 1
        assert list(failed) == ids and store_of(consumer).stats.corrupt == 1
        assert not link.exists() and not link.is_symlink() and object_of(store_of(producer), other.keys[0]).exists()  # only the bad link goes
        assert object_of(store_of(producer), sent.keys[0]).exists()
    finally:
        producer.close()
        consumer.close()


def test_what_a_locator_must_not_make_us_do(tmp_path):
    """A link planted to a file outside the store is not loadable, and that file is never deleted (only the
    link goes); a FIFO at a locator does not hang the load; a writer's leftover temporary link is swept."""
    producer, consumer = fs_pair(tmp_path / "store")
    try:
        tokens = random_tokens(2 * 16 + 1, seed=15)
        keys = keys_of(tokens)
        outside = tmp_path / "precious"
        outside.write_bytes(b"not a kvbridge object" * 300)
        first = Path(store_of(consumer).path_of(keys[0]))
        first.parent.mkdir(parents=True, exist_ok=True)  # made at start-up by the engines that write
        first.symlink_to(outside)
        ids = consumer.allocate(2)
        assert list(store_of(consumer).load(BlockLoad("r", tuple(ids), tuple(keys[:2])), consumer.layout)) == ids
        assert outside.exists() and not first.is_symlink()
        os.mkfifo(first)
        t0 = time.monotonic()
        assert list(store_of(consumer).load(BlockLoad("r", tuple(ids), tuple(keys[:2])), consumer.layout)) == ids
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
    producer, consumer = fs_pair(tmp_path)
    try:
        tokens = random_tokens(3 * 16 + 1, seed=9)
        req = producer.request("old", tokens)
        v1 = Path(store_of(producer).ns_dir) / "0"  # <root>/<namespace>/<rank>: where v1 put its objects
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
        assert got.offered_tokens == 0 and got.failed_blocks == [] and store_of(consumer).stats.corrupt == 0
        assert len(list(v1.glob("*/*"))) >= 3  # left alone
        sent = producer.prefill("new", tokens)  # today's objects beside them
        assert torch.equal(consumer.prefill("c", tokens).snapshot, sent.snapshot)
        store = FsStore(EngineInfo("e", 16, namespace=producer.info.namespace), FsOptions(path=str(tmp_path), capacity_bytes=1 << 30))
        assert len([p for p in store.shelf.scan() if "/v2-" not in p[2]]) == 3  # counted (and evictable) like any object
        store.close()
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
