"""``kvbridge simulate --plot``: the ITL CDF of each layout at the base rate, and with ``--sweep-rate`` the mean
TTFT and the SLO attainment (goodput marked) against the request rate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _cdf_points(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # quantiles dense in the tail, so that p99 and beyond show on a plot of a few hundred points
    probs = np.unique(np.concatenate([np.linspace(0, 0.9, 91), 1 - np.logspace(-1, -4, 160)]))
    return np.quantile(values, probs), probs


def plot(
    path: str,
    title: str,
    gaps_ms: Mapping[str, np.ndarray],
    sweep: Mapping[str, Any] | None,
    slo: Any,
    rate_label: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if sweep else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), squeeze=False)
    colors = {name: f"C{i}" for i, name in enumerate(gaps_ms)}
    ax = axes[0][0]
    for name, g in gaps_ms.items():
        if g.size:
            x, y = _cdf_points(g)
            ax.plot(np.maximum(x, 1e-3), y, label=name, color=colors[name])
    ax.set_xscale("log")
    ax.set_yscale("function", functions=(lambda p: -np.log10(np.clip(1 - p, 1e-5, 1)),
                                         lambda q: 1 - 10.0 ** (-q)))  # fmt: skip
    ax.set_yticks([0, 0.5, 0.9, 0.99, 0.999, 0.9999])
    ax.set_yticklabels(["0", "0.5", "0.9", "0.99", "0.999", "0.9999"])
    ax.set_ylim(0, 0.9999)
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("CDF (all gaps, all seeds)")
    ax.set_title(f"ITL at {rate_label}", fontsize=10)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if sweep:
        rates: Sequence[float] = sweep["rates"]
        ax = axes[0][1]
        for name, s in sweep["layouts"].items():
            ax.plot(rates, s["ttft_mean_ms"], marker="o", ms=3, label=name, color=colors.get(name))
        ax.axhline(slo.ttft_ms, color="grey", ls=":", lw=1, label=f"TTFT target {slo.ttft_ms:g} ms")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("mean TTFT (ms, median over seeds)")
        ax.set_title("time to first token", fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
        ax = axes[0][2]
        for name, s in sweep["layouts"].items():
            ax.plot(rates, np.asarray(s["slo_attainment"]) * 100, marker="o", ms=3, color=colors.get(name),
                    label=f"{name}: goodput {sweep['goodput_rps'][name]:g}/s")  # fmt: skip
            if sweep["goodput_rps"][name]:
                ax.axvline(sweep["goodput_rps"][name], color=colors.get(name), ls="--", lw=0.8, alpha=0.7)
        ax.axhline(slo.attainment * 100, color="grey", ls=":", lw=1)
        ax.set_ylim(0, 102)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("requests meeting TTFT and TPOT targets (%)")
        ax.set_title(f"goodput: TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    if path.lower().endswith(".png"):
        _palette(path)


def _palette(path: str) -> None:
    """Rewrite a PNG with a 256-colour palette (a few lines on white: a third of the size, no visible loss)."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(256, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


__all__ = ["plot"]
