"""A bare paged KV cache driven through a backend's scheduler and worker sides, and the flows a bench case
times over it.

Only the transfer is timed. A :class:`KVPool` fills its KV cache with random bytes once
(``torch.randint``), builds the plan outside the timed region, and times exactly what moves bytes:
``start_step`` … the worker idle again for a save (``finish_step`` only hands a store's save to its
IO thread), ``start_step`` … the ``poll`` that reports the last load for a load (or a peer's pull).
The forward-pass stall a save causes — the worker's calls inside the step, ``start_step`` …
``finish_step`` — is timed apart (:func:`step_saves`, the ``save_stall`` case).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvbridge.bench.core import Point
from kvbridge.contract import Backend, FinishDecision, RequestInfo, Role, ScheduledRequest, StepPlan
from kvbridge.errors import TransferTimeout
from kvbridge.keys import block_keys
from kvbridge.layout import KVLayout
from kvbridge.testing.engine import idle_step, open_engine


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
    "KVPool",
    "end_load",
    "end_save",
    "fill_random",
    "plan_load",
    "plan_save",
    "prompts",
    "request_blocks",
    "requests",
    "run_load",
    "run_save",
    "same_blocks",
    "save_seconds",
    "settle",
    "step_saves",
    "wait_saved",
]
