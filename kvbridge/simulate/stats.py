"""Figures of ``kvbridge simulate``: per run (ITL, TPOT, TTFT, SLO attainment), medians over seeds with a
distribution-free 95% confidence interval, and goodput over a rate sweep."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from kvbridge.simulate.model import Result


@dataclasses.dataclass(frozen=True)
class Slo:
    """A request meets the SLO when its TTFT and its TPOT (mean time per output token after the first) are
    within bounds; goodput is the highest rate at which ``attainment`` of the requests do."""

    ttft_ms: float = 3000.0
    tpot_ms: float = 15.0
    attainment: float = 0.9


FIGURES = (
    "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_mean_ms", "itl_p50_ms", "itl_p99_ms", "itl_p999_ms",
    "itl_max_ms", "tpot_mean_ms", "tpot_p99_ms", "handoff_mean_ms", "slo_attainment", "preemptions",
)  # fmt: skip


def percentile(values: Sequence[float] | np.ndarray, p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100)."""
    a = np.asarray(values, dtype=float)
    if not a.size:
        return math.nan
    k = max(0, math.ceil(p / 100 * a.size) - 1)
    return float(np.partition(a, k)[k])


def gaps(r: Result) -> np.ndarray:
    """Every inter-token gap of every request (the first token to the second included), seconds."""
    if not r.tokens:
        return np.zeros(0)
    times = np.concatenate(r.tokens)
    ends = np.cumsum([len(t) for t in r.tokens])
    d = np.diff(times)
    keep = np.ones(d.size, bool)
    keep[ends[:-1] - 1] = False  # no gap between one request's last token and the next one's first
    return d[keep]


def ttfts(r: Result) -> np.ndarray:
    return np.asarray([t[0] for t in r.tokens]) - r.arrival


def metrics(r: Result, slo: Slo) -> dict[str, float]:
    """The run's figures, times in ms; ``slo_attainment`` is the share of requests meeting ``slo``."""
    g = gaps(r) * 1e3
    ttft = ttfts(r) * 1e3
    tpot = np.asarray([(t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0 for t in r.tokens]) * 1e3
    good = (ttft <= slo.ttft_ms) & (tpot <= slo.tpot_ms)
    return {
        "ttft_mean_ms": float(ttft.mean()),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_mean_ms": float(g.mean()) if g.size else math.nan,
        "itl_p50_ms": percentile(g, 50),
        "itl_p99_ms": percentile(g, 99),
        "itl_p999_ms": percentile(g, 99.9),
        "itl_max_ms": float(g.max()) if g.size else math.nan,
        "tpot_mean_ms": float(tpot.mean()),
        "tpot_p99_ms": percentile(tpot, 99),
        "handoff_mean_ms": float(r.handoff_s.mean() * 1e3),
        "slo_attainment": float(good.mean()),
        "preemptions": float(r.preemptions),
    }


def median_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """The median and a distribution-free ~95% confidence interval for it (order statistics of the binomial;
    with fewer than 6 values the interval is the whole range)."""
    a = np.sort(np.asarray(values, dtype=float))
    n = a.size
    half = 1.96 * math.sqrt(n) / 2
    lo, hi = max(0, math.floor(n / 2 - half) - 1), min(n - 1, math.ceil(1 + n / 2 + half) - 1)
    return float(np.median(a)), float(a[lo]), float(a[hi])


def summarize(runs: Sequence[dict[str, float]]) -> dict[str, object]:
    """Medians over seeds of every figure (``figure: median``) and their intervals (``ci95: {figure: [lo, hi]}``)."""
    out: dict[str, object] = {}
    ci: dict[str, list[float]] = {}
    for name in FIGURES:
        med, lo, hi = median_ci([r[name] for r in runs])
        out[name] = med
        ci[name] = [lo, hi]
    out["ci95"] = ci
    out["seeds"] = len(runs)
    return out


def goodput(rates: Sequence[float], attainment: Sequence[float], slo: Slo) -> float:
    """The highest swept rate up to which every rate has ``slo.attainment`` of its requests meeting the SLO
    (0 when the lowest rate already misses it)."""
    best = 0.0
    for rate, got in zip(rates, attainment):
        if got + 1e-12 < slo.attainment:
            break
        best = rate
    return best


__all__ = ["FIGURES", "Slo", "gaps", "goodput", "median_ci", "metrics", "percentile", "summarize", "ttfts"]
