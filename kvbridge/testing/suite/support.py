"""What every conformance test stands on: the ``conformance_backend`` fixture (one run per registered
backend), a producer and consumer on its target, prompts, and waiting for reports."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvbridge import registry
from kvbridge.contract import WorkerReport
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


def engine_pair(target: Target, **layout) -> tuple[MiniEngine, MiniEngine]:
    if target.consumer is None:
        engine = MiniEngine(target.producer, engine_id="solo", role="both", **layout)
        return engine, engine
    producer = MiniEngine(target.producer, engine_id="producer", role="producer", seed=1, **layout)
    consumer = MiniEngine(target.consumer, engine_id="consumer", role="consumer", seed=2, **layout)
    return producer, consumer


def close_engines(*engines: MiniEngine) -> None:
    for engine in {id(e): e for e in engines}.values():
        engine.close()


def random_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def settle(producer: MiniEngine) -> None:
    """Let a producer that holds blocks for a consumer see its releases."""
    if producer.held:
        producer.wait_for(lambda _r: not producer.held, timeout=30)


def fault_hook(name: str, target: Target, hook: str) -> Callable[..., Any]:
    fn = getattr(target, hook)
    if fn is None:
        pytest.skip(target.absent.get(hook) or f"the {name} target declares no {hook!r} fault hook")
    return fn  # type: ignore[no-any-return]


def pump_until(
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


def assert_recomputed(got: Any, engine: MiniEngine, n: int) -> None:
    """The first ``n`` blocks of a request hold exactly what the engine computes for them."""
    assert torch.equal(got.snapshot[:, :n], engine.expected(got.keys[:n]))


__all__ = ["BACKEND_NAMES", "assert_recomputed", "close_engines", "conformance_backend", "engine_pair", "fault_hook",
           "pump_until", "random_tokens", "settle"]
