"""Conformance: blocks arrive bit-exact, in every layout, hit by hit and miss by miss, for requests at once;
another layout's blocks are refused, and asking twice changes nothing."""

from __future__ import annotations

import pytest
import torch

from kvbridge.layout import BLOCKS_FIRST, KV_FIRST, MLA
from kvbridge.testing.engine import MiniEngine
from kvbridge.testing.suite.support import (
    assert_recomputed,
    close_engines,
    engine_pair,
    pump_until,
    random_tokens,
    settle,
)

# Every KV layout vLLM allocates: heads-major blocks, K/V-first (older vLLM), MLA's latent cache, and
# fp8 KV as vLLM keeps it (uint8 tensors the engine declares fp8) or as torch's float8 dtypes.
LAYOUTS = {
    "blocks_first-bf16": dict(kv_format=BLOCKS_FIRST, dtype=torch.bfloat16),
    "blocks_first-fp32": dict(kv_format=BLOCKS_FIRST, dtype=torch.float32),
    "blocks_first-fp8_e4m3": dict(kv_format=BLOCKS_FIRST, dtype=torch.uint8, kv_dtype="fp8_e4m3"),
    "kv_first-fp16": dict(kv_format=KV_FIRST, dtype=torch.float16),
    "kv_first-float8_e5m2": dict(kv_format=KV_FIRST, dtype=torch.float8_e5m2),
    "mla-bf16": dict(kv_format=MLA, dtype=torch.bfloat16, head_size=72),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_round_trip_is_bit_exact(conformance_backend, layout):
    """Scattered blocks of every layer arrive exactly as they left, in every layout."""
    _, target = conformance_backend
    producer, consumer = engine_pair(target, **layout)
    try:
        tokens = random_tokens(5 * 16 + 8, seed=1)  # 5 full blocks and a partial one
        sent = producer.prefill("req-a", tokens)
        got = consumer.prefill("req-b", tokens, sent.finish.transfer_params)
        assert got.loaded_tokens == 5 * 16
        assert got.failed_blocks == []
        assert len(got.loaded_blocks) == 5
        assert torch.equal(got.snapshot[:, :5], sent.snapshot[:, :5])
        assert torch.equal(got.snapshot[:, :5], consumer.expected(got.keys[:5]))
        settle(producer)
    finally:
        close_engines(producer, consumer)


def test_whole_prompt_hit_leaves_one_token_to_compute(conformance_backend):
    _, target = conformance_backend
    producer, consumer = engine_pair(target)
    try:
        tokens = random_tokens(4 * 16, seed=2)
        sent = producer.prefill("req-a", tokens)
        got = consumer.prefill("req-b", tokens, sent.finish.transfer_params)
        assert got.loaded_tokens == 4 * 16 - 1
        assert torch.equal(got.snapshot, sent.snapshot)
        settle(producer)
    finally:
        close_engines(producer, consumer)


def test_miss_is_a_miss_not_an_error(conformance_backend):
    _, target = conformance_backend
    producer, consumer = engine_pair(target)
    try:
        got = consumer.prefill("req-x", random_tokens(3 * 16, seed=3))
        assert got.loaded_tokens == 0
        assert got.failed_blocks == []
        assert torch.equal(got.snapshot, consumer.expected(got.keys))
    finally:
        close_engines(producer, consumer)


def test_partial_prefix_hit(conformance_backend):
    name, target = conformance_backend
    if target.producer.kind != "store":
        pytest.skip(f"{name} is a peer backend: a consumer fetches exactly the blocks the producer names")
    producer, consumer = engine_pair(target)
    try:
        tokens = random_tokens(6 * 16, seed=4)
        sent = producer.prefill("req-a", tokens)
        other = tokens[: 3 * 16] + random_tokens(3 * 16 + 5, seed=5)
        got = consumer.prefill("req-b", other)
        assert got.loaded_tokens == 3 * 16
        assert torch.equal(got.snapshot[:, :3], sent.snapshot[:, :3])
        assert torch.equal(got.snapshot[:, 3:6], consumer.expected(got.keys[3:6]))
    finally:
        close_engines(producer, consumer)


# Pairs of layouts whose blocks are the same number of bytes but do not mean the same thing.
MISMATCHES = {
    "head_size": (dict(head_size=16, num_kv_heads=4), dict(head_size=32, num_kv_heads=2)),
    "fp8-flavour": (dict(dtype=torch.uint8, kv_dtype="fp8_e4m3"), dict(dtype=torch.uint8, kv_dtype="fp8_e5m2")),
    "mla-vs-heads": (dict(kv_format=MLA, head_size=64), dict(kv_format=BLOCKS_FIRST, num_kv_heads=2, head_size=16)),
}


@pytest.mark.parametrize("ours,theirs", MISMATCHES.values(), ids=MISMATCHES.keys())
def test_layout_mismatch_is_refused(conformance_backend, ours, theirs):
    """A consumer whose KV layout differs never loads the producer's bytes, even where a block is as long."""
    name, target = conformance_backend
    if target.consumer is None:
        pytest.skip(f"{name} serves one engine: its blocks cannot meet another layout")
    producer = MiniEngine(target.producer, engine_id="producer", role="producer", **ours)
    consumer = MiniEngine(target.consumer, engine_id="consumer", role="consumer", **theirs)
    assert producer.layout.block_bytes == consumer.layout.block_bytes
    try:
        tokens = random_tokens(4 * 16 + 3, seed=6)
        sent = producer.prefill("req-a", tokens)
        got = consumer.prefill("req-b", tokens, sent.finish.transfer_params)
        assert got.loaded_blocks == []
        assert got.loaded_tokens == 0
        assert torch.equal(got.snapshot[:, :4], consumer.expected(got.keys[:4]))
        settle(producer)
    finally:
        close_engines(producer, consumer)


def test_concurrent_requests_do_not_mix(conformance_backend):
    _, target = conformance_backend
    producer, consumer = engine_pair(target, num_blocks=128)
    try:
        prompts = {f"req-{i}": random_tokens(16 * (1 + i % 3) + 7, seed=100 + i) for i in range(8)}
        sent = {r.request_id: r for r in producer.prefill_many([(rid, t, None) for rid, t in prompts.items()])}
        got = consumer.prefill_many(
            [(f"{rid}-c", t, sent[rid].finish.transfer_params) for rid, t in prompts.items()]
        )
        for result in got:
            origin = sent[result.request_id.removesuffix("-c")]
            n = len(origin.keys)
            assert result.failed_blocks == []
            assert len(result.loaded_blocks) == n
            assert torch.equal(result.snapshot[:, :n], origin.snapshot[:, :n])
        settle(producer)
    finally:
        close_engines(producer, consumer)


def test_concurrent_requests_sharing_a_prefix(conformance_backend):
    """Requests that share their first blocks, saved in one step and loaded in one plan, each get their own
    blocks bit-exact: the shared prefix (saved twice, read twice at once) and their own tails."""
    _, target = conformance_backend
    producer, consumer = engine_pair(target, num_blocks=128)
    try:
        base = random_tokens(3 * 16, seed=30)
        prompts = {
            "long": base + random_tokens(2 * 16 + 5, seed=31),
            "short": base + random_tokens(9, seed=32),
            "inside": base[: 2 * 16] + random_tokens(16 + 3, seed=33),  # diverges inside the shared prefix
            "same": base + random_tokens(2 * 16 + 5, seed=31),  # the same prompt again, another request
        }
        sent = {r.request_id: r for r in producer.prefill_many([(rid, t, None) for rid, t in prompts.items()])}
        assert sent["long"].keys[:3] == sent["short"].keys[:3] and sent["long"].keys[:2] == sent["inside"].keys[:2]
        assert sent["inside"].keys[2] != sent["long"].keys[2]
        got = consumer.prefill_many([(f"{rid}-c", t, sent[rid].finish.transfer_params) for rid, t in prompts.items()])
        for result in got:
            origin = sent[result.request_id.removesuffix("-c")]
            n = len(origin.keys)
            assert result.failed_blocks == [], result.request_id
            assert len(result.loaded_blocks) == n, result.request_id
            assert torch.equal(result.snapshot[:, :n], origin.snapshot[:, :n])
            assert_recomputed(result, consumer, n)
        settle(producer)
    finally:
        close_engines(producer, consumer)


def test_lookup_is_idempotent(conformance_backend):
    """The engine may ask again while a request waits: the same answer, and no side effect — nothing is
    planned before allocation, and a call after allocation leaves the plan's one load as it was."""
    _, target = conformance_backend
    producer, consumer = engine_pair(target)
    try:
        tokens = random_tokens(5 * 16 + 8, seed=40)
        sent = producer.prefill("req-a", tokens)
        req = consumer.request("req-b", tokens, sent.finish.transfer_params)
        first = consumer.scheduler.lookup(req, 0)
        assert first.num_tokens == 5 * 16
        assert consumer.scheduler.lookup(req, 0) == first
        assert not consumer.scheduler.plan_step([])  # asking plans nothing
        ids = consumer.allocate(6)
        consumer.scheduler.on_allocated(req, ids, first.num_tokens)
        assert consumer.scheduler.lookup(req, 0) == first
        plan = consumer.scheduler.plan_step([])
        assert [op.request_id for op in plan.loads] == ["req-b"]
        assert plan.loads[0].block_ids == tuple(ids[:5])
        if target.producer.kind == "store":
            assert plan.loads[0].keys == req.block_keys[:5]
        consumer.worker.start_step(plan)
        consumer.worker.finish_step()
        reports = pump_until(consumer, lambda seen: any("req-b" in r.finished_loading for r in seen))
        assert not any(r.failed_blocks for r in reports)  # (each pump also planned a step: none re-planned the load)
        assert torch.equal(consumer.read(ids[:5]), sent.snapshot[:, :5])
        if getattr(plan.loads[0].source, "writes_back", False):  # it copies the loaded blocks on (a chain's
            # promotion, after the report): held until the worker says that is over too, then freed
            assert consumer.finish(req, ids).delay_free
            pump_until(consumer, lambda seen: "req-b" not in consumer.held)
        else:
            assert not consumer.finish(req, ids).delay_free  # its load is over: nothing to hold for
        settle(producer)
    finally:
        close_engines(producer, consumer)


__all__ = [
    "LAYOUTS",
    "MISMATCHES",
    "test_concurrent_requests_do_not_mix",
    "test_concurrent_requests_sharing_a_prefix",
    "test_layout_mismatch_is_refused",
    "test_lookup_is_idempotent",
    "test_miss_is_a_miss_not_an_error",
    "test_partial_prefix_hit",
    "test_round_trip_is_bit_exact",
    "test_whole_prompt_hit_leaves_one_token_to_compute",
]
