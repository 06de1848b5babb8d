"""Producer and consumer engines of different tensor-parallel sizes over ucx (one-sided, cma on loopback).

Each rank of a :class:`~kvbridge.testing.MiniEngine` with ``tp > 1`` holds its heads of one KV cache, as
vLLM splits them; a consumer rank cuts its heads out of the producer ranks that hold them
(:func:`kvbridge.layout.reslice`). Every test compares the consumer's whole KV (all heads) with the
producer's, bit for bit, and checks the producer freed every rank's hold.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

from kvbridge.connectors.ucx import UcxBackend, UcxOptions, onesided  # noqa: E402

from kvbridge.errors import LayoutMismatch  # noqa: E402
from kvbridge.layout import KV_FIRST, MLA, Cut, LayoutFingerprint, reslice  # noqa: E402
from kvbridge.testing import MiniEngine  # noqa: E402

if not onesided.available()[0]:
    pytest.skip(f"re-slicing needs the one-sided lane: {onesided.available()[1]}", allow_module_level=True)


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def _pair(tmp_path: Path, p: int, c: int, **layout: object) -> tuple[MiniEngine, MiniEngine, UcxBackend]:
    options = UcxOptions(registry_dir=str(tmp_path / "reg"))
    consumer_backend = UcxBackend(options)
    producer = MiniEngine(UcxBackend(options), engine_id="p", role="producer", seed=1, tp=p, **layout)  # type: ignore[arg-type]
    consumer = MiniEngine(consumer_backend, engine_id="c", role="consumer", seed=2, tp=c, **layout)  # type: ignore[arg-type]
    return producer, consumer, consumer_backend


@pytest.mark.parametrize("p,c,heads", [(2, 1, 4), (1, 2, 4), (4, 2, 4), (2, 4, 4), (3, 2, 6), (2, 2, 4)])
def test_consumer_ranks_cut_their_heads_out_of_the_producer_ranks(tmp_path: Path, p: int, c: int, heads: int) -> None:
    producer, consumer, backend = _pair(tmp_path, p, c, num_kv_heads=heads, num_layers=3)
    try:
        tokens = _tokens(6 * 16 + 5, seed=p * 10 + c)
        sent = producer.prefill("r", tokens)
        got = consumer.prefill("r-c", tokens, sent.finish.transfer_params)
        assert got.loaded_tokens == 6 * 16 and got.failed_blocks == []
        assert torch.equal(got.snapshot[:, :6], sent.snapshot[:, :6]), "every head of every layer, bit for bit"
        assert torch.equal(got.snapshot[:, :6], consumer.expected(got.keys[:6]))
        assert backend.stats.resliced_loads == (c if p != c else 0)
        producer.wait_for(lambda _r: not producer.held, timeout=10)  # every producer rank was released
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("lane", ["cma", "ucp"])
def test_an_unsealed_read_is_confirmed_without_a_release(tmp_path: Path, lane: str) -> None:
    """The producer's workers have not learnt the hold yet (its engine took no step since the request
    ended), or the lane has no seal (ucp): each consumer rank asks its producer rank whether it still
    holds the hand-off, which changes nothing there; the scheduler's release frees it afterwards."""
    options = UcxOptions(registry_dir=str(tmp_path / "reg"), lane=lane)
    backend = UcxBackend(options)
    producer = MiniEngine(UcxBackend(options), engine_id="p", role="producer", seed=1, tp=1, num_kv_heads=4)
    consumer = MiniEngine(backend, engine_id="c", role="consumer", seed=2, tp=2, num_kv_heads=4)
    try:
        tokens = _tokens(5 * 16 + 3, seed=9)
        sent = producer.prefill("r", tokens, step_after=False)
        got = consumer.prefill("r-c", tokens, sent.finish.transfer_params)
        assert got.loaded_tokens == 5 * 16 and torch.equal(got.snapshot[:, :5], sent.snapshot[:, :5])
        assert backend.stats.resliced_loads == 2 and backend.stats.sealed_loads == 0
        producer.wait_for(lambda _r: not producer.held, timeout=10)
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("p,c", [(2, 1), (1, 3)])
def test_mla_ranks_read_one_whole_copy(tmp_path: Path, p: int, c: int) -> None:
    producer, consumer, backend = _pair(tmp_path, p, c, kv_format=MLA, head_size=64)
    try:
        tokens = _tokens(4 * 16 + 1, seed=7)
        sent = producer.prefill("r", tokens)
        got = consumer.prefill("r-c", tokens, sent.finish.transfer_params)
        assert got.loaded_tokens == 4 * 16
        for copy in consumer.copies:  # every consumer rank got the whole latent KV
            assert torch.equal(copy.gather(got.block_ids[:4]), sent.snapshot[:, :4])
        producer.wait_for(lambda _r: not producer.held, timeout=10)
    finally:
        producer.close()
        consumer.close()


def test_a_layout_that_cannot_be_re_sliced_is_recomputed_and_released(tmp_path: Path) -> None:
    """Heads that do not split over the other TP size: every block fails (the engine recomputes), and
    the producer still frees its holds."""
    producer, consumer, _ = _pair(tmp_path, 2, 1, num_kv_heads=4)
    other = MiniEngine(UcxBackend(UcxOptions(registry_dir=str(tmp_path / "reg"))), engine_id="c6", role="consumer",
                       seed=3, num_kv_heads=6, head_size=16)  # 6 heads: not the producer's 4
    try:
        tokens = _tokens(3 * 16 + 2, seed=8)
        sent = producer.prefill("r", tokens)
        got = other.prefill("r-c", tokens, sent.finish.transfer_params)
        assert got.loaded_blocks == [] and len(got.failed_blocks) == 3
        assert torch.equal(got.snapshot[:, :3], other.expected(got.keys[:3]))
        producer.wait_for(lambda _r: not producer.held, timeout=10)
    finally:
        producer.close()
        consumer.close()
        other.close()


FP = LayoutFingerprint("bfloat16", 2, 2, 16, 16, 2 * 16 * 32 * 2, "blocks_first")  # 2 heads per rank


def test_reslice_maps_heads_to_byte_ranges() -> None:
    head = FP.block_bytes // 2
    theirs, cuts = reslice(FP, rank=1, tp=2, their_tp=4)  # our heads 2, 3: ranks 2 and 3 hold one each
    assert theirs.num_kv_heads == 1 and theirs.block_bytes == head
    assert cuts == {2: Cut(0, 0, head), 3: Cut(0, head, head)}
    theirs, cuts = reslice(FP, rank=3, tp=4, their_tp=1)  # heads 6, 7 of the one rank's 8
    assert theirs.num_kv_heads == 8 and cuts == {0: Cut(6 * head, 0, 2 * head)}
    with pytest.raises(LayoutMismatch, match="do not split"):
        reslice(FP, rank=0, tp=3, their_tp=4)
    with pytest.raises(LayoutMismatch, match="kv_first"):
        reslice(LayoutFingerprint("bfloat16", 2, 2, 16, 16, 2048, KV_FIRST), rank=0, tp=1, their_tp=2)
