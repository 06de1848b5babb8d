"""Conformance at a request's end: blocks a load or save still uses stay held (``delay_free``) until the
worker reports it over, and no longer; a preempted request's saves finish before the next step."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from kvbridge.contract import ScheduledRequest
from kvbridge.store import StoreWorker
from kvbridge.testing.suite.gates import BlockingCall, gated_io, store_worker
from kvbridge.testing.suite.support import (
    assert_recomputed,
    close_engines,
    engine_pair,
    random_tokens,
    settle,
)


def test_request_ending_mid_load_is_held_until_the_load_is_over(conformance_backend):
    """A request that ends while its load still writes its blocks keeps them (delay_free) until the worker
    reports the load over, never sooner; the blocks hold what arrived, bit-exact."""
    name, target = conformance_backend
    producer, consumer = engine_pair(target)
    try:
        tokens = random_tokens(4 * 16 + 3, seed=80)
        sent = producer.prefill("req-a", tokens)
        with contextlib.ExitStack() as stack:
            gate = stack.enter_context(gated_io(consumer.worker, "load")) if isinstance(consumer.worker, StoreWorker) else None
            req, ids, n_ext = consumer.admit("req-b", tokens, sent.finish.transfer_params)
            assert n_ext == 4 * 16
            consumer.worker.start_step(consumer.scheduler.plan_step([]))
            consumer.worker.finish_step()
            assert consumer.finish(req, ids).delay_free  # the load may still write the blocks
            if gate is not None:
                assert gate.entered.wait(10)
                for _ in range(20):  # steps while the load is held back: the blocks stay held
                    report = consumer.pump()
                    assert "req-b" not in report.finished_saving, "released while its load still ran"
                assert "req-b" in consumer.held
                gate.open()
            loaded_at = released_at = None
            step = 0
            deadline = time.monotonic() + 30
            while released_at is None:
                assert time.monotonic() < deadline, "the held request was never released"
                report = consumer.pump()
                if "req-b" in report.finished_loading:
                    loaded_at = step
                    assert not report.failed_blocks
                if "req-b" in report.finished_saving:
                    released_at = step
                step += 1
                time.sleep(0.001)
        assert loaded_at is not None and loaded_at <= released_at
        assert "req-b" not in consumer.held
        assert torch.equal(consumer.read(ids[:4]), sent.snapshot[:, :4])
        settle(producer)
    finally:
        close_engines(producer, consumer)


def test_request_ending_before_its_load_starts_frees_at_once(conformance_backend):
    """A load planned but not yet handed to a worker is dropped when its request ends: nothing is held,
    and no later plan carries it."""
    _, target = conformance_backend
    producer, consumer = engine_pair(target)
    try:
        tokens = random_tokens(3 * 16 + 3, seed=90)
        sent = producer.prefill("req-a", tokens)
        req, ids, n_ext = consumer.admit("req-b", tokens, sent.finish.transfer_params)
        assert n_ext == 3 * 16
        assert not consumer.finish(req, ids).delay_free
        plan = consumer.scheduler.plan_step([])
        assert "req-b" not in [op.request_id for op in plan.loads] and "req-b" not in plan.held
        consumer.worker.start_step(plan)
        consumer.worker.finish_step()
        assert consumer.worker.wait_idle(10)
        assert "req-b" not in consumer.worker.poll().finished_loading
        # (a peer's producer keeps req-a's blocks until its lease ends: nobody pulled them)
    finally:
        close_engines(producer, consumer)


def test_preempted_request_saves_finish_before_the_next_step(conformance_backend):
    """Saves go on after the forward pass; when the engine takes a request's blocks back (preemption)
    with its save still reading them, the next plan names it in ``flush`` and the worker's start_step
    returns only once that save is over, so the step may overwrite the blocks."""
    name, target = conformance_backend
    if target.producer.kind != "store":
        pytest.skip(f"{name} is a peer backend: it saves nothing, a consumer pulls the producer's held blocks")
    producer, consumer = engine_pair(target)
    try:
        worker = store_worker(name, producer)
        tokens = random_tokens(4 * 16 + 3, seed=95)
        with gated_io(worker, "save") as gate:
            req, ids, n_ext = producer.admit("req-a", tokens)
            assert n_ext == 0
            producer.compute(ids, req.block_keys)
            plan = producer.scheduler.plan_step([ScheduledRequest("req-a", tuple(ids), 0, req.num_prompt_tokens)])
            assert plan.saves
            producer.worker.start_step(plan)
            finishing = BlockingCall(producer.worker.finish_step)
            finishing.join(10)
            assert not finishing.is_alive(), "finish_step waited for the save: saves must leave the forward pass"
            assert finishing.error is None
            assert gate.entered.wait(10)
            producer.scheduler.on_preempted(["req-a"])
            plan = producer.scheduler.plan_step([])
            assert "req-a" in plan.flush
            starting = BlockingCall(lambda: producer.worker.start_step(plan))
            starting.join(0.3)
            assert starting.is_alive(), "start_step returned while the preempted request's save still ran"
            gate.open()
            starting.join(30)
            assert not starting.is_alive() and starting.error is None
        # the engine reuses the blocks at once: the save must have read them before this
        producer.layout.scatter(ids, torch.full((producer.layout.num_layers, len(ids), producer.layout.block_bytes), 0xA5,
                                                dtype=torch.uint8, device=producer.layout.device))
        producer.free(ids)
        got = consumer.prefill("req-b", tokens)
        assert got.failed_blocks == [] and len(got.loaded_blocks) == 4
        assert_recomputed(got, consumer, 4)
    finally:
        close_engines(producer, consumer)


__all__ = [
    "test_preempted_request_saves_finish_before_the_next_step",
    "test_request_ending_before_its_load_starts_frees_at_once",
    "test_request_ending_mid_load_is_held_until_the_load_is_over",
]
