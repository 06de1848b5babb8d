"""The measurement core: model shapes and benchmark points (what a case moves), timing (interleaved rounds,
cold caches), and records (a figure beside its baselines). The KV cache a case moves, and the flows that
drive a backend over it, are :mod:`kvbridge.bench.pool`'s.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from kvbridge.bench.cold import evict, evicting

IdPattern = Literal["contiguous", "scattered"]


@dataclasses.dataclass(frozen=True)
class Shape:
    """The KV geometry of a model: per layer K and V of ``num_kv_heads x head_size``."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.dtype.itemsize


SHAPES: dict[str, Shape] = {
    "8b": Shape("8b", 32, 8, 128),  # Llama-3-8B: 128 KiB/token
    "70b": Shape("70b", 80, 8, 128),  # Llama-3-70B: 320 KiB/token
    "tiny": Shape("tiny", 1, 1, 64),  # scheduler overhead: block counts matter, bytes do not
}


@dataclasses.dataclass(frozen=True)
class Point:
    """One configuration to measure: ``requests`` concurrent requests of ``tokens`` tokens each."""

    shape: Shape
    tokens: int
    block_size: int = 16
    ids: IdPattern = "scattered"
    requests: int = 1
    device: str = "cpu"  # where the KV cache lives: "cpu", or "cuda" (its blocks reach a store through pinned staging)

    @property
    def blocks_per_request(self) -> int:
        return max(1, self.tokens // self.block_size)

    @property
    def blocks(self) -> int:
        return self.blocks_per_request * self.requests

    @property
    def nbytes(self) -> int:
        """Bytes moved: full blocks only (a partial last block is always recomputed)."""
        return self.blocks * self.block_size * self.shape.bytes_per_token

    def label(self) -> str:
        where = "" if self.device == "cpu" else f" on {self.device}"
        return f"{self.shape.name} {self.tokens}tok bs{self.block_size} {self.ids} x{self.requests}{where}"


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock samples of one timed operation, in seconds."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def p99(self) -> float:
        return float(np.percentile(self.samples, 99))


def time_reps(
    fn: Callable[[Any], object],
    reps: int,
    *,
    warmup: int = 1,
    setup: Callable[[int], Any] | None = None,
    teardown: Callable[[Any], object] | None = None,
    cold: bool = True,
) -> Timing:
    """Call ``fn(setup(i))`` ``warmup + reps`` times, timing only ``fn``; the samples of the last ``reps``.

    ``setup`` (plans, fresh keys) and ``teardown(state)`` (finishing requests, releases) run untimed, and
    so does the eviction of the CPU's caches before each call (:mod:`kvbridge.bench.cold`) unless ``cold``
    is false.
    """
    out = []
    for i in range(warmup + reps):
        state = setup(i) if setup else None
        if cold:
            evict()
        t0 = time.perf_counter()
        fn(state)
        dt = time.perf_counter() - t0
        if teardown:
            teardown(state)
        if i >= warmup:
            out.append(dt)
    return Timing(tuple(out))



@dataclasses.dataclass(frozen=True)
class Case:
    """One timed operation: ``setup(i)`` (untimed) gives a state, ``run(state)`` is timed,
    ``teardown(state)`` (untimed) finishes it. Backends' cases and in-process baselines are both cases, so
    :func:`time_interleaved` can alternate them; pytest-benchmark drives the same three.
    ``cold``: the CPU's caches are evicted before each run (a transfer's bytes; the scheduler's
    bookkeeping is timed warm, as its figures always were)."""

    setup: Callable[[int], Any]
    run: Callable[[Any], object]
    teardown: Callable[[Any], object] = lambda state: None
    cold: bool = True

    def prepare(self, i: int) -> Any:
        """Untimed, before the ``i``-th run: its state (``setup``), then the caches evicted if ``cold`` (the one
        place that rule lives: :meth:`time`, :func:`time_interleaved` and pytest-benchmark's setup call this)."""
        state = self.setup(i)
        if self.cold:
            evict()
        return state

    def time(self, reps: int) -> Timing:
        return time_reps(self.run, reps, setup=self.prepare, teardown=self.teardown, cold=False)


def time_interleaved(cases: Sequence[Case], reps: int, *, warmup: int = 1) -> list[Timing | Exception]:
    """Time ``cases`` round by round, one run of each per round (``warmup`` rounds first, not kept), the
    order rotated every round so that none always runs first; per case its :class:`Timing`, or the exception
    that ended it (the others go on without it).

    Why: a ratio of two figures timed minutes apart carries the machine's drift between those minutes (a
    shared VM's file medium can change severalfold in half an hour). Timed round by round, a slow minute slows ours and its baseline alike, and their ratio keeps.
    """
    samples: list[list[float]] = [[] for _ in cases]
    ended: dict[int, Exception] = {}
    for r in range(warmup + reps):
        for k in range(len(cases)):
            i = (r + k) % len(cases)
            if i in ended:
                continue
            case = cases[i]
            try:
                state = case.prepare(r)
                t0 = time.perf_counter()
                case.run(state)
                dt = time.perf_counter() - t0
                case.teardown(state)
            except Exception as exc:  # noqa: BLE001 - one case failing ends that case, not the round
                ended[i] = exc
                continue
            if r >= warmup:
                samples[i].append(dt)
    return [ended.get(i) or Timing(tuple(s)) for i, s in enumerate(samples)]


@dataclasses.dataclass
class Record:
    """One measured figure beside its baseline. ``ratio`` is ours/baseline in throughput (baseline time / our time): 1.0 is as fast
    as the raw medium, 0.5 half as fast.

    A case that could not run has ``median_s=None`` and says why in ``note`` ("not measured: ...").
    For ``sched_step`` the times are per request per step and ``gbps`` is ``None``. For ``save_stall``
    ``median_s``/``p99_s`` are the stall (the worker's forward-path calls of a step that saves
    ``bytes``), ``gbps`` is ``None``, ``save_s`` is the save's own time, ``stall_frac`` the stall as
    a fraction of it, and the baseline is the raw medium writing the same bytes.
    """

    backend: str
    op: str
    shape: str
    tokens: int
    bytes: int
    blocks: int
    median_s: float | None
    p99_s: float | None
    gbps: float | None
    baseline: str
    baseline_s: float | None
    baseline_gbps: float | None
    ratio: float | None
    block_size: int = 16
    ids: str = "scattered"
    requests: int = 1
    reps: int = 0
    note: str = ""
    device: str = "cpu"  # where the KV cache was (Point.device)
    save_s: float | None = None  # save_stall: median of the save's own time (the worker's save_seconds per step)
    stall_frac: float | None = None  # save_stall: median over steps of stall / the save's own time
    cold: bool = True  # every timed call began with the CPU's caches evicted (False: --warm, and sched_step rows)
    interleaved: bool = False  # the baseline was timed round by round with ours (time_interleaved), not apart

    @property
    def measured(self) -> bool:
        return self.median_s is not None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def gbps(nbytes: int, seconds: float | None) -> float | None:
    """Decimal GB/s, as every figure in the tables (``None`` when not measured)."""
    return nbytes / seconds / 1e9 if seconds else None


def make_record(
    backend: str,
    op: str,
    point: Point,
    ours: Timing | None,
    baseline: str,
    base: Timing | None,
    *,
    note: str = "",
    per: int = 1,
    moves_bytes: bool = True,
    warm: bool = False,
    interleaved: bool = False,
) -> Record:
    """A record of ``ours`` beside ``base`` at ``point``; times are divided by ``per`` (per-request figures).
    ``warm``: the case is timed warm whatever the run (``sched_step``); else ``cold`` is the run's.
    ``interleaved``: ``base`` was timed round by round with ``ours`` (:func:`time_interleaved`)."""
    med = ours.median / per if ours else None
    base_med = base.median / per if base else None
    return Record(
        backend=backend,
        op=op,
        shape=point.shape.name,
        tokens=point.tokens,
        bytes=point.nbytes,
        blocks=point.blocks,
        median_s=med,
        p99_s=ours.p99 / per if ours else None,
        gbps=gbps(point.nbytes, med) if moves_bytes else None,
        baseline=baseline,
        baseline_s=base_med,
        baseline_gbps=gbps(point.nbytes, base_med) if moves_bytes else None,
        ratio=base_med / med if med and base_med else None,
        block_size=point.block_size,
        ids=point.ids,
        requests=point.requests,
        reps=len(ours.samples) if ours else 0,
        note=note,
        device=point.device,
        cold=evicting() and not warm,
        interleaved=interleaved and base is not None,
    )


__all__ = [
    "SHAPES",
    "Case",
    "Point",
    "Record",
    "Shape",
    "Timing",
    "gbps",
    "make_record",
    "time_interleaved",
    "time_reps",
]
