"""What crosses vLLM's processes: the step's plan for the workers (:class:`KVBridgeMetadata`) and the
counters the workers and the scheduler send back (:class:`KVBridgeStats`, gathered per step by
:class:`Counters`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvbridge.contract import (
    EMPTY_PLAN,
    SchedulerSide,
    StepPlan,
    WorkerSide,
)
from kvbridge.stats import TransferStats
from kvbridge.vllm.compat import KVConnectorMetadata, KVConnectorStats
from kvbridge.vllm.prom import TIER_SEP

# ---- what crosses processes --------------------------------------------------------------------


@dataclasses.dataclass
class KVBridgeMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for the workers: the backend's plan, requests whose ``finished_saving``
    report the workers must not pass on (vLLM already holds their blocks itself, see
    :meth:`SchedulerAdapter.request_finished`), and whether the step is ``idle``: no tokens scheduled,
    vLLM runs it only to collect finished transfers (every request waits for a load, or for a save
    to release its blocks)."""

    plan: StepPlan = EMPTY_PLAN
    muted: tuple[str, ...] = ()
    idle: bool = False


@dataclasses.dataclass
class KVBridgeStats(KVConnectorStats):  # type: ignore[misc]
    """:class:`~kvbridge.stats.TransferStats` counters of every rank and both sides, summed.

    ``data`` maps counter names (``loads``, ``load_bytes``, ``load_seconds``, ``failed_blocks``,
    ``saves``, ``hits``, ``corrupt``, ...) to numbers; :meth:`reduce` adds mean latencies and rates.
    """

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: Any) -> KVBridgeStats:
        self.data = TransferStats.merge(self.data, dict(getattr(other, "data", {}) or {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = {k: v for k, v in self.data.items() if v}
        for op in ("load", "save"):
            n, secs, nbytes = d.get(f"{op}s", 0), d.get(f"{op}_seconds", 0.0), d.get(f"{op}_bytes", 0)
            if n:
                d[f"{op}_ms_mean"] = round(1e3 * secs / n, 3)
            if secs:
                d[f"{op}_GBps"] = round(nbytes / secs / 1e9, 3)
        return d

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _tier_stats(side: Any) -> list[tuple[str, TransferStats]]:
    """A chain's tiers' own counters, each under ``tier:<name>:`` (its backend's name; ``name.i`` where two
    tiers share one), so that per-tier loads, saves and hits reach vLLM (:mod:`kvbridge.vllm.prom`)."""
    holder = next((h for h in (side, getattr(side, "index", None), getattr(side, "io", None)) if hasattr(h, "tiers")), None)
    names, tiers = list(getattr(holder, "names", None) or ()), list(getattr(holder, "tiers", None) or ())
    out = []
    for i, (name, tier) in enumerate(zip(names, tiers)):
        stats = getattr(tier, "stats", None)
        if isinstance(stats, TransferStats):
            out.append((f"tier{TIER_SEP}{name if names.count(name) == 1 else f'{name}.{i}'}{TIER_SEP}", stats))
    return out


class Counters:
    """Per-step stats for vLLM (taken each step) and lifetime totals (for tests and debugging)."""

    def __init__(self, side: SchedulerSide | WorkerSide):
        self._parts = ([("", side.stats)] if side.stats is not None else []) + _tier_stats(side)
        self._totals: dict[str, Any] = {}

    def _collect(self, take: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for prefix, stats in self._parts:
            out.update((prefix + k, v) for k, v in (stats.take() if take else stats.as_dict()).items())
        return out

    def take(self) -> KVBridgeStats | None:
        if not self._parts:
            return None
        step = self._collect(take=True)
        self._totals = TransferStats.merge(self._totals, step)
        return KVBridgeStats(data=step) if any(step.values()) else None

    def totals(self) -> dict[str, Any]:
        return TransferStats.merge(self._totals, self._collect(take=False))


