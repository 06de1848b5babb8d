"""Cases that drive a producer and a consumer engine pool of one point: a store's save, the forward-pass
stall of a step that saves, and the consumer's load (or a peer's pull). Shared by :mod:`kvbridge.bench.cases`
(kvbridge's backends) and :mod:`kvbridge.bench.lmcache_native` (the lmcache tier beside LMCache's own engine).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

from kvbridge.bench.baselines import Unavailable
from kvbridge.bench.core import Case, Point, Timing
from kvbridge.bench.pool import (
    KVPool,
    end_load,
    end_save,
    plan_load,
    plan_save,
    prompts,
    requests,
    run_load,
    run_save,
    same_blocks,
    save_seconds,
    settle,
    step_saves,
    wait_saved,
)
from kvbridge.contract import RequestInfo
from kvbridge.testing.engine import Target


class Pair:
    """Producer and consumer pools of one point; one pool with two block sets when the target serves one engine."""

    def __init__(self, target: Target, point: Point):
        self.point = point
        if target.consumer is None:
            self.prod = self.cons = KVPool(target.producer, point, role="both", engine_id="solo", sets=2)
            self.pblocks, self.cblocks = self.prod.blocks
        else:
            self.prod = KVPool(target.producer, point, role="producer", engine_id="producer", seed=1)
            self.cons = KVPool(target.consumer, point, role="consumer", engine_id="consumer", seed=2, fill=False)
            self.pblocks, self.cblocks = self.prod.blocks[0], self.cons.blocks[0]

    def save_plan(self, tag: str, seed: int) -> tuple[list[RequestInfo], Any]:
        reqs = requests(self.prod, tag, prompts(self.point, seed))
        return reqs, plan_save(self.prod, reqs, self.pblocks)

    def produce(self, tag: str, seed: int) -> tuple[list[RequestInfo], list[Any], list[Mapping[str, Any] | None]]:
        reqs, plan = self.save_plan(tag, seed)
        run_save(self.prod, plan)
        decisions = end_save(self.prod, reqs, self.pblocks)
        return reqs, decisions, [d.transfer_params for d in decisions]

    def close(self) -> None:
        self.prod.close()
        if self.cons is not self.prod:
            self.cons.close()


def _check_failed(failed: frozenset[int]) -> None:
    if failed:
        raise Unavailable(f"{len(failed)} blocks failed to load")


def save_case(pair: Pair, tag: str = "save", seed: int = 1000) -> Case:
    """A store's save of every request's prompt (fresh keys each time), from ``start_step`` until the
    save is over (``finish_step`` only hands it to the worker's IO thread; the worker idle again)."""

    def setup(i: int) -> tuple[list[RequestInfo], Any]:
        reqs, plan = pair.save_plan(f"{tag}{i}", seed + i)
        saved = sum(len(s.block_ids) for s in plan.saves)
        if saved != pair.point.blocks:
            raise Unavailable(f"the plan saves {saved} of {pair.point.blocks} blocks (store too small?)")
        os.sync()  # every save starts with no dirty pages behind it, as the file baseline's writes do
        return reqs, plan

    return Case(setup, lambda s: run_save(pair.prod, s[1]), lambda s: end_save(pair.prod, s[0], pair.pblocks))


@dataclasses.dataclass(frozen=True)
class StallTiming:
    """The ``save_stall`` figures, one sample of each per step: ``stall`` — the worker's calls on the
    forward path (``start_step`` … ``finish_step``) — and ``save``, the save's own time."""

    stall: Timing
    save: Timing

    @property
    def fractions(self) -> tuple[float, ...]:
        """Per step: the stall as a fraction of that step's save."""
        return tuple(a / b for a, b in zip(self.stall.samples, self.save.samples))

    @property
    def frac(self) -> float:
        return statistics.median(self.fractions)


def save_stall_case(pair: Pair, saves: list[float]) -> Case:
    """A step that saves every request's prompt (fresh keys each time) through the real worker, driven
    as the forward pass drives it: plan with the saves, then ``start_step``, the per-layer hooks,
    ``finish_step``.

    Timed: those calls (:func:`~kvbridge.bench.pool.step_saves`) — the stall the forward pass sees.
    Untimed, in teardown: the worker idle again (``wait_idle``), then the save's own time is appended
    to ``saves``: the worker's ``stats.save_seconds`` over the step (time inside the store's ``save``
    on the IO thread), or, for a worker that keeps none, ``start_step`` until idle. A failed save
    makes the case unmeasurable (the figures would be of no save).
    """
    save = save_case(pair, "stall", 5000)  # keys of their own: a point's save case stored its own already

    def setup(i: int) -> dict[str, Any]:
        reqs, plan = save.setup(i)
        stats = getattr(pair.prod.worker, "stats", None)
        failures = getattr(stats, "save_failures", 0)
        before = save_seconds(pair.prod)
        return {"reqs": reqs, "plan": plan, "failures": failures, "before": before, "t0": time.perf_counter()}

    def teardown(s: dict[str, Any]) -> None:
        wait_saved(pair.prod)
        done = time.perf_counter() - s["t0"]
        stats = getattr(pair.prod.worker, "stats", None)
        if getattr(stats, "save_failures", 0) != s["failures"]:
            raise Unavailable("a save failed (see the log)")
        after = save_seconds(pair.prod)
        own = after - s["before"] if after is not None and s["before"] is not None else 0.0
        saves.append(own if own > 0 else done)
        end_save(pair.prod, s["reqs"], pair.pblocks)

    return Case(setup, lambda s: step_saves(pair.prod, s["plan"]), teardown)


def time_save_stall(pair: Pair, reps: int) -> StallTiming:
    """:func:`save_stall_case`, timed: the stall and the save's own time of the same ``reps`` steps."""
    saves: list[float] = []
    stall = save_stall_case(pair, saves).time(reps)
    return StallTiming(stall, Timing(tuple(saves[-len(stall.samples) :])))


def load_case(pair: Pair, *, peer: bool, timed: str = "load", fresh: bool = False) -> Case:
    """The consumer's side: ``timed="load"`` times the pull, ``timed="plan"`` the scheduler's part
    (lookup + on_allocated + plan_step of every request).

    Stores are saved to once (and loaded from every time) unless ``fresh``; a peer's producer produces
    for every pull and is settled (released) after it. The first pull is checked bit-exact.
    """
    cons, prod = pair.cons, pair.prod
    fixed = None if peer or fresh else pair.produce("fixed", 7)
    checked = False

    def setup(i: int) -> dict[str, Any]:
        preqs, decisions, params = pair.produce(f"p{i}", 2000 + i) if fixed is None else fixed
        creqs = requests(cons, f"c{i}", [r.prompt_token_ids for r in preqs], params)
        plan = None if timed == "plan" else plan_load(cons, creqs, pair.cblocks)
        return {"preqs": preqs, "dec": decisions, "creqs": creqs, "plan": plan}

    def pull(s: dict[str, Any]) -> None:
        _check_failed(run_load(cons, s["plan"], s["creqs"]))

    def schedule(s: dict[str, Any]) -> None:
        s["plan"] = plan_load(cons, s["creqs"], pair.cblocks)

    def teardown(s: dict[str, Any]) -> None:
        nonlocal checked
        if timed == "plan":
            pull(s)
        if not checked:
            if not same_blocks(prod, pair.pblocks, cons, pair.cblocks):
                raise Unavailable("loaded blocks differ from the saved ones")
            checked = True
        end_load(cons, s["creqs"], pair.cblocks)
        if peer:
            settle(prod, s["preqs"], s["dec"])

    return Case(setup, schedule if timed == "plan" else pull, teardown, cold=timed != "plan")
