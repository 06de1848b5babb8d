"""kvbridge bench's ``lmcache-native`` case: LMCache's own engine saves and loads the bench's KV on its CPU and
disk tiers, every rep checked byte for byte; a byte changed inside LMCache's storage fails the case."""

from __future__ import annotations

import importlib.util
import multiprocessing

import pytest
import torch

from kvbridge.bench.core import Point, Shape

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lmcache") is None, reason="LMCache is not installed")

# two layers, two KV heads, 3 blocks of 16 scattered over the pool, two requests: small, but every axis > 1
POINT = Point(Shape("t", 2, 2, 64), 48, 16, "scattered", 2)


@pytest.fixture(scope="module")
def native():
    pytest.importorskip("lmcache", reason="LMCache does not import here")
    from kvbridge.bench import lmcache_native

    return lmcache_native


def test_both_tiers_round_trip(native):
    start = multiprocessing.get_start_method(allow_none=True)
    got = native.run(POINT, 1)  # raises on any byte that differs
    assert set(got) == {(row, op) for row in native.ROWS for op in native.OPS}
    for timing in got.values():
        assert len(timing.samples) == 1 and timing.median > 0
    assert multiprocessing.get_start_method(allow_none=True) == start  # LMCache's engine forces "spawn"; put back


def _flip_cpu(tier) -> None:
    """One byte of the last chunk, changed in LMCache's CPU arena (the object the retrieve will read)."""
    obj = tier.engine.storage_manager.get(tier.keys[-1])
    try:
        flat = obj.tensor.view(-1).view(torch.uint8)
        flat[flat.numel() // 2] ^= 0x01
    finally:
        obj.ref_count_down()


def _flip_disk(tier) -> None:
    """One byte in the middle of each of LMCache's disk files."""
    files = [p for p in tier.disk.rglob("*") if p.is_file()]
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("tier, flip", [("cpu", _flip_cpu), ("disk", _flip_disk)])
def test_a_changed_byte_fails_the_case(native, tier, flip):
    with pytest.raises(native.Mismatch, match="differ"):
        native.measure(POINT, 1, tier, after_save=flip)


def test_a_lost_chunk_fails_the_case(native):
    def lose(tier) -> None:
        tier.engine.storage_manager.batched_remove(tier.keys[-1:])

    with pytest.raises(RuntimeError, match="retrieved"):
        native.measure(POINT, 1, "cpu", after_save=lose)
