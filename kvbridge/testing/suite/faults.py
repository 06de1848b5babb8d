"""Conformance under faults: use after close, a medium that vanishes, corrupt data, saves that fail. A
failed block is recomputed bit-exact, never counted as loaded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvbridge.contract import EMPTY_PLAN, ScheduledRequest, WorkerReport
from kvbridge.errors import ClosedError
from kvbridge.store import StoreWorker
from kvbridge.testing.engine import MiniEngine
from kvbridge.testing.suite.gates import gated_io
from kvbridge.testing.suite.support import (
    assert_recomputed,
    close_engines,
    engine_pair,
    fault_hook,
    pump_until,
    random_tokens,
    settle,
)


def test_use_after_close_raises(conformance_backend):
    """Every public method of both sides raises ClosedError after close(); close() itself is idempotent."""
    _, target = conformance_backend
    producer, consumer = engine_pair(target)
    close_engines(producer, consumer)
    for engine in {id(e): e for e in (producer, consumer)}.values():
        for method, call in _every_public_call(engine).items():
            with pytest.raises(ClosedError):
                call()
                pytest.fail(f"{method}() after close() did not raise")
        engine.scheduler.close()  # idempotent
        engine.worker.close()


def _every_public_call(engine: MiniEngine) -> dict[str, Callable[[], Any]]:
    """One call of every public method of both sides of ``engine``, with plausible arguments."""
    req = engine.request("r", random_tokens(32, seed=7))
    sched, worker = engine.scheduler, engine.worker
    return {
        "lookup": lambda: sched.lookup(req, 0),
        "on_allocated": lambda: sched.on_allocated(req, [0, 1], 16),
        "plan_step": lambda: sched.plan_step([ScheduledRequest("r", (0, 1), 0, 32)]),
        "on_report": lambda: sched.on_report(WorkerReport(frozenset({"r"}))),
        "on_preempted": lambda: sched.on_preempted(["r"]),
        "on_finished": lambda: sched.on_finished(req, [0, 1]),
        "register": lambda: worker.register(engine.layout),
        "start_step": lambda: worker.start_step(EMPTY_PLAN),
        "wait_layer": lambda: worker.wait_layer(0),
        "save_layer": lambda: worker.save_layer(0),
        "finish_step": lambda: worker.finish_step(),
        "poll": lambda: worker.poll(),
        "wait_idle": lambda: worker.wait_idle(0.1),
    }


def test_vanished_medium_fails_the_load_and_is_recomputed(conformance_backend):
    """The medium goes away between the lookup that offered the blocks and their load: the load fails (or
    finds nothing), no block counts as loaded, every one is recomputed bit-exact, the failed load is not
    offered again, and the engine goes on serving."""
    name, target = conformance_backend
    vanish = fault_hook(name, target, "vanish")
    producer, consumer = engine_pair(target)
    try:
        tokens = random_tokens(4 * 16 + 3, seed=50)
        sent = producer.prefill("req-a", tokens)
        got = consumer.prefill("req-b", tokens, sent.finish.transfer_params, before_load=lambda: vanish(producer, consumer))
        assert got.offered_tokens == 4 * 16 and got.loaded_tokens == 0  # offered while the medium was there
        assert got.loaded_blocks == []
        assert got.failed_blocks == sorted(got.block_ids[:4])  # reported failed, not taken as loaded
        assert_recomputed(got, consumer, 4)
        assert got.reoffered == 0
        again = consumer.prefill("req-c", tokens, sent.finish.transfer_params)  # the same prompt, a new request
        if producer is not consumer:  # (one engine may have stored the blocks again as it recomputed them)
            assert again.loaded_blocks == []
        assert_recomputed(again, consumer, 4)
        fresh = consumer.prefill("req-d", random_tokens(2 * 16 + 1, seed=51))
        assert fresh.loaded_tokens == 0 and fresh.failed_blocks == []
        assert_recomputed(fresh, consumer, 2)
    finally:
        close_engines(producer, consumer)


def test_corrupt_data_is_never_loaded(conformance_backend):
    """A damaged stored block is a failed block: the blocks before it load, it and those after it are
    recomputed bit-exact, and the failed load is not offered again."""
    name, target = conformance_backend
    corrupt = fault_hook(name, target, "corrupt")
    producer, consumer = engine_pair(target)
    try:
        tokens = random_tokens(4 * 16 + 5, seed=60)
        sent = producer.prefill("req-a", tokens)
        assert corrupt(producer, consumer, sent.keys[1:2]) > 0, "the hook damaged nothing"
        got = consumer.prefill("req-b", tokens, sent.finish.transfer_params)
        assert got.loaded_blocks == got.block_ids[:1]  # block 0 is intact
        assert got.block_ids[1] in got.failed_blocks
        assert torch.equal(got.snapshot[:, :1], sent.snapshot[:, :1])
        assert_recomputed(got, consumer, 4)
        assert got.reoffered == 0
        again = consumer.prefill("req-c", tokens, sent.finish.transfer_params)  # a new request: the damage
        assert_recomputed(again, consumer, 4)  # is not served to it either
        settle(producer)
    finally:
        close_engines(producer, consumer)


def test_failing_saves_never_harm_a_request(conformance_backend):
    """Saves that fail: the request completes with the KV it computed, blocks held for its save are
    released, nothing of it is loaded later; once the medium is back, saves and loads work again."""
    name, target = conformance_backend
    break_saves = fault_hook(name, target, "break_saves")
    producer, consumer = engine_pair(target)
    try:
        tokens = random_tokens(3 * 16 + 5, seed=70)
        with break_saves(producer, consumer), contextlib.ExitStack() as stack:
            store = isinstance(producer.worker, StoreWorker)
            # a store's failing save is held back until the request has ended, so it ends with the save out
            gate = stack.enter_context(gated_io(producer.worker, "save")) if store else None
            sent = producer.prefill("req-a", tokens, wait_saves=False)
            assert_recomputed(sent, producer, 3)
            if gate is not None:
                assert gate.entered.wait(10)
                assert sent.finish.delay_free and "req-a" in producer.held  # its save still reads the blocks
                gate.open()
            pump_until(producer, lambda _seen: not producer.held)  # released although the save failed
            assert producer.worker.wait_idle(30)
        got = consumer.prefill("req-b", tokens)
        assert got.loaded_blocks == []  # nothing was stored
        assert_recomputed(got, consumer, 3)
        other = random_tokens(2 * 16 + 5, seed=71)
        sent = producer.prefill("req-c", other)
        got = consumer.prefill("req-d", other, sent.finish.transfer_params)
        assert got.failed_blocks == [] and len(got.loaded_blocks) == 2
        assert torch.equal(got.snapshot[:, :2], sent.snapshot[:, :2])
        settle(producer)
        assert not producer.held and not consumer.held
    finally:
        close_engines(producer, consumer)


__all__ = [
    "test_corrupt_data_is_never_loaded",
    "test_failing_saves_never_harm_a_request",
    "test_use_after_close_raises",
    "test_vanished_medium_fails_the_load_and_is_recomputed",
]
