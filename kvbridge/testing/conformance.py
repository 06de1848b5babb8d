"""The conformance suite: one set of tests that every registered backend must pass.

Use it from a test module with::

    from kvbridge.testing.conformance import *  # noqa: F403

It runs every test once per backend in the registry (built-in and entry points). A backend joins with
a target, a producer and a consumer backend sharing whatever medium they use: the built-in ones are
declared in :mod:`kvbridge.testing.targets`; a third-party backend exposes, in its module,
``conformance_target(tmp_path) -> kvbridge.testing.Target``. A backend that cannot be imported here
(missing extra) is *skipped* with the reason and the install hint; a backend without a target
*fails*. To run the suite against only some backends, override the ``conformance_names`` fixture.

Faults come from the target's hooks (:class:`~kvbridge.testing.engine.Target`: ``corrupt``,
``vanish``, ``break_saves``); a test whose hook the target lacks is skipped with the target's reason.
Every test that moves KV compares the bytes that arrived with the bytes the engine computes
(:meth:`MiniEngine.expected`) or the producer's snapshot, bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvbridge import registry
from kvbridge.contract import EMPTY_PLAN, ScheduledRequest, WorkerReport
from kvbridge.errors import ClosedError
from kvbridge.layout import BLOCKS_FIRST, KV_FIRST, MLA
from kvbridge.store import StoreWorker
from kvbridge.testing.engine import MiniEngine, Target
from kvbridge.testing.targets import target_for
from kvbridge.transfer import Started, Transfer

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


def _hook(name: str, target: Target, hook: str) -> Callable[..., Any]:
    fn = getattr(target, hook)
    if fn is None:
        pytest.skip(target.absent.get(hook) or f"the {name} target declares no {hook!r} fault hook")
    return fn  # type: ignore[no-any-return]


def _store_worker(name: str, engine: MiniEngine) -> StoreWorker:
    if not isinstance(engine.worker, StoreWorker):
        pytest.skip(f"{name} is not a store: only a store's IO can be held back at its boundary")
    return engine.worker


class _Gate:
    """Holds a store's loads or saves back at the :class:`~kvbridge.store.StoreIO` boundary until
    :meth:`open`: a fake slow medium (a medium that is slow on demand cannot be made real in a unit test);
    the real load or save runs once the gate opens. ``entered`` is set when the first call reaches it.
    A load or save the store starts on native threads (``start_load``/``start_save``) runs at once, but
    is not over until the gate opens."""

    def __init__(self, io: Any, method: str):
        self.io, self.method = io, method
        self.entered = threading.Event()
        self._open = threading.Event()
        self._shadowed: dict[str, Any] = {}  # instance attributes of the io's own (a fault hook's)
        real, start = getattr(io, method), getattr(io, f"start_{method}")

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            if not self._open.wait(30):
                raise TimeoutError(f"conformance gate on {method} never opened")
            return real(*args, **kwargs)

        def gated_start(*args: Any, **kwargs: Any) -> Transfer | None:
            started = start(*args, **kwargs)
            if started is None:
                return None
            self.entered.set()
            return Started(started.op, _GatedRunning(started, self._open), started.failed)

        for name, fn in ((method, gated), (f"start_{method}", gated_start)):
            self._shadowed[name] = vars(io).get(name)
            setattr(io, name, fn)

    def open(self) -> None:
        self._open.set()

    def remove(self) -> None:
        self._open.set()
        for name, shadowed in self._shadowed.items():
            if shadowed is not None:
                setattr(self.io, name, shadowed)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(self.io, name)


class _GatedRunning:
    """A natively started transfer that is over only once it is, and the gate is open."""

    def __init__(self, running: Transfer, gate: threading.Event):
        self.running, self.gate = running, gate

    def bind(self, io: Any) -> None:
        self.running.bind(io)

    def done(self) -> bool:
        return self.gate.is_set() and bool(self.running.done())

    def wait(self, timeout: float | None = None) -> bool:
        t0 = time.monotonic()
        if not self.gate.wait(timeout):
            return False
        return bool(self.running.wait(None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))))


@contextlib.contextmanager
def _gate(worker: StoreWorker, method: str) -> Iterator[_Gate]:
    gate = _Gate(worker.io, method)
    try:
        yield gate
    finally:
        gate.remove()


class _Call(threading.Thread):
    """``fn()`` on a thread of its own, for a call the test expects to block: callers check ``is_alive``,
    then ``error`` (what it raised, if anything)."""

    def __init__(self, fn: Callable[[], Any]):
        super().__init__(daemon=True)
        self.fn = fn
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc


def _pump_until(
    engine: MiniEngine, done: Callable[[list[WorkerReport]], bool], timeout: float = 30.0
) -> list[WorkerReport]:
    """Idle engine steps until ``done(reports so far)``; the reports they produced."""
    reports: list[WorkerReport] = []
    deadline = time.monotonic() + timeout
    while not done(reports):
        assert time.monotonic() < deadline, f"not done within {timeout}s (held: {sorted(engine.held)})"
        reports.append(engine.pump())
        time.sleep(0.002)
    return reports


def _assert_recomputed(got: Any, engine: MiniEngine, n: int) -> None:
    """The first ``n`` blocks of a request hold exactly what the engine computes for them."""
    assert torch.equal(got.snapshot[:, :n], engine.expected(got.keys[:n]))


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
    producer, consumer = _engines(target, **layout)
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
        tokens = _tokens(4 * 16 + 3, seed=6)
        sent = producer.prefill("req-a", tokens)
        got = consumer.prefill("req-b", tokens, sent.finish.transfer_params)
        assert got.loaded_blocks == []
        assert got.loaded_tokens == 0
        assert torch.equal(got.snapshot[:, :4], consumer.expected(got.keys[:4]))
        _settle(producer)
    finally:
        _close(producer, consumer)


def test_use_after_close_raises(conformance_backend):
    """Every public method of both sides raises ClosedError after close(); close() itself is idempotent."""
    _, target = conformance_backend
    producer, consumer = _engines(target)
    _close(producer, consumer)
    for engine in {id(e): e for e in (producer, consumer)}.values():
        for method, call in _every_public_call(engine).items():
            with pytest.raises(ClosedError):
                call()
                pytest.fail(f"{method}() after close() did not raise")
        engine.scheduler.close()  # idempotent
        engine.worker.close()


def _every_public_call(engine: MiniEngine) -> dict[str, Callable[[], Any]]:
    """One call of every public method of both sides of ``engine``, with plausible arguments."""
    req = engine.request("r", _tokens(32, seed=7))
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


def test_concurrent_requests_sharing_a_prefix(conformance_backend):
    """Requests that share their first blocks, saved in one step and loaded in one plan, each get their own
    blocks bit-exact: the shared prefix (saved twice, read twice at once) and their own tails."""
    _, target = conformance_backend
    producer, consumer = _engines(target, num_blocks=128)
    try:
        base = _tokens(3 * 16, seed=30)
        prompts = {
            "long": base + _tokens(2 * 16 + 5, seed=31),
            "short": base + _tokens(9, seed=32),
            "inside": base[: 2 * 16] + _tokens(16 + 3, seed=33),  # diverges inside the shared prefix
            "same": base + _tokens(2 * 16 + 5, seed=31),  # the same prompt again, another request
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
            _assert_recomputed(result, consumer, n)
        _settle(producer)
    finally:
        _close(producer, consumer)


def test_lookup_is_idempotent(conformance_backend):
    """The engine may ask again while a request waits: the same answer, and no side effect — nothing is
    planned before allocation, and a call after allocation leaves the plan's one load as it was."""
    _, target = conformance_backend
    producer, consumer = _engines(target)
    try:
        tokens = _tokens(5 * 16 + 8, seed=40)
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
        reports = _pump_until(consumer, lambda seen: any("req-b" in r.finished_loading for r in seen))
        assert not any(r.failed_blocks for r in reports)  # (each pump also planned a step: none re-planned the load)
        assert torch.equal(consumer.read(ids[:5]), sent.snapshot[:, :5])
        if getattr(plan.loads[0].source, "writes_back", False):  # it copies the loaded blocks on (a chain's
            # promotion, after the report): held until the worker says that is over too, then freed
            assert consumer.finish(req, ids).delay_free
            _pump_until(consumer, lambda seen: "req-b" not in consumer.held)
        else:
            assert not consumer.finish(req, ids).delay_free  # its load is over: nothing to hold for
        _settle(producer)
    finally:
        _close(producer, consumer)


def test_vanished_medium_fails_the_load_and_is_recomputed(conformance_backend):
    """The medium goes away between the lookup that offered the blocks and their load: the load fails (or
    finds nothing), no block counts as loaded, every one is recomputed bit-exact, the failed load is not
    offered again, and the engine goes on serving."""
    name, target = conformance_backend
    vanish = _hook(name, target, "vanish")
    producer, consumer = _engines(target)
    try:
        tokens = _tokens(4 * 16 + 3, seed=50)
        sent = producer.prefill("req-a", tokens)
        got = consumer.prefill("req-b", tokens, sent.finish.transfer_params, before_load=lambda: vanish(producer, consumer))
        assert got.offered_tokens == 4 * 16 and got.loaded_tokens == 0  # offered while the medium was there
        assert got.loaded_blocks == []
        assert got.failed_blocks == sorted(got.block_ids[:4])  # reported failed, not taken as loaded
        _assert_recomputed(got, consumer, 4)
        assert got.reoffered == 0
        again = consumer.prefill("req-c", tokens, sent.finish.transfer_params)  # the same prompt, a new request
        if producer is not consumer:  # (one engine may have stored the blocks again as it recomputed them)
            assert again.loaded_blocks == []
        _assert_recomputed(again, consumer, 4)
        fresh = consumer.prefill("req-d", _tokens(2 * 16 + 1, seed=51))
        assert fresh.loaded_tokens == 0 and fresh.failed_blocks == []
        _assert_recomputed(fresh, consumer, 2)
    finally:
        _close(producer, consumer)


def test_corrupt_data_is_never_loaded(conformance_backend):
    """A damaged stored block is a failed block: the blocks before it load, it and those after it are
    recomputed bit-exact, and the failed load is not offered again."""
    name, target = conformance_backend
    corrupt = _hook(name, target, "corrupt")
    producer, consumer = _engines(target)
    try:
        tokens = _tokens(4 * 16 + 5, seed=60)
        sent = producer.prefill("req-a", tokens)
        assert corrupt(producer, consumer, sent.keys[1:2]) > 0, "the hook damaged nothing"
        got = consumer.prefill("req-b", tokens, sent.finish.transfer_params)
        assert got.loaded_blocks == got.block_ids[:1]  # block 0 is intact
        assert got.block_ids[1] in got.failed_blocks
        assert torch.equal(got.snapshot[:, :1], sent.snapshot[:, :1])
        _assert_recomputed(got, consumer, 4)
        assert got.reoffered == 0
        again = consumer.prefill("req-c", tokens, sent.finish.transfer_params)  # a new request: the damage
        _assert_recomputed(again, consumer, 4)  # is not served to it either
        _settle(producer)
    finally:
        _close(producer, consumer)


def test_failing_saves_never_harm_a_request(conformance_backend):
    """Saves that fail: the request completes with the KV it computed, blocks held for its save are
    released, nothing of it is loaded later; once the medium is back, saves and loads work again."""
    name, target = conformance_backend
    break_saves = _hook(name, target, "break_saves")
    producer, consumer = _engines(target)
    try:
        tokens = _tokens(3 * 16 + 5, seed=70)
        with break_saves(producer, consumer), contextlib.ExitStack() as stack:
            store = isinstance(producer.worker, StoreWorker)
            # a store's failing save is held back until the request has ended, so it ends with the save out
            gate = stack.enter_context(_gate(producer.worker, "save")) if store else None
            sent = producer.prefill("req-a", tokens, wait_saves=False)
            _assert_recomputed(sent, producer, 3)
            if gate is not None:
                assert gate.entered.wait(10)
                assert sent.finish.delay_free and "req-a" in producer.held  # its save still reads the blocks
                gate.open()
            _pump_until(producer, lambda _seen: not producer.held)  # released although the save failed
            assert producer.worker.wait_idle(30)
        got = consumer.prefill("req-b", tokens)
        assert got.loaded_blocks == []  # nothing was stored
        _assert_recomputed(got, consumer, 3)
        other = _tokens(2 * 16 + 5, seed=71)
        sent = producer.prefill("req-c", other)
        got = consumer.prefill("req-d", other, sent.finish.transfer_params)
        assert got.failed_blocks == [] and len(got.loaded_blocks) == 2
        assert torch.equal(got.snapshot[:, :2], sent.snapshot[:, :2])
        _settle(producer)
        assert not producer.held and not consumer.held
    finally:
        _close(producer, consumer)


def test_request_ending_mid_load_is_held_until_the_load_is_over(conformance_backend):
    """A request that ends while its load still writes its blocks keeps them (delay_free) until the worker
    reports the load over, never sooner; the blocks hold what arrived, bit-exact."""
    name, target = conformance_backend
    producer, consumer = _engines(target)
    try:
        tokens = _tokens(4 * 16 + 3, seed=80)
        sent = producer.prefill("req-a", tokens)
        with contextlib.ExitStack() as stack:
            gate = stack.enter_context(_gate(consumer.worker, "load")) if isinstance(consumer.worker, StoreWorker) else None
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
        _settle(producer)
    finally:
        _close(producer, consumer)


def test_request_ending_before_its_load_starts_frees_at_once(conformance_backend):
    """A load planned but not yet handed to a worker is dropped when its request ends: nothing is held,
    and no later plan carries it."""
    _, target = conformance_backend
    producer, consumer = _engines(target)
    try:
        tokens = _tokens(3 * 16 + 3, seed=90)
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
        _close(producer, consumer)


def test_preempted_request_saves_finish_before_the_next_step(conformance_backend):
    """Saves go on after the forward pass; when the engine takes a request's blocks back (preemption)
    with its save still reading them, the next plan names it in ``flush`` and the worker's start_step
    returns only once that save is over, so the step may overwrite the blocks."""
    name, target = conformance_backend
    if target.producer.kind != "store":
        pytest.skip(f"{name} is a peer backend: it saves nothing, a consumer pulls the producer's held blocks")
    producer, consumer = _engines(target)
    try:
        worker = _store_worker(name, producer)
        tokens = _tokens(4 * 16 + 3, seed=95)
        with _gate(worker, "save") as gate:
            req, ids, n_ext = producer.admit("req-a", tokens)
            assert n_ext == 0
            producer.compute(ids, req.block_keys)
            plan = producer.scheduler.plan_step([ScheduledRequest("req-a", tuple(ids), 0, req.num_prompt_tokens)])
            assert plan.saves
            producer.worker.start_step(plan)
            finishing = _Call(producer.worker.finish_step)
            finishing.join(10)
            assert not finishing.is_alive(), "finish_step waited for the save: saves must leave the forward pass"
            assert finishing.error is None
            assert gate.entered.wait(10)
            producer.scheduler.on_preempted(["req-a"])
            plan = producer.scheduler.plan_step([])
            assert "req-a" in plan.flush
            starting = _Call(lambda: producer.worker.start_step(plan))
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
        _assert_recomputed(got, consumer, 4)
    finally:
        _close(producer, consumer)


__all__ = [
    "conformance_backend",
    "test_concurrent_requests_do_not_mix",
    "test_concurrent_requests_sharing_a_prefix",
    "test_corrupt_data_is_never_loaded",
    "test_failing_saves_never_harm_a_request",
    "test_layout_mismatch_is_refused",
    "test_lookup_is_idempotent",
    "test_miss_is_a_miss_not_an_error",
    "test_partial_prefix_hit",
    "test_preempted_request_saves_finish_before_the_next_step",
    "test_request_ending_before_its_load_starts_frees_at_once",
    "test_request_ending_mid_load_is_held_until_the_load_is_over",
    "test_round_trip_is_bit_exact",
    "test_use_after_close_raises",
    "test_vanished_medium_fails_the_load_and_is_recomputed",
    "test_whole_prompt_hit_leaves_one_token_to_compute",
]
