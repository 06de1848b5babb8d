"""The ``fs`` store: processes sharing a directory, damaged objects, full disks, vanished directories.

The conformance suite (tests/test_conformance.py -k fs) covers the contract; these cover what a
shared filesystem adds.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from kvbridge.connectors.fs import HEADER_BYTES, MAGIC, VERSION, FsOptions, FsStore

import kvbridge
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import ConfigError, StoreFull
from kvbridge.testing import MiniEngine

WORKER = Path(__file__).with_name("fs_worker.py")
FIXED = struct.Struct("<8sHHHHQI")  # the documented header: magic, version, checksum kind, key/fp/payload lengths, crc


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def _pair(root: Path, **options: object) -> tuple[MiniEngine, MiniEngine]:
    opts = {"path": str(root), **options}
    producer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="p", role="producer", seed=1)
    consumer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="c", role="consumer", seed=2)
    return producer, consumer


def _store(engine: MiniEngine) -> FsStore:
    store = engine.worker.io  # type: ignore[attr-defined]
    assert isinstance(store, FsStore)
    return store


def _objects(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _run(role: str, root: Path, out: Path, seed: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(WORKER.parent), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, str(WORKER), role, str(root), str(out), str(seed)], env=env, stderr=subprocess.PIPE)


def _wait(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-3000:]


# ---- options -------------------------------------------------------------------------------------
def test_options_are_checked_at_start_up(tmp_path):
    backend = kvbridge.create_backend("fs", {"path": str(tmp_path), "capacity_bytes": "1000", "fsync": "true"})
    assert backend.options == FsOptions(path=str(tmp_path), capacity_bytes=1000, fsync=True)
    with pytest.raises(ConfigError, match="path"):
        kvbridge.create_backend("fs", {})
    with pytest.raises(ConfigError, match="capacity_bytes"):
        kvbridge.create_backend("fs", {"path": str(tmp_path), "capacity_bytes": -1})
    with pytest.raises(ConfigError, match="capcity"):
        kvbridge.create_backend("fs", {"path": str(tmp_path), "capcity": 1})
    with pytest.raises(ConfigError, match="checksum"):
        kvbridge.create_backend("fs", {"path": str(tmp_path), "checksum": "md5"})


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
    assert not [p for p in _objects(root) if p.name.endswith(".tmp")]


# ---- damaged and foreign objects -----------------------------------------------------------------
def _rewrite(path: Path, *, magic: bytes = MAGIC, version: int = VERSION, fp: bytes | None = None, fill: int | None = None) -> None:
    """Rewrite an object with a consistent checksum, so only the changed field can make it fail."""
    data = path.read_bytes()
    _, _, kind, key_len, fp_len, length, _ = FIXED.unpack_from(data)
    key = data[FIXED.size : FIXED.size + key_len]
    fp = data[FIXED.size + key_len : FIXED.size + key_len + fp_len] if fp is None else fp
    payload = data[HEADER_BYTES:] if fill is None else bytes([fill]) * length
    header = FIXED.pack(magic, version, kind, key_len, len(fp), length, zlib.crc32(payload)) + key + fp
    path.write_bytes(header.ljust(HEADER_BYTES, b"\0") + payload)


def _bit_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 777] ^= 0x10
    path.write_bytes(bytes(data))


def _foreign_layout(path: Path) -> None:
    # the fingerprint of a layout with other heads but the same bytes per block, and a payload of 0xAB
    data = path.read_bytes()
    key_len, fp_len = FIXED.unpack_from(data)[3:5]
    ours = data[FIXED.size + key_len : FIXED.size + key_len + fp_len]
    _rewrite(path, fp=ours.replace(b'"head_size":16', b'"head_size":8').replace(b'"num_kv_heads":2', b'"num_kv_heads":4'), fill=0xAB)


DAMAGE = {
    "bit_flip": (_bit_flip, True),
    "truncated": (lambda p: os.truncate(p, HEADER_BYTES + 100), True),
    "too_long": (lambda p: p.write_bytes(p.read_bytes() + b"\0"), True),
    "bad_magic": (lambda p: _rewrite(p, magic=b"NOTKVBR!", fill=0xAB), True),
    "empty": (lambda p: os.truncate(p, 0), True),
    "foreign_version": (lambda p: _rewrite(p, version=VERSION + 1, fill=0xAB), False),
    "foreign_layout": (_foreign_layout, False),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_or_foreign_object_is_a_failed_block_never_loaded(tmp_path, damage):
    spoil, deleted = DAMAGE[damage]
    producer, consumer = _pair(tmp_path)
    try:
        tokens = _tokens(4 * 16 + 3, seed=1)
        sent = producer.prefill("a", tokens)
        victim = Path(_store(producer).path_of(sent.keys[2]))
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
        ids = producer.allocate(1)
        producer.compute(ids, [key])
        store.save(BlockSave("r", tuple(ids), (key,)), producer.layout)
        assert _objects(root) == [path]
        assert consumer.scheduler.index.contains_prefix([key, b"other"]) == 1  # type: ignore[attr-defined]
        dst = consumer.allocate(1)
        assert list(_store(consumer).load(BlockLoad("r", tuple(dst), (key,)), consumer.layout)) == []
        assert torch.equal(consumer.read(dst), producer.read(ids))
    finally:
        producer.close()
        consumer.close()


def test_engines_of_other_namespaces_or_ranks_do_not_meet(tmp_path):
    options = FsOptions(path=str(tmp_path))
    a = FsStore(EngineInfo("a", 16, namespace="llama"), options)
    b = FsStore(EngineInfo("b", 16, namespace="mistral"), options)
    c = FsStore(EngineInfo("c", 16, namespace="llama", rank=1, world_size=2), options)
    assert len({os.path.dirname(os.path.dirname(s.path_of(b"k"))) for s in (a, b, c)}) == 3


# ---- capacity, full disk, vanished directory ------------------------------------------------------
def test_capacity_evicts_the_oldest_objects(tmp_path):
    probe = MiniEngine(kvbridge.create_backend("memory", {"name": "fs-probe"}))
    size = HEADER_BYTES + probe.layout.num_layers * probe.layout.block_bytes
    probe.close()
    producer, consumer = _pair(tmp_path, capacity_bytes=10 * size)
    try:
        old = producer.prefill("old", _tokens(6 * 16, seed=1))
        new = producer.prefill("new", _tokens(6 * 16, seed=2))
        assert sum(p.stat().st_size for p in _objects(tmp_path)) <= 10 * size
        assert _store(producer).stats.evictions >= 2
        got = consumer.prefill("c-new", _tokens(6 * 16, seed=2))
        assert len(got.loaded_blocks) == 6 and torch.equal(got.snapshot, new.snapshot)
        assert consumer.scheduler.index.contains_prefix(old.keys) < 6  # type: ignore[attr-defined]  # the oldest went first
        with pytest.raises(StoreFull, match="capacity"):  # more than the whole capacity in one save
            _store(producer).save(BlockSave("big", tuple(range(11)), tuple(bytes([i]) for i in range(11))), producer.layout)
    finally:
        producer.close()
        consumer.close()


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
    layout = {"head_size": 64, "num_blocks": 128}  # 36 KiB objects: ~110 fit in 4 MiB
    opts = {"path": str(small_tmpfs / "store")}
    producer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="p", role="producer", seed=1, **layout)
    consumer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="c", role="consumer", seed=2, **layout)
    try:
        first = producer.prefill("first", _tokens(60 * 16, seed=1))
        assert _store(producer).stats.save_failures == 0
        producer.prefill("second", _tokens(100 * 16, seed=2))  # does not fit: the save fails, the request does not
        assert _store(producer).stats.save_failures == 1
        assert not [p for p in _objects(small_tmpfs) if p.name.endswith(".tmp")], "temp file left behind"
        got = consumer.prefill("c", _tokens(60 * 16, seed=1))  # nothing already stored was lost
        assert len(got.loaded_blocks) == 60 and torch.equal(got.snapshot, first.snapshot)
        partial = consumer.prefill("c2", _tokens(100 * 16, seed=2))  # what did fit loads exactly
        assert partial.failed_blocks == [] and torch.equal(partial.snapshot, consumer.expected(partial.keys))
        store = _store(producer)
        ids = producer.allocate(20)
        with pytest.raises(StoreFull):
            store.save(BlockSave("third", tuple(ids), tuple(bytes([7, i]) for i in range(20))), producer.layout)
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


@pytest.mark.parametrize("checksum", ["crc32", "crc32c"])
def test_checksum_kinds_round_trip_and_catch_a_flip(tmp_path, checksum):
    if checksum == "crc32c":
        pytest.importorskip("google_crc32c", reason="checksum='crc32c' needs google-crc32c")
    producer, consumer = _pair(tmp_path, checksum=checksum, fsync=True)
    try:
        tokens = _tokens(3 * 16 + 1, seed=9)
        sent = producer.prefill("a", tokens)
        assert torch.equal(consumer.prefill("b", tokens).snapshot, sent.snapshot)
        _bit_flip(Path(_store(producer).path_of(sent.keys[0])))
        got = consumer.prefill("c", tokens)
        assert got.loaded_blocks == [] and len(got.failed_blocks) == 3
        assert torch.equal(got.snapshot[:, :3], consumer.expected(got.keys)) and _store(consumer).stats.corrupt == 1
    finally:
        producer.close()
        consumer.close()
