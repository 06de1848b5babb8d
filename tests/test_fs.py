"""The ``fs`` store: its options, processes sharing a directory, keys that must not escape it, engines that
must not meet, and a directory that fills up or vanishes.

The conformance suite (tests/test_conformance.py -k fs) covers the contract; these and tests/test_fs_objects.py
and tests/test_fs_moves.py cover what a shared filesystem adds. Shared helpers: tests/helpers/fskit.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fskit import (
    fs_pair,
    index_of,
    links_in,
    objects_in,
    prompt_with,
    random_tokens,
    store_of,
)
from kvbridge.connectors import fs
from kvbridge.connectors.fs import HEADER_BYTES, FsOptions, FsStore

import kvbridge
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import ConfigError, StoreFull
from kvbridge.testing import MiniEngine

WORKER = Path(__file__).parent / "helpers" / "fs_worker.py"


def _run(role: str, root: Path, out: Path, seed: int, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(WORKER.parent), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, str(WORKER), role, str(root), str(out), str(seed), *extra], env=env, stderr=subprocess.PIPE)


def _wait(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-3000:]



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
    assert len(objects_in(root)) <= 2  # one object per chunk, whoever renamed last



# ---- keys, paths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key", [b"../../../etc/passwd", b"/abs/path", b"", b"\0" * 3, b"a/../../b" * 40, bytes(range(256))])
def test_keys_cannot_escape_the_directory(tmp_path, key):
    root = tmp_path / "store"
    producer, consumer = fs_pair(root)
    try:
        store = store_of(producer)
        path = Path(store.path_of(key))
        assert path.resolve().is_relative_to(root.resolve())
        assert set(path.name) <= set("0123456789abcdefh") and len(path.name) <= 65
        ids = producer.allocate(2)
        producer.compute(ids, [b"first", key])
        store.save(BlockSave("r", tuple(ids), (b"first", key)), producer.layout)
        assert Path(os.path.realpath(path)) in objects_in(root) and len(objects_in(root)) <= 2
        assert all(p.resolve().is_relative_to(root.resolve()) for p in root.rglob("*"))
        assert consumer.scheduler.index.contains_prefix([b"first", key, b"other"]) == 2  # type: ignore[attr-defined]
        dst = consumer.allocate(2)
        assert list(store_of(consumer).load(BlockLoad("r", tuple(dst), (b"first", key)), consumer.layout)) == []
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
    producer, consumer = fs_pair(tmp_path, capacity_bytes=10 * size, chunk_tokens=16)
    try:
        old = producer.prefill("old", random_tokens(6 * 16, seed=1))
        new = producer.prefill("new", random_tokens(6 * 16, seed=2))
        assert sum(p.stat().st_size for p in objects_in(tmp_path)) <= 10 * size
        assert store_of(producer).stats.evictions >= 2
        got = consumer.prefill("c-new", random_tokens(6 * 16, seed=2))
        assert len(got.loaded_blocks) == 6 and torch.equal(got.snapshot, new.snapshot)
        assert consumer.scheduler.index.contains_prefix(old.keys) < 6  # type: ignore[attr-defined]  # the oldest went first
        store = store_of(producer)
        list(store.shelf.scan())
        assert all(p.exists() for p in links_in(tmp_path))  # scans remove the links left pointing nowhere
        with pytest.raises(StoreFull, match="capacity"):  # more than the whole capacity in one save
            store.save(BlockSave("big", tuple(range(11)), tuple(bytes([i]) for i in range(11))), producer.layout)
    finally:
        producer.close()
        consumer.close()


def test_scans_remove_links_to_evicted_objects(tmp_path):
    producer = MiniEngine(kvbridge.create_backend("fs", {"path": str(tmp_path)}), engine_id="p", role="producer")
    try:
        sent = producer.prefill("a", prompt_with(5, lambda c: c == [5], seed=13))
        (obj,) = objects_in(tmp_path)
        assert len(links_in(tmp_path)) == 4
        obj.unlink()  # as another process's eviction would
        store = FsStore(EngineInfo("e", 16, namespace="mini"), FsOptions(path=str(tmp_path), capacity_bytes=1 << 20))
        assert list(store.shelf.scan()) == [] and links_in(tmp_path) == []
        assert index_of(producer).contains_prefix(sent.keys) == 0
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
        first = producer.prefill("first", random_tokens(60 * 16, seed=1))
        assert store_of(producer).stats.save_failures == 0
        producer.prefill("second", random_tokens(100 * 16, seed=2))  # does not fit: the save fails, the request does not
        assert store_of(producer).stats.save_failures == 1
        assert not [p for p in small_tmpfs.rglob("*") if p.name.endswith(".tmp")], "temp file left behind"
        got = consumer.prefill("c", random_tokens(60 * 16, seed=1))  # nothing already stored was lost
        assert len(got.loaded_blocks) == 60 and torch.equal(got.snapshot, first.snapshot)
        partial = consumer.prefill("c2", random_tokens(100 * 16, seed=2))  # the chunks that did fit load exactly
        assert partial.failed_blocks == []
        assert torch.equal(partial.snapshot, consumer.expected(partial.keys))
        store = store_of(producer)
        ids = producer.allocate(120)  # more than the room left, whichever chunks the failed save freed
        with pytest.raises(StoreFull):
            store.save(BlockSave("third", tuple(ids), tuple(bytes([7, i]) for i in range(120))), producer.layout)
        assert not [p for p in small_tmpfs.rglob("*") if p.name.endswith(".tmp")]
    finally:
        producer.close()
        consumer.close()


def test_directory_removed_mid_run(tmp_path):
    root = tmp_path / "store"
    producer, consumer = fs_pair(root)
    try:
        tokens = random_tokens(4 * 16 + 1, seed=3)
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


