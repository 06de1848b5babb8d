"""The measurement core: model shapes, benchmark points, timing, records, and a bare paged KV cache
driven through a backend's scheduler and worker sides.

Only the transfer is timed. A :class:`KVPool` fills its KV cache with random bytes once
(``torch.randint``), builds the plan outside the timed region, and times exactly what moves bytes:
``start_step`` … the worker idle again for a save (``finish_step`` only hands a store's save to its
IO thread), ``start_step`` … the ``poll`` that reports the last load for a load (or a peer's pull).
The forward-pass stall a save causes — the worker's calls inside the step, ``start_step`` …
``finish_step`` — is timed apart (:func:`step_saves`, the ``save_stall`` case).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from kvbridge.bench.cold import evict, evicting
from kvbridge.contract import Backend, FinishDecision, RequestInfo, Role, ScheduledRequest, StepPlan
from kvbridge.errors import TransferTimeout
from kvbridge.keys import block_keys
from kvbridge.layout import KVLayout
from kvbridge.testing.engine import idle_step, open_engine

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


def fill_random(t: torch.Tensor, seed: int = 0) -> None:
    """Fill ``t`` with random bytes, once (a real KV cache is incompressible noise to a transport).
    A CUDA tensor gets the same bytes as a CPU one of that seed (drawn on the host, then copied)."""
    if t.device.type != "cpu":
        host = torch.empty(t.shape, dtype=t.dtype)
        fill_random(host, seed)
        t.copy_(host)
        return
    g = torch.Generator().manual_seed(seed)
    flat = t.view(-1).view(torch.int16) if t.element_size() == 2 else t.view(-1).view(torch.uint8)
    lo, hi = (-(2**15), 2**15) if flat.dtype == torch.int16 else (0, 256)
    torch.randint(lo, hi, flat.shape, generator=g, dtype=flat.dtype, out=flat)


def request_blocks(point: Point, num_blocks: int, seed: int, requests: int | None = None) -> list[list[int]]:
    """Each request's block ids (its full blocks and the partial last one): consecutive runs of a random
    permutation of ``num_blocks`` (``point.ids == "scattered"``, seeded) or of ``0..num_blocks``. The one
    rule for the bench's pools, its peers and ucx's two-process case, so they all move the same request."""
    n = point.blocks_per_request + 1
    order = np.random.default_rng(seed).permutation(num_blocks) if point.ids == "scattered" else np.arange(num_blocks)
    return [order[k * n : (k + 1) * n].tolist() for k in range(point.requests if requests is None else requests)]


class KVPool:
    """One engine's side of a benchmark: a paged KV cache of random bytes, a scheduler and a worker.

    ``sets`` disjoint sets of block ids are handed out (``blocks[set][request]``), each request's ids
    a contiguous run or scattered over the whole cache; an engine that plays producer and consumer
    saves from set 0 and loads into set 1.
    """

    def __init__(
        self,
        backend: Backend,
        point: Point,
        *,
        role: Role,
        engine_id: str,
        namespace: str = "bench",
        seed: int = 0,
        sets: int = 1,
        fill: bool = True,
    ):
        self.point = point
        shape = point.shape
        per_request = point.blocks_per_request + 1  # the partial last block of each prompt
        self.num_blocks = per_request * point.requests * sets
        base = torch.empty(
            shape.num_layers,
            self.num_blocks,
            shape.num_kv_heads,
            point.block_size,
            2 * shape.head_size,
            dtype=shape.dtype,
            device=point.device,
        )
        if fill:
            fill_random(base, seed)
        self.layout = KVLayout.from_tensors(
            {f"layer.{i}": base[i] for i in range(shape.num_layers)}, block_size=point.block_size
        )
        self.info, self.scheduler, self.worker = open_engine(
            backend, self.layout, engine_id=engine_id, role=role, namespace=namespace
        )
        runs = [tuple(r) for r in request_blocks(point, self.num_blocks, seed, point.requests * sets)]
        self.blocks = [runs[s * point.requests : (s + 1) * point.requests] for s in range(sets)]

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


def prompts(point: Point, seed: int) -> list[list[int]]:
    """``point.requests`` random prompts of ``tokens + 1`` tokens: every full block is loadable."""
    rng = np.random.default_rng(seed)
    n = point.blocks_per_request * point.block_size + 1
    return [rng.integers(0, 128_000, n).tolist() for _ in range(point.requests)]


def requests(
    pool: KVPool, tag: str, tokens: Sequence[Sequence[int]], params: Sequence[Mapping[str, Any] | None] | None = None
) -> list[RequestInfo]:
    """RequestInfos for ``tokens`` (keys computed here, outside any timed region)."""
    bs, ns = pool.point.block_size, pool.info.namespace
    return [
        RequestInfo(f"{tag}-{i}", tuple(t), tuple(block_keys(t, bs, namespace=ns)), params[i] if params else None)
        for i, t in enumerate(tokens)
    ]


# ---- the flows: plan outside the timer, move bytes inside it ------------------------------------
def plan_save(pool: KVPool, reqs: Sequence[RequestInfo], blocks: Sequence[tuple[int, ...]]) -> StepPlan:
    """Producer scheduler: every request's prompt computed in one step; the plan that saves it."""
    sched = pool.scheduler
    for req, ids in zip(reqs, blocks):
        sched.on_allocated(req, ids, sched.lookup(req, 0).num_tokens)
    return sched.plan_step(
        [ScheduledRequest(r.request_id, ids, 0, r.num_prompt_tokens) for r, ids in zip(reqs, blocks)]
    )


def step_saves(pool: KVPool, plan: StepPlan) -> None:
    """Worker: what the forward pass of a step that saves calls — ``start_step``, the per-layer hooks,
    ``finish_step`` — and waits for (the ``save_stall`` case times this). A store's save goes on after
    it returns, on the worker's IO thread."""
    w = pool.worker
    w.start_step(plan)
    for layer in range(pool.layout.num_layers):
        w.wait_layer(layer)
        w.save_layer(layer)
    w.finish_step()


def wait_saved(pool: KVPool, *, timeout: float = 120.0) -> None:
    """Worker: until no save (or load) of it is in flight (``wait_idle``)."""
    if not pool.worker.wait_idle(timeout):
        raise TransferTimeout(f"{pool.info.engine_id}: the worker is not idle after {timeout}s")


def run_save(pool: KVPool, plan: StepPlan) -> None:
    """Worker: the step's saves, from ``start_step`` until they are over (timed as ``save``)."""
    step_saves(pool, plan)
    wait_saved(pool)


def save_seconds(pool: KVPool) -> float | None:
    """The worker's ``stats.save_seconds`` so far (time inside its store's saves), ``None`` if it keeps none."""
    stats = getattr(pool.worker, "stats", None)
    value = getattr(stats, "save_seconds", None)
    return float(value) if value is not None else None


def end_save(pool: KVPool, reqs: Sequence[RequestInfo], blocks: Sequence[tuple[int, ...]]) -> list[FinishDecision]:
    """Producer: the step's report, then every request ends, then the engine's next (idle) step, which
    tells the worker what it holds for consumers; what each consumer needs."""
    pool.scheduler.on_report(pool.worker.poll())
    decisions = [pool.scheduler.on_finished(r, ids) for r, ids in zip(reqs, blocks)]
    idle_step(pool.scheduler, pool.worker)
    return decisions


def plan_load(pool: KVPool, reqs: Sequence[RequestInfo], blocks: Sequence[tuple[int, ...]]) -> StepPlan:
    """Consumer scheduler: lookup and allocation of every request; the plan that loads them.

    Raises ``RuntimeError`` when the backend cannot supply every full block (nothing to time).
    """
    sched = pool.scheduler
    for req, ids in zip(reqs, blocks):
        n = sched.lookup(req, 0).num_tokens
        want = pool.point.blocks_per_request * pool.point.block_size
        if n != want:
            raise RuntimeError(f"backend offers {n} of {want} tokens for {req.request_id}")
        sched.on_allocated(req, ids, n)
    return sched.plan_step([])


def run_load(pool: KVPool, plan: StepPlan, reqs: Sequence[RequestInfo], *, timeout: float = 120.0) -> frozenset[int]:
    """Worker: start the loads and poll until every request is reported (timed); the failed blocks.

    Between polls it waits on the worker (``wait_idle``, woken when the transfers are over) rather than
    sleeping a fixed interval: a fixed sleep adds up to its length to every load, the harness's time, not
    the backend's (an engine polls once per step, whatever the backend). The wait is bounded (0.2 ms):
    work queued behind a load (a chain's promotion, after the load's report) keeps the worker busy, and
    must not be counted in the load."""
    w, sched = pool.worker, pool.scheduler
    waiting = {r.request_id for r in reqs}
    failed: set[int] = set()
    w.start_step(plan)
    w.finish_step()
    deadline = time.perf_counter() + timeout
    idle = False
    while waiting:
        report = w.poll()
        if report:
            sched.on_report(report)
            waiting -= report.finished_loading
            failed |= report.failed_blocks
        elif time.perf_counter() > deadline:
            raise TransferTimeout(f"loads of {sorted(waiting)} not reported within {timeout}s")
        elif idle:  # idle, yet not reported: a worker whose loads end on a poll of its own (or its wait is a stub)
            time.sleep(0.0001)
        else:
            idle = w.wait_idle(0.0002)
    return frozenset(failed)


def end_load(pool: KVPool, reqs: Sequence[RequestInfo], blocks: Sequence[tuple[int, ...]]) -> None:
    """Consumer: every request ends; what the backend still does with their blocks after the load (a
    chain's promotion) is over before the next sample, which reuses those blocks (untimed)."""
    settle(pool, reqs, [pool.scheduler.on_finished(req, ids) for req, ids in zip(reqs, blocks)])


def settle(
    pool: KVPool, reqs: Sequence[RequestInfo], decisions: Sequence[FinishDecision], *, timeout: float = 60.0
) -> None:
    """Producer: idle steps until every held request is released (a peer's consumer pulled it)."""
    held = {r.request_id for r, d in zip(reqs, decisions) if d.delay_free}
    deadline = time.perf_counter() + timeout
    while held:
        held -= idle_step(pool.scheduler, pool.worker).finished_saving
        if held and time.perf_counter() > deadline:
            raise TransferTimeout(f"producer still holds {sorted(held)} after {timeout}s")
        if held:
            time.sleep(0.0005)


def same_blocks(
    src: KVPool, a_blocks: Sequence[tuple[int, ...]], dst: KVPool, b_blocks: Sequence[tuple[int, ...]]
) -> bool:
    """Did every full block of every request arrive bit-exact? (checked once per point, untimed)."""
    n = src.point.blocks_per_request
    for a, b in zip(a_blocks, b_blocks):
        if not torch.equal(src.layout.gather(a[:n]), dst.layout.gather(b[:n])):
            return False
    return True


__all__ = [
    "SHAPES",
    "KVPool",
    "Point",
    "Record",
    "Case",
    "Shape",
    "Timing",
    "end_load",
    "end_save",
    "fill_random",
    "gbps",
    "make_record",
    "plan_load",
    "plan_save",
    "prompts",
    "requests",
    "run_load",
    "run_save",
    "same_blocks",
    "save_seconds",
    "settle",
    "step_saves",
    "time_interleaved",
    "time_reps",
    "wait_saved",
]
