"""The conformance suite: one set of tests that every registered backend must pass.

Use it from a test module with::

    from kvbridge.testing.conformance import *  # noqa: F403

It runs every test once per backend in the registry (built-in and entry points). A backend joins with
a target, a producer and a consumer backend sharing whatever medium they use: the built-in ones are
declared in :mod:`kvbridge.testing.targets`; a third-party backend exposes, in its module,
``conformance_target(tmp_path) -> kvbridge.testing.Target``. A backend that cannot be imported here
(missing extra) is *skipped* with the reason and the install hint; a backend without a target
*fails*. To run the suite against only some backends, override the ``conformance_names`` fixture.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvbridge import registry
from kvbridge.errors import ClosedError
from kvbridge.layout import BLOCKS_FIRST, KV_FIRST
from kvbridge.testing.engine import MiniEngine, Target
from kvbridge.testing.targets import target_for

BACKEND_NAMES = sorted(registry.available())


@pytest.fixture(params=BACKEND_NAMES)
def conformance_backend(request: pytest.FixtureRequest, tmp_path) -> Iterator[tuple[str, Target]]:
    name = request.param
    spec = registry.available()[name]
    try:
        target = target_for(name, tmp_path)
    except ImportError as exc:
        pytest.skip(f"backend {name!r} cannot run here ({exc}); {spec.install_hint}")
    except LookupError as exc:
        pytest.fail(str(exc))
    try:
        yield name, target
    finally:
        if target.cleanup is not None:
            target.cleanup()


def _engines(target: Target, **layout) -> tuple[MiniEngine, MiniEngine]:
    if target.consumer is None:
        engine = MiniEngine(target.producer, engine_id="solo", role="both", **layout)
        return engine, engine
    producer = MiniEngine(target.producer, engine_id="producer", role="producer", seed=1, **layout)
    consumer = MiniEngine(target.consumer, engine_id="consumer", role="consumer", seed=2, **layout)
    return producer, consumer


def _close(*engines: MiniEngine) -> None:
    for engine in {id(e): e for e in engines}.values():
        engine.close()


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def _settle(producer: MiniEngine) -> None:
    """Let a producer that holds blocks for a consumer see its releases."""
    if producer.held:
        producer.wait_for(lambda _r: not producer.held, timeout=30)


@pytest.mark.parametrize(
    "kv_format,dtype",
    [(BLOCKS_FIRST, torch.bfloat16), (BLOCKS_FIRST, torch.float32), (KV_FIRST, torch.float16)],
)
def test_round_trip_is_bit_exact(conformance_backend, kv_format, dtype):
    """Scattered blocks of every layer arrive exactly as they left."""
    _, target = conformance_backend
    producer, consumer = _engines(target, kv_format=kv_format, dtype=dtype)
    try:
        tokens = _tokens(5 * 16 + 8, seed=1)  # 5 full blocks and a partial one
        sent = producer.prefill("req-a", tokens)
        got = consumer.prefill("req-b", tokens, sent.finish.transfer_params)
        assert got.loaded_tokens == 5 * 16
        assert got.failed_blocks == []
        assert len(got.loaded_blocks) == 5
        assert torch.equal(got.snapshot[:, :5], sent.snapshot[:, :5])
        assert torch.equal(got.snapshot[:, :5], consumer.expected(got.keys[:5]))
        _settle(producer)
    finally:
        _close(producer, consumer)


def test_whole_prompt_hit_leaves_one_token_to_compute(conformance_backend):
    _, target = conformance_backend
    producer, consumer = _engines(target)
    try:
        tokens = _tokens(4 * 16, seed=2)
        sent = producer.prefill("req-a", tokens)
        got = consumer.prefill("req-b", tokens, sent.finish.transfer_params)
        assert got.loaded_tokens == 4 * 16 - 1
        assert torch.equal(got.snapshot, sent.snapshot)
        _settle(producer)
    finally:
        _close(producer, consumer)


def test_miss_is_a_miss_not_an_error(conformance_backend):
    _, target = conformance_backend
    producer, consumer = _engines(target)
    try:
        got = consumer.prefill("req-x", _tokens(3 * 16, seed=3))
        assert got.loaded_tokens == 0
        assert got.failed_blocks == []
        assert torch.equal(got.snapshot, consumer.expected(got.keys))
    finally:
        _close(producer, consumer)


def test_partial_prefix_hit(conformance_backend):
    name, target = conformance_backend
    if target.producer.kind != "store":
        pytest.skip(f"{name} is a peer backend: a consumer fetches exactly the blocks the producer names")
    producer, consumer = _engines(target)
    try:
        tokens = _tokens(6 * 16, seed=4)
        sent = producer.prefill("req-a", tokens)
        other = tokens[: 3 * 16] + _tokens(3 * 16 + 5, seed=5)
        got = consumer.prefill("req-b", other)
        assert got.loaded_tokens == 3 * 16
        assert torch.equal(got.snapshot[:, :3], sent.snapshot[:, :3])
        assert torch.equal(got.snapshot[:, 3:6], consumer.expected(got.keys[3:6]))
    finally:
        _close(producer, consumer)


def test_layout_mismatch_is_refused(conformance_backend):
    """A consumer whose KV geometry differs never loads the producer's bytes."""
    name, target = conformance_backend
    if target.consumer is None:
        pytest.skip(f"{name} serves one engine: its blocks cannot meet another layout")
    producer = MiniEngine(target.producer, engine_id="producer", role="producer", head_size=16)
    consumer = MiniEngine(target.consumer, engine_id="consumer", role="consumer", head_size=32)
    try:
        tokens = _tokens(4 * 16 + 3, seed=6)
        sent = producer.prefill("req-a", tokens)
        got = consumer.prefill("req-b", tokens, sent.finish.transfer_params)
        assert got.loaded_blocks == []
        assert got.loaded_tokens == 0 or got.failed_blocks
        assert torch.equal(got.snapshot[:, :4], consumer.expected(got.keys[:4]))
        _settle(producer)
    finally:
        _close(producer, consumer)


def test_use_after_close_raises(conformance_backend):
    _, target = conformance_backend
    producer, consumer = _engines(target)
    _close(producer, consumer)
    for engine in (producer, consumer):
        with pytest.raises(ClosedError):
            engine.scheduler.lookup(engine.request("r", _tokens(32, seed=7)), 0)
        with pytest.raises(ClosedError):
            engine.worker.poll()
        engine.scheduler.close()  # idempotent
        engine.worker.close()


def test_concurrent_requests_do_not_mix(conformance_backend):
    _, target = conformance_backend
    producer, consumer = _engines(target, num_blocks=128)
    try:
        prompts = {f"req-{i}": _tokens(16 * (1 + i % 3) + 7, seed=100 + i) for i in range(8)}
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
        _settle(producer)
    finally:
        _close(producer, consumer)


__all__ = [
    "conformance_backend",
    "test_concurrent_requests_do_not_mix",
    "test_layout_mismatch_is_refused",
    "test_miss_is_a_miss_not_an_error",
    "test_partial_prefix_hit",
    "test_round_trip_is_bit_exact",
    "test_use_after_close_raises",
    "test_whole_prompt_hit_leaves_one_token_to_compute",
]
