"""Transfer benchmarks per backend and op: ``pytest benches/ --benchmark-only`` (about a minute).

The cases are those of ``kvbridge bench`` (:mod:`kvbridge.bench.cases`), one parameter per registered
backend (skipped with the reason when it cannot run here). Each test measures its baseline right after
(same bytes, same medium) and puts it beside the figure in ``extra_info`` (``--benchmark-json``):
``bytes``, ``gbps``, ``baseline``, ``baseline_gbps``, ``ratio`` (ours/baseline in throughput: 1.0 = as fast as the raw medium).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import pytest

from kvbridge import registry
from kvbridge.bench.cases import (
    BENCH,
    DEFAULT_BENCH,
    Case,
    medium_env,
    opened,
    sched_floor_case,
)
from kvbridge.bench.core import SHAPES, Point, Timing, gbps
from kvbridge.bench.measurer import Measurer
from kvbridge.bench.pairs import Pair, load_case, save_case, save_stall_case

POINTS = {"8b-256tok": Point(SHAPES["8b"], 256), "8b-64tok-x4": Point(SHAPES["8b"], 64, requests=4)}
SCHED_POINT = Point(SHAPES["tiny"], 1024, requests=16)
ROUNDS = 5


def _pair(name: str, point: Point) -> Iterator[tuple[Pair, bool, dict]]:
    problem = registry.check(name)
    if problem:
        pytest.skip(problem)
    with opened(name, point) as (target, tmp):
        pair = Pair(target, point)
        try:
            yield pair, target.producer.kind == "peer", medium_env(target, tmp)
        finally:
            pair.close()


def _run(benchmark, case: Case, point: Point) -> float:
    counter = iter(range(10**9))

    benchmark.extra_info.update(bytes=point.nbytes, blocks=point.blocks, tokens=point.tokens, requests=point.requests)
    benchmark.pedantic(
        case.run,
        setup=lambda: ((case.prepare(next(counter)),), {}),
        teardown=case.teardown,
        rounds=ROUNDS,
        warmup_rounds=1,
    )
    return float(benchmark.stats.stats.median)


def _beside(benchmark, name: str, op: str, point: Point, env: dict, median: float) -> None:
    base = Measurer(ROUNDS).baseline(BENCH.get(name, DEFAULT_BENCH).baselines[0], point, op, env)
    info = benchmark.extra_info
    info.update(gbps=gbps(point.nbytes, median), baseline=BENCH.get(name, DEFAULT_BENCH).baselines[0])
    if isinstance(base, Timing):
        info.update(baseline_gbps=gbps(point.nbytes, base.median), ratio=base.median / median)
    else:
        info["baseline_note"] = base


@pytest.fixture(params=sorted(registry.available()))
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("op", ["save", "load"])
def test_store(benchmark, backend_name, op, point):
    """``save``/``load`` of a store backend."""
    p = POINTS[point]
    for pair, peer, env in _pair(backend_name, p):
        if peer:
            pytest.skip(f"{backend_name} is a peer: see test_transfer")
        median = _run(benchmark, save_case(pair) if op == "save" else load_case(pair, peer=False), p)
        _beside(benchmark, backend_name, op, p, env, median)


@pytest.mark.parametrize("point", list(POINTS))
def test_transfer(benchmark, backend_name, point):
    """A consumer's pull from a peer backend's producer."""
    p = POINTS[point]
    for pair, peer, env in _pair(backend_name, p):
        if not peer:
            pytest.skip(f"{backend_name} is a store: see test_store")
        median = _run(benchmark, load_case(pair, peer=True), p)
        _beside(benchmark, backend_name, "transfer", p, env, median)


@pytest.mark.parametrize("point", list(POINTS))
def test_save_stall(benchmark, backend_name, point):
    """A store's step that saves: timed, the worker's ``start_step`` … ``finish_step`` (the forward pass's
    stall); ``extra_info`` has the save's own time beside it (``save_s``, ``stall_frac``) and the raw
    medium writing the same bytes (``baseline_s``)."""
    p = POINTS[point]
    for pair, peer, env in _pair(backend_name, p):
        if peer:
            pytest.skip(f"{backend_name} is a peer: its producer saves nothing")
        saves: list[float] = []
        stall = _run(benchmark, save_stall_case(pair, saves), p)
        save = statistics.median(saves[-ROUNDS:])
        name = BENCH.get(backend_name, DEFAULT_BENCH).baselines[0]
        base = Measurer(ROUNDS).baseline(name, p, "save", env)
        benchmark.extra_info.update(stall_s=stall, save_s=save, stall_frac=stall / save, baseline=name)
        if isinstance(base, Timing):
            benchmark.extra_info["baseline_s"] = base.median
        else:
            benchmark.extra_info["baseline_note"] = base


def test_sched_step(benchmark, backend_name):
    """Scheduler side, 16 requests of 64 blocks per step: lookup + on_allocated + plan_step."""
    for pair, peer, _env in _pair(backend_name, SCHED_POINT):
        median = _run(benchmark, load_case(pair, peer=peer, timed="plan"), SCHED_POINT)
        floor = sched_floor_case(SCHED_POINT).time(ROUNDS).median
        benchmark.extra_info.update(
            us_per_request=median / SCHED_POINT.requests * 1e6, baseline="dict", ratio=floor / median
        )
