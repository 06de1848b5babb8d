import numpy as np
import pytest
import torch

from kvbridge.errors import LayoutError, LayoutMismatch
from kvbridge.layout import BLOCKS_FIRST, KV_FIRST, KVLayout, LayoutFingerprint, coalesce


def vllm_cache(layers=3, blocks=40, heads=8, block_size=16, head=32, dtype=torch.bfloat16):
    """A vLLM >= 0.26 shaped cache: one shared allocation, per-layer [B, H, N, 2D] views."""
    base = torch.empty(layers, blocks, heads, block_size, 2 * head, dtype=dtype)
    base.view(torch.uint8).copy_(torch.randint(0, 256, base.view(torch.uint8).shape, dtype=torch.uint8))
    return {f"layers.{i}": base[i] for i in range(layers)}


def test_coalesce_runs():
    assert coalesce([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert coalesce([]) == []
    assert coalesce(np.arange(7)) == [(0, 7)]


def test_vllm_shaped_cache_round_trips_scattered_blocks_bit_exact():
    src = vllm_cache()
    dst = vllm_cache()
    a, b = KVLayout.from_tensors(src, block_size=16), KVLayout.from_tensors(dst, block_size=16)
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint.kv_format == BLOCKS_FIRST
    assert a.fingerprint.block_bytes == 8 * 16 * 64 * 2
    rng = np.random.default_rng(0)
    ids = rng.choice(40, 17, replace=False)
    dst_ids = rng.choice(40, 17, replace=False)
    staging = a.gather(ids)
    b.scatter(dst_ids, staging)
    for name in src:
        assert torch.equal(dst[name][torch.as_tensor(dst_ids)].view(torch.uint8), src[name][torch.as_tensor(ids)].view(torch.uint8))


def test_scatter_leaves_other_blocks_alone():
    dst = vllm_cache()
    copy = {k: v.clone() for k, v in dst.items()}
    layout = KVLayout.from_tensors(dst)
    ids = [5, 6, 7, 20]
    layout.scatter(ids, torch.zeros(layout.num_layers, len(ids), layout.block_bytes, dtype=torch.uint8))
    keep = [i for i in range(40) if i not in ids]
    for name in dst:
        assert torch.equal(dst[name][keep].view(torch.uint8), copy[name][keep].view(torch.uint8))
        assert not dst[name][ids].view(torch.uint8).any()


def test_contiguous_run_uses_slices_and_matches_index_select():
    kv = vllm_cache()
    layout = KVLayout.from_tensors(kv)
    run = layout.gather([10, 11, 12, 13])  # one run: copied as a slice
    shuffled = layout.gather([12, 10, 13, 11])  # no run: index_select
    assert torch.equal(run[:, [2, 0, 3, 1]], shuffled)
    assert torch.equal(run[1].view(4, 8, 16, 128), kv["layers.1"][10:14].view(torch.uint8))


def test_old_kv_first_shape_round_trips():
    base = torch.randn(2, 2, 30, 16, 4, 8, dtype=torch.float16)  # layers, [2, B, N, H, D]
    kv = {f"l{i}": base[i] for i in range(2)}
    layout = KVLayout.from_tensors(kv, block_size=16)
    assert layout.fingerprint.kv_format == KV_FIRST
    assert layout.fingerprint.num_kv_heads == 4 and layout.fingerprint.head_size == 8
    out = torch.zeros_like(base)
    dst = KVLayout.from_tensors({f"l{i}": out[i] for i in range(2)})
    ids = [29, 3, 4, 17]
    dst.scatter(ids, layout.gather(ids))
    for i in range(2):
        assert torch.equal(out[i][:, ids], base[i][:, ids])
        assert not out[i][:, [0, 1, 2]].any()


def test_non_contiguous_views_are_addressed_through_strides():
    # a GPU-style permuted allocation: physical [B, L, H, N, 2D], logical per-layer [B, H, N, 2D]
    phys = torch.randn(12, 2, 2, 16, 8)
    kv = {f"l{i}": phys[:, i] for i in range(2)}
    layout = KVLayout.from_tensors(kv)
    staging = layout.gather([1, 7])
    assert torch.equal(staging[1].view(torch.float32).view(2, 2, 16, 8), phys[[1, 7], 1])
    with pytest.raises(LayoutError):
        layout.block_region(0, 0, 2)


def test_block_region_of_contiguous_layout():
    kv = vllm_cache()
    layout = KVLayout.from_tensors(kv)
    addr, n = layout.block_region(2, 4, 3)
    assert addr == kv["layers.2"][4].data_ptr() and n == 3 * layout.block_bytes


@pytest.mark.parametrize(
    "tensors,match",
    [
        ([], "no KV tensors"),
        ([torch.zeros(4, 4)], "cannot address"),
        ([torch.zeros(4, 2, 16, 7)], "2\\*head_size"),
        ([torch.zeros(4, 2, 16, 8), torch.zeros(4, 2, 16, 8, dtype=torch.float16)], "differs"),
        ([torch.zeros(0, 2, 16, 8)], "empty"),
    ],
)
def test_unaddressable_layouts_are_refused(tensors, match):
    with pytest.raises(LayoutError, match=match):
        KVLayout.from_tensors(tensors)


def test_shared_memory_between_layers_refused():
    t = torch.zeros(4, 2, 16, 8)
    with pytest.raises(LayoutError, match="share memory"):
        KVLayout.from_tensors({"a": t, "b": t})


def test_block_size_must_match():
    with pytest.raises(LayoutError, match="block_size"):
        KVLayout.from_tensors([torch.zeros(4, 2, 16, 8)], block_size=32)


def test_out_of_range_block_ids_refused():
    layout = KVLayout.from_tensors(vllm_cache())
    with pytest.raises(LayoutError, match="outside"):
        layout.gather([1, 40])
    with pytest.raises(LayoutError, match="outside"):
        layout.scatter([-1], torch.zeros(layout.num_layers, 1, layout.block_bytes, dtype=torch.uint8))


def test_wrong_staging_buffer_refused():
    layout = KVLayout.from_tensors(vllm_cache())
    with pytest.raises(LayoutError, match="staging"):
        layout.scatter([1, 2], torch.zeros(layout.num_layers, 3, layout.block_bytes, dtype=torch.uint8))


def test_fingerprint_round_trip_and_mismatch():
    fp = KVLayout.from_tensors(vllm_cache()).fingerprint
    assert LayoutFingerprint.from_json(fp.to_json()) == fp
    assert len(fp.digest()) == 16
    other = KVLayout.from_tensors(vllm_cache(head=64)).fingerprint
    with pytest.raises(LayoutMismatch, match="head_size"):
        fp.check(other)
    with pytest.raises(LayoutMismatch):
        LayoutFingerprint.from_json('{"dtype": "bfloat16"}')
    with pytest.raises(LayoutMismatch):
        LayoutFingerprint.from_json("not json")
