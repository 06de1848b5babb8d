"""Presenting records: a progress line on stderr, tables with every figure beside its baseline, a plot."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

from kvbridge.bench.core import Record


class ProgressBar:
    """One stderr line rewritten in place (``\\r``); plain lines when stderr is not a terminal."""

    def __init__(self, stream: TextIO | None = None, width: int = 24):
        self.stream = stream or sys.stderr
        self.width = width
        self.t0 = time.perf_counter()
        self.tty = self.stream.isatty()
        self._len = 0

    def __call__(self, done: int, total: int, label: str) -> None:
        frac = done / total if total else 1.0
        bar = "#" * round(frac * self.width)
        line = f"[{bar:<{self.width}}] {done + 1}/{total} {time.perf_counter() - self.t0:5.0f}s  {label}"
        if self.tty:
            self.stream.write("\r" + line[:110].ljust(self._len))
            self._len = min(len(line), 110)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._len:
            self.stream.write("\r" + " " * self._len + "\r")
            self.stream.flush()


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def _ours(r: Record) -> tuple[str, str]:
    if r.op == "sched_step":
        return f"{(r.median_s or 0) * 1e6:.1f} us/req", f"{(r.p99_s or 0) * 1e6:.1f} us"
    return f"{r.gbps:.2f} GB/s", f"{(r.p99_s or 0) * 1e3:.1f} ms"


def _base(r: Record) -> str:
    if r.baseline_s is None:
        return "-"
    if r.op == "sched_step":
        return f"{r.baseline_s * 1e6:.1f} us/req"
    return f"{r.baseline_gbps:.2f} GB/s"


def _shape(r: Record) -> str:
    """The model shape, and where the KV cache was when it was not in host memory (``8b@cuda``)."""
    return r.shape if r.device == "cpu" else f"{r.shape}@{r.device}"


def table(records: Sequence[Record]) -> str:
    """The measurement table: ours beside the baseline, and ``ratio`` = ours/baseline in throughput."""
    head = ("backend", "op", "shape", "tokens", "bs", "ids", "req", "size", "ours", "p99", "baseline", "base", "ratio")
    rows: list[tuple[str, ...]] = []
    notes: list[tuple[str, str]] = []
    seen: set[tuple[object, ...]] = set()
    doubtful = False
    for r in records:
        if r.op in ("recompute", "save_stall"):  # their own tables
            continue
        if not r.measured:
            key = (r.backend, r.op, r.shape, r.tokens, r.block_size, r.ids, r.requests, r.note)
            if key not in seen:  # one row, whatever the number of baselines
                seen.add(key)
                where = (_shape(r), str(r.tokens), str(r.block_size), r.ids[:4], str(r.requests)) if r.op != "-" else ()
                rows.append((r.backend, r.op, *where, r.note))
            continue
        ours, p99 = _ours(r)
        ratio = f"{r.ratio:.2f}" if r.ratio else "-"
        if r.ratio and r.ratio > DOUBTFUL and r.op != "sched_step":
            ratio += "?"  # faster than its own medium: the baseline ran slow this time (noise), not us fast
            doubtful = True
        size = "" if r.op == "sched_step" else _size(r.bytes)
        rows.append((r.backend, r.op, _shape(r), str(r.tokens), str(r.block_size), r.ids[:4], str(r.requests), size,
                     ours, p99, r.baseline, _base(r), ratio))  # fmt: skip
        if r.note:
            notes.append((r.backend, r.note))
    text = _grid(head, rows) + "".join(f"\n  {b}: {n}" for b, n in notes)
    if doubtful:
        text += (f"\n  ?: more than {DOUBTFUL:g}x its raw medium, which cannot really be beaten: that baseline ran "
                 "slow in this run (a busy machine); rerun, or read the other sizes")  # fmt: skip
    return text


DOUBTFUL = 1.5  # a ratio above this to the raw medium says more about the baseline's run than about ours

# what each baseline is, in plain words (the legend under the table); a name not here is described by its own row
BASELINES: dict[str, str] = {
    "memcpy": "one torch copy of the same bytes in this process's memory (the medium of memory and cpu)",
    "pcie": "a KV cache on a GPU: one copy of the same bytes between pinned host memory and the device (load: to it)",
    "memcpy:nt": "the same bytes by kvbridge's native copy: streaming stores, cut between two threads (the fastest copy here)",
    "file": "one sequential write / readinto of the same bytes, one file in the store's directory (the medium of fs, and of chain: cpu then fs)",
    "tcp": "a plain TCP socket on loopback between two processes, sending the same bytes",
    "ucxx": "ucxx tag send/recv of one buffer between two processes (the library kvbridge's two-sided path uses)",
    "ucxx-wa": "ucxx tag send/recv, endpoints made from worker addresses with error handling off (the two-sided path's own set-up)",
    "cma": "process_vm_readv of the same blocks from another process, one thread (the strict raw medium of ucx's one-sided cma lane)",
    "cma:2t": "the same process_vm_readv cut in two, on two threads at once (the cma lane's medium as kvbridge reads from 8 MiB)",
    "ucp-get:tcp": "UCX RMA GET over TCP with peer error handling (ucx's one-sided ucp lane between hosts)",
    "ucp-get:sm": "UCX RMA GET over shared memory, error handling off (what UCX alone does on one host)",
    "nixl:tcp": "NIXL (vLLM's NixlConnector library) reading the same blocks over UCX TCP",
    "nixl:tcp+pt": "NIXL over UCX TCP with its progress thread",
    "nixl:sm": "NIXL over UCX shared memory",
    "nixl:sm+pt": "NIXL over UCX shared memory with its progress thread",
    "mooncake:tcp": "Mooncake's transfer engine (vLLM's MooncakeConnector) over TCP",
}


def legend(records: Sequence[Record]) -> str:
    """The baselines of this run, each in plain words."""
    names = sorted({r.baseline for r in records if r.measured and r.baseline and r.op not in ("recompute", "sched_step")})
    if not names:
        return ""
    width = max(len(n) for n in names)
    text = "baselines:\n" + "\n".join(f"  {n:<{width}}  {BASELINES.get(n, 'see its row')}" for n in names)
    paired = sorted({r.baseline for r in records if r.measured and r.interleaved})
    if paired:
        text += (f"\n  timed round by round with ours (one run of each in turn, so a slow minute slows both): "
                 f"{', '.join(paired)}; the others apart, right after the backend's cases")  # fmt: skip
    return text


def summary(records: Sequence[Record]) -> str:
    """The run in a few lines: per op and size, the fastest backend and its ratio to its strictest baseline,
    and which peer transfers beat recomputing the prompt."""
    best: dict[tuple[str, int], Record] = {}
    strictest: dict[tuple[str, str, int], float] = {}
    for r in records:
        if not r.measured or r.op not in ("save", "load", "transfer") or not r.gbps:
            continue
        key = (r.op, r.bytes)
        if key not in best or r.gbps > (best[key].gbps or 0.0):
            best[key] = r
        if r.ratio:
            k2 = (r.backend, r.op, r.bytes)
            strictest[k2] = min(strictest.get(k2, r.ratio), r.ratio)
    lines = []
    for (op, nbytes), r in sorted(best.items()):
        ratio = strictest.get((r.backend, op, nbytes))
        vs = f", {ratio:.2f}x its strictest baseline" if ratio else ""
        lines.append(f"  {op:<8} {_size(nbytes):>9}: fastest {r.backend} at {r.gbps:.2f} GB/s{vs}")
    beats = sorted({f"{r.backend} at {r.tokens} tokens" for r in records
                    if r.op == "recompute" and r.ratio and r.ratio > 1 and r.shape != "tiny-llama"})  # fmt: skip
    if any(r.op == "recompute" for r in records):
        lines.append("  beats recomputing the prompt: " + (", ".join(beats) if beats else "none here"))
    return ("summary:\n" + "\n".join(lines)) if lines else ""


def recompute_table(records: Sequence[Record]) -> str:
    """Transfer vs recompute: transfer time beside the prefill time of the same tokens, and the break-even."""
    head = ("backend", "shape", "tokens", "transfer GB/s", "transfer ms", "prefill ms", "prefill/transfer", "break-even")
    rows = [
        (r.backend, r.shape, str(r.tokens), f"{r.gbps:.2f}", f"{(r.median_s or 0) * 1e3:.1f}",
         f"{(r.baseline_s or 0) * 1e3:.1f} ({r.baseline})", f"{r.ratio:.3f}", r.note)
        for r in records if r.op == "recompute"
    ]  # fmt: skip
    return _grid(head, rows) if rows else ""


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3f} ms" if seconds < 0.01 else f"{seconds * 1e3:.1f} ms"


def stall_table(records: Sequence[Record]) -> str:
    """``save_stall``: per step that saves ``size``, the forward-pass stall (the worker's ``start_step`` …
    ``finish_step``) beside the save's own time and the raw medium writing the same bytes; ``save ratio``
    is the save's throughput over the raw medium's (1.00 = as fast)."""
    head = ("backend", "shape", "tokens", "bs", "ids", "req", "size", "stall", "p99", "save", "stall/save",
            "baseline", "base", "save ratio")  # fmt: skip
    rows: list[tuple[str, ...]] = []
    notes: list[tuple[str, str]] = []
    seen: set[tuple[object, ...]] = set()
    for r in records:
        if r.op != "save_stall":
            continue
        where = (r.backend, r.shape, str(r.tokens), str(r.block_size), r.ids[:4], str(r.requests))
        if not r.measured:
            if (*where, r.note) not in seen:
                seen.add((*where, r.note))
                rows.append((*where, r.note))
            continue
        frac = f"{r.stall_frac * 100:.2f}%" if r.stall_frac is not None else "-"
        ratio = f"{r.baseline_s / r.save_s:.2f}" if r.save_s and r.baseline_s else "-"
        rows.append((*where, _size(r.bytes), _ms(r.median_s), _ms(r.p99_s), _ms(r.save_s), frac, r.baseline,
                     _ms(r.baseline_s), ratio))  # fmt: skip
        if r.note:
            notes.append((r.backend, r.note))
    return (_grid(head, rows) + "".join(f"\n  {b}: {n}" for b, n in notes)) if rows else ""


def _grid(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    # a row shorter than the header ("not measured") ends with a note that spans the rest of the line
    full = [r for r in rows if len(r) == len(head)]
    widths = [
        max([len(h)] + [len(r[i]) for r in rows if i < len(r) - (len(r) < len(head))]) for i, h in enumerate(head)
    ]
    widths = [max([w] + [len(r[i]) for r in full]) for i, w in enumerate(widths)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        cells = (
            [c.ljust(w) for c, w in zip(r[:-1], widths)] + [r[-1]]
            if len(r) < len(head)
            else [c.ljust(w) for c, w in zip(r, widths)]
        )
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def plot(records: Sequence[Record], path: str) -> str | None:
    """GB/s vs transfer size per backend and op, baselines dashed, to a PNG; why not, if it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "plot skipped: matplotlib is not installed; pip install 'kvbridge[bench]'"
    fig, ax = plt.subplots(figsize=(12, 7))
    series: dict[str, list[tuple[int, float]]] = {}
    bases: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if (
            r.op in ("save", "load", "transfer")
            and r.gbps
            and r.requests == 1
            and r.block_size == 16
            and r.ids == "scattered"
        ):
            series.setdefault(f"{r.backend} {r.op}", []).append((r.bytes, r.gbps))
            if r.baseline_gbps:
                bases.setdefault(f"{r.baseline} ({r.op})", []).append((r.bytes, r.baseline_gbps))
    # one hue per backend, its loads and transfers in the dark shade with circles, its saves in the light one with
    # squares: tab20's pairs but its grey (the baselines' colour), then three of tab20b's; 12 hues before one repeats
    tab20, tab20b = matplotlib.color_sequences["tab20"], matplotlib.color_sequences["tab20b"]
    pairs = [tab20[i : i + 2] for i in range(0, 20, 2) if i != 14] + [tab20b[i : i + 2] for i in range(0, 20, 8)]
    backends = sorted({label.rsplit(" ", 1)[0] for label in series})
    for label, pts in sorted(series.items()):
        backend, op = label.rsplit(" ", 1)
        xs, ys = zip(*sorted(set(pts)))
        save = op == "save"
        color = pairs[backends.index(backend) % len(pairs)][save]
        ax.plot([x / (1 << 20) for x in xs], ys, marker="s" if save else "o", color=color, label=label)
    styles = [("--", "."), (":", "x"), ("-.", "+"), ((0, (5, 1)), "^"), ((0, (1, 3)), "v"), ((0, (3, 1, 1, 1)), "s")]
    for i, (label, pts) in enumerate(sorted(bases.items())):  # each baseline its own line style and marker, in grey
        xs, ys = zip(*sorted(set(pts)))
        style, marker = styles[i % len(styles)]
        ax.plot([x / (1 << 20) for x in xs], ys, linestyle=style, marker=marker, color="0.45", alpha=0.8,
                label=f"baseline: {label}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("MiB per transfer (block size 16, scattered ids, 1 request)")
    ax.set_ylabel("GB/s")
    ax.set_title("kvbridge transfer cost beside its baselines (same run)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the lines, not over them
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


__all__ = ["BASELINES", "ProgressBar", "legend", "plot", "recompute_table", "stall_table", "summary", "table"]
