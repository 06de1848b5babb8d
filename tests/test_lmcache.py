"""The ``lmcache`` backend against a real LMCache ``lm://`` server on loopback.

Producer and consumer use different options (CPU arena sizes), hence different LMCache managers, so
every consumer read crosses the server as it would between two processes. Each test uses its own
``model_name``: the server keeps everything it is given for as long as it runs.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

if importlib.util.find_spec("lmcache") is None:
    pytest.skip("lmcache is not installed: pip install 'kvbridge[lmcache]'", allow_module_level=True)

from kvbridge.connectors import lmcache as lmc  # noqa: E402

from kvbridge import registry  # noqa: E402
from kvbridge.contract import BlockLoad, EngineInfo  # noqa: E402
from kvbridge.errors import ConfigError  # noqa: E402
from kvbridge.layout import KVLayout  # noqa: E402
from kvbridge.testing import MiniEngine  # noqa: E402
from kvbridge.testing.lmcache_server import serving, start_server, stop  # noqa: E402

_names = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving() as url:
        yield url


def _backend(url: str, model: str, *, arena_mib: int = 16, **extra: Any) -> lmc.LMCacheBackend:
    backend = registry.create("lmcache", {"remote_url": url, "local_cpu_bytes": arena_mib << 20, "model_name": model, **extra})
    assert isinstance(backend, lmc.LMCacheBackend)
    return backend


def _pair(url: str, **layout: Any) -> tuple[MiniEngine, MiniEngine]:
    """A producer and a consumer with separate LMCache managers, sharing only the server."""
    model = f"t{next(_names)}"
    producer = MiniEngine(_backend(url, model, arena_mib=16), engine_id="p", role="producer", seed=1, **layout)
    consumer = MiniEngine(_backend(url, model, arena_mib=24), engine_id="c", role="consumer", seed=2, **layout)
    assert producer.worker.io.storage_manager is not consumer.worker.io.storage_manager
    return producer, consumer


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def _close(*engines: MiniEngine) -> None:
    for engine in engines:
        engine.close()


# -- options -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [
        {"model_name": "a@b"},
        {"model_name": "x" * 41},
        {"remote_url": "127.0.0.1:65432"},
        {"local_disk": "/tmp/x"},
        {"local_disk_bytes": 1 << 20},
        {"local_cpu_bytes": 1024},
        {"timeout_s": 0},
        {"remote_urll": "lm://h:1"},
    ],
)
def test_bad_options_fail_at_start_up(options):
    with pytest.raises(ConfigError):
        registry.create("lmcache", options)


def test_options_parse_from_strings():
    backend = registry.create("lmcache", {"local_cpu_bytes": "2097152", "cpu_cache": "false", "timeout_s": "2.5"})
    assert backend.options == lmc.LMCacheOptions(local_cpu_bytes=2 << 20, cpu_cache=False, timeout_s=2.5)


def test_missing_lmcache_is_reported_with_the_install_line():
    code = (
        "import importlib.util as u; real = u.find_spec; "
        "u.find_spec = lambda n, *a: None if n == 'lmcache' else real(n, *a); "
        "from kvbridge import registry; print(registry.check('lmcache'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'kvbridge[lmcache]'" in out.stdout, out.stderr


# -- through the lm:// server --------------------------------------------------------------------------
def test_round_trip_through_server_is_bit_exact(server):
    producer, consumer = _pair(server)
    try:
        tokens = _tokens(5 * 16 + 3, seed=1)
        sent = producer.prefill("a", tokens)
        got = consumer.prefill("b", tokens)
        assert got.loaded_tokens == 5 * 16 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :5], sent.snapshot[:, :5])
        assert torch.equal(got.snapshot[:, :5], consumer.expected(got.keys[:5]))
        assert consumer.worker.io.stats.load_blocks == 5
    finally:
        _close(producer, consumer)


def test_partial_prefix_and_miss(server):
    producer, consumer = _pair(server)
    try:
        tokens = _tokens(6 * 16, seed=2)
        sent = producer.prefill("a", tokens)
        got = consumer.prefill("b", tokens[: 2 * 16] + _tokens(4 * 16 + 1, seed=3))
        assert got.loaded_tokens == 2 * 16 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :2], sent.snapshot[:, :2])
        assert torch.equal(got.snapshot[:, 2:6], consumer.expected(got.keys[2:6]))
        miss = consumer.prefill("c", _tokens(3 * 16, seed=4))
        assert miss.loaded_tokens == 0 and miss.failed_blocks == []
    finally:
        _close(producer, consumer)


def test_foreign_layout_is_refused(server):
    model = f"t{next(_names)}"
    producer = MiniEngine(_backend(server, model, arena_mib=16), engine_id="p", role="producer", head_size=16)
    consumer = MiniEngine(_backend(server, model, arena_mib=24), engine_id="c", role="consumer", head_size=32)
    try:
        tokens = _tokens(3 * 16 + 1, seed=5)
        producer.prefill("a", tokens)
        got = consumer.prefill("b", tokens)
        assert got.loaded_blocks == [] and len(got.failed_blocks) == 3
        assert torch.equal(got.snapshot[:, :3], consumer.expected(got.keys[:3]))
        assert consumer.worker.io.stats.corrupt == 1
    finally:
        _close(producer, consumer)


def _raw(store: lmc.LMCacheStore, obj_key: Any) -> torch.Tensor:
    sm = store.storage_manager
    (obj,) = sm.batched_get([obj_key], location="RemoteBackend")
    try:
        return obj.tensor.view(-1).clone()
    finally:
        obj.ref_count_down()


def _raw_put(store: lmc.LMCacheStore, obj_key: Any, data: torch.Tensor) -> None:
    from lmcache.v1.memory_management import MemoryFormat

    sm = store.storage_manager
    obj = sm.allocate(torch.Size([1, 1, 1, data.numel()]), torch.uint8, fmt=MemoryFormat.KV_2LTD, busy_loop=False)
    obj.tensor.view(-1).copy_(data)
    sm.batched_put([obj_key], [obj], location="RemoteBackend")
    while sm.storage_backends["RemoteBackend"].exists_in_put_tasks(obj_key):
        time.sleep(0.001)
    # the lm:// put is not acknowledged: a lookup on the same connection returns once the server took it
    # (without it the consumer, on its own connection, may read the old object first)
    assert sm.contains(obj_key, search_range=["RemoteBackend"]) is not None


@pytest.mark.parametrize("damage", ["payload_bit", "magic", "truncated", "header_key", "another_key"])
def test_damaged_objects_are_failed_blocks(server, damage):
    """Block 1's object is damaged in the server: a flipped bit in block 1's own bytes fails block 1 on (the
    blocks before it load, from the same object); damage to the object itself fails all of its blocks."""
    producer, consumer = _pair(server)
    try:
        tokens = _tokens(4 * 16 + 1, seed=6)
        sent = producer.prefill("a", tokens)
        store = producer.worker.io
        obj_key, offset, length = store.locate(sent.keys[1])
        first = next(a for a, b in store._pieces(sent.keys) if a <= 1 < b)  # block 1's object starts here
        raw = _raw(store, obj_key)
        if damage == "payload_bit":
            raw[offset + 7] ^= 1
        elif damage == "magic":
            raw[0] ^= 1
        elif damage == "truncated":
            raw = raw[:-8]
        elif damage == "header_key":  # the first key's first byte in the header (the header's own checksum catches it)
            fp_len = int.from_bytes(raw[18:20].numpy().tobytes(), "little")
            raw[lmc.FORMAT.fixed.size + fp_len + 6] ^= 1
        else:  # another object's bytes under block 1's object key
            raw = _raw(store, store.lmcache_key(sent.keys[0])) if first > 0 else _other_object(store, raw)
        _raw_put(store, obj_key, raw)
        got = consumer.prefill("b", tokens)
        good = 1 if damage == "payload_bit" else first
        assert got.loaded_blocks == got.block_ids[:good]
        assert got.failed_blocks == sorted(got.block_ids[good:4])
        assert torch.equal(got.snapshot[:, :4], consumer.expected(got.keys[:4]))  # recomputed, never the damage
        assert consumer.worker.io.stats.corrupt == 1
    finally:
        _close(producer, consumer)


def _other_object(store: lmc.LMCacheStore, raw: torch.Tensor) -> torch.Tensor:
    """``raw`` with its last key in the header changed and the header checksum made right again: a well-formed
    object of another key."""
    arr = raw.numpy().copy()
    length = lmc.FORMAT.header_bytes(arr, arr.size)
    chunk = lmc.FORMAT.parse(arr[:length], fingerprint=store._views[0].fingerprint, size=arr.size)
    keys = [*chunk.keys[:-1], bytes(len(chunk.keys[-1]))]
    header = lmc.FORMAT.pack(keys, store._views[0].fingerprint, chunk.checksums, chunk.kind)
    assert len(header) == length
    arr[:length] = np.frombuffer(header, dtype=np.uint8)
    return torch.from_numpy(arr)


def test_server_killed_mid_run_means_misses_and_failed_blocks_not_hangs():
    proc, url = start_server()
    producer, consumer = _pair(url)
    try:
        tokens = _tokens(3 * 16 + 1, seed=7)
        sent = producer.prefill("a", tokens)
        request = consumer.request("probe", tokens)
        assert consumer.scheduler.lookup(request, 0).num_tokens == 3 * 16
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        failed = consumer.worker.io.load(BlockLoad("x", (1, 2, 3), tuple(sent.keys[:3])), consumer.layout)
        assert list(failed) == [1, 2, 3]
        got = consumer.prefill("b", tokens)
        assert got.loaded_tokens == 0
        assert torch.equal(got.snapshot[:, :3], consumer.expected(got.keys[:3]))
        again = producer.prefill("c", _tokens(2 * 16 + 1, seed=8))  # a save with the server gone fails, counted
        assert again.loaded_tokens == 0
        assert producer.worker.io.stats.save_failures == 1
        assert time.monotonic() - t0 < 10
    finally:
        _close(producer, consumer)
        stop(proc)


def test_full_arena_skips_the_save_and_never_waits():
    from lmcache.v1.memory_management import MemoryFormat

    backend = registry.create("lmcache", {"local_cpu_bytes": 1 << 20, "cpu_cache": False, "model_name": "full"})
    engine = MiniEngine(backend, role="both")
    held = []
    try:
        sm = engine.worker.io.storage_manager
        while (obj := sm.allocate(torch.Size([1, 1, 1, 64 << 10]), torch.uint8, fmt=MemoryFormat.KV_2LTD, busy_loop=False)) is not None:
            held.append(obj)  # readers that never let go: nothing is evictable
        t0 = time.monotonic()
        engine.prefill("a", _tokens(2 * 16 + 1, seed=9))
        assert time.monotonic() - t0 < 5
        assert engine.worker.io.stats.save_failures == 1
    finally:
        for obj in held:
            obj.ref_count_down()
        engine.close()


def test_arena_smaller_than_a_block_is_refused():
    backend = registry.create("lmcache", {"local_cpu_bytes": 1 << 20, "model_name": "small"})
    layout = KVLayout.from_tensors([torch.zeros(2, 8, 16, 256, dtype=torch.bfloat16) for _ in range(64)])  # 4 MiB blocks
    worker = backend.worker(EngineInfo("small", 16))
    try:
        with pytest.raises(ConfigError, match="local_cpu_bytes"):
            worker.register(layout)
    finally:
        worker.close()


def test_lmcache_as_a_tier_of_chain(server):
    model = f"t{next(_names)}"

    def chain(arena_mib: int) -> Any:
        lm = {"backend": "lmcache", "remote_url": server, "local_cpu_bytes": arena_mib << 20, "model_name": model}
        return registry.create("chain", {"tiers": [{"backend": "cpu", "capacity_bytes": 16 << 20}, lm]})

    producer = MiniEngine(chain(16), engine_id="p", role="producer", seed=1)
    consumer = MiniEngine(chain(24), engine_id="c", role="consumer", seed=2)
    try:
        tokens = _tokens(4 * 16 + 5, seed=10)
        sent = producer.prefill("a", tokens)
        got = consumer.prefill("b", tokens)  # the consumer's cpu tier is empty: every block crosses the server
        assert got.loaded_tokens == 4 * 16 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :4], sent.snapshot[:, :4])
        assert consumer.worker.io.stats.promoted_blocks == 4
    finally:
        _close(producer, consumer)


@pytest.mark.timeout(120)  # before the fix this hung for ever inside LMCache
def test_a_load_larger_than_the_arena_completes(tmp_path):
    """LMCache waits forever for arena room when a batched read does not fit: loads must batch under it."""
    options = lmc.LMCacheOptions(
        local_cpu_bytes=1 << 20, cpu_cache=False, local_disk=str(tmp_path / "d"), local_disk_bytes=64 << 20, model_name="big",
        chunk_tokens=16,  # an object per block: two of them must fit the arena
    )
    layout = dict(num_layers=4, num_kv_heads=8, head_size=128, num_blocks=32)  # 256 KiB per block: 3 fit the arena
    engine = MiniEngine(lmc.LMCacheBackend(options), engine_id="e", **layout)
    try:
        tokens = np.random.default_rng(7).integers(0, 32000, 8 * 16 + 3).tolist()
        for start in range(0, 8 * 16, 32):  # saved a step at a time: each save fits the arena
            engine.prefill(f"w{start}", tokens[: start + 32])
        t0 = time.monotonic()
        got = engine.prefill("r", tokens, timeout=60)
        assert time.monotonic() - t0 < 60
        assert got.loaded_tokens == 8 * 16 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :8], engine.expected(got.keys[:8]))
    finally:
        engine.close()
