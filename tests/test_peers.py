"""kvbridge.bench.peers: the request every peer row reads is the ucx case's, every row moves the right bytes
(or says why it cannot run here), and a row that moves wrong bytes fails loudly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.bench import _peer_child as child
from kvbridge.bench import peers
from kvbridge.bench.baselines import Unavailable
from kvbridge.bench.cases import BENCH
from kvbridge.bench.core import SHAPES, Point
from kvbridge.bench.measurer import Measurer
from kvbridge.layout import KVLayout

SMALL = Point(SHAPES["8b"], 32)  # 2 blocks x 32 layers = 64 descriptors of 64 KiB: 4 MiB


def test_request_is_the_llama8b_scattered_shape():
    s = peers.spec("cma", Point(SHAPES["8b"], 1024), 3)
    remote, local, lengths = child.descriptors(s, 1 << 40, 1 << 41)
    assert s["block_bytes"] == 64 << 10 and s["layers"] == 32 and len(s["src"]) == len(s["dst"]) == 64
    assert len(remote) == 2048 and set(lengths.tolist()) == {64 << 10} and int(lengths.sum()) == 128 << 20
    assert len(set(s["src"])) == 64 and sorted(s["src"]) != s["src"]  # distinct and scattered
    assert int(child.descriptors(peers.spec("cma", Point(SHAPES["8b"], 64), 3), 0, 0)[2].sum()) == 8 << 20
    one = peers.spec("ucp-get:tcp", Point(SHAPES["8b"], 1024), 3)
    assert child.descriptors(one, 1, 2)[2].tolist() == [128 << 20]


def test_descriptors_are_what_block_addressing_gives():
    """The same layer-major addresses kvbridge's one-sided lanes post for these block ids."""
    s = peers.spec("cma", SMALL, 1)
    shape = SMALL.shape
    base = torch.empty(shape.num_layers, s["num_blocks"], shape.num_kv_heads, SMALL.block_size, 2 * shape.head_size,
                       dtype=shape.dtype)  # fmt: skip
    layout = KVLayout.from_tensors({f"layer.{i}": base[i] for i in range(shape.num_layers)}, block_size=16)
    addressing = layout.addressing()
    remote, _, lengths = child.descriptors(s, base.data_ptr(), 0)
    assert remote.tolist() == addressing.addresses(np.asarray(s["src"])).tolist()
    assert lengths.tolist() == addressing.lengths(len(s["src"])).tolist()


def test_checker_fails_on_one_wrong_byte():
    s = peers.spec("cma", SMALL, 1)
    local = child.pattern(s).copy()  # holds every block at the producer's own ids
    s = {**s, "dst": s["src"]}
    child.checker(s, local)()
    local[s["src"][1] * s["block_bytes"] + 5] ^= 1  # layer 0, second moved block
    with pytest.raises(AssertionError, match="1 of 64 blocks differ"):
        child.checker(s, local)()


@pytest.mark.parametrize("name", list(peers.PEERS))
def test_peer_row_moves_the_right_bytes(name):
    why = peers.PEERS[name].missing()
    if why:
        pytest.skip(why)
    try:
        t = peers.measure(name, SMALL, 2, timeout_s=30)
    except Unavailable as exc:
        if "differ" in str(exc):
            raise
        pytest.skip(f"cannot run here: {exc}")
    assert len(t.samples) == 2 and all(v > 0 for v in t.samples) and t.note


def test_wrong_bytes_fail_the_row():
    s = peers.spec("cma", SMALL, 1)
    s["producer_seed"] = s["seed"] + 1  # the producer holds other bytes than the consumer expects
    with pytest.raises(Unavailable, match="blocks differ"):
        peers.run_spec(s)


def test_peers_are_baselines_of_ucx_and_missing_ones_say_why(monkeypatch):
    assert set(peers.UCX_PEERS) <= set(BENCH["ucx"].baselines)
    monkeypatch.setattr(peers.Peer, "missing", lambda self: "not installed here")
    base = Measurer(1).baseline("nixl:tcp", SMALL, "transfer", {})
    assert base == "baseline nixl:tcp not measured: not installed here"


def test_ctypes_fallback_reads_merged_descriptors():
    """The cma row's fallback without kvbridge._core: process_vm_readv of this process, adjacent runs merged."""
    import os

    src = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    blocks = np.array([3, 4, 5, 0, 9, 2], dtype=np.uint64)  # 3-4-5 merge into one iovec
    remote = np.uint64(src.ctypes.data) + blocks * np.uint64(4096)
    local = np.uint64(dst.ctypes.data) + np.arange(6, dtype=np.uint64) * np.uint64(4096)
    child._ctypes_pvr(os.getpid(), remote, local, np.full(6, 4096, dtype=np.uint64))()
    want = np.concatenate([src[int(b) * 4096 : (int(b) + 1) * 4096] for b in blocks])
    assert np.array_equal(dst[: 6 * 4096], want)
