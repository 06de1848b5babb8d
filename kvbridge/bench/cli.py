"""``kvbridge bench``: measure the KV transfer cost of every available backend beside its baselines.

With no matrix option it runs a default matrix (a few minutes on a 2-core laptop); ``--quick`` a
small one (seconds). Any of ``--shapes/--tokens/--block-size/--ids/--requests`` switches to the
cartesian product of the values given (defaults for the others).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import TextIO

import torch

from kvbridge.bench.cases import OPS, bench_names, count_cases
from kvbridge.bench.cold import WARM_ENV
from kvbridge.bench.core import SHAPES, Point, Record
from kvbridge.bench.measurer import Measurer, Progress
from kvbridge.bench.recompute import compare, measure_prefill
from kvbridge.bench.report import ProgressBar, legend, plot, recompute_table, stall_table, summary, table
from kvbridge.errors import ConfigError

_8B, _70B = SHAPES["8b"], SHAPES["70b"]
DEFAULT_MATRIX = (
    Point(_8B, 64),
    Point(_8B, 256),
    Point(_8B, 1024),
    Point(_8B, 1024, ids="contiguous"),
    Point(_8B, 1024, block_size=128),
    Point(_8B, 64, requests=4),
    Point(_70B, 256),
)
QUICK_MATRIX = (Point(_8B, 64), Point(_8B, 256))  # with fewer baselines (BackendBench.quick): < 20 s here


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    values = _ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def _output(text: str) -> str:
    """A file to write at the end of the run: its folder must exist now (not after minutes of measuring)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"folder {folder} is not writable")
    return text


def _device(text: str) -> str:
    """``cpu`` or a CUDA device that exists here (checked at start-up, not at the first case)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"--device takes cpu or cuda[:N], got {text!r}") from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"--device takes cpu or cuda[:N], got {text!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"--device {text}: no CUDA device here (torch {torch.__version__})")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here")
    return str(device)


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", type=_names, help="comma-separated (default: every known backend and peer)")
    parser.add_argument("--shapes", type=_names, help=f"comma-separated of {sorted(s for s in SHAPES if s != 'tiny')}")
    parser.add_argument("--tokens", type=_ints, help="tokens per request, comma-separated (e.g. 256,1024)")
    parser.add_argument("--block-size", type=_ints, help="comma-separated, e.g. 16,32,128")
    parser.add_argument("--ids", type=_names, help="block id pattern: contiguous, scattered (comma-separated)")
    parser.add_argument("--requests", type=_ints, help="concurrent requests per step, comma-separated")
    parser.add_argument("--ops", type=_names, help=f"comma-separated of {list(OPS)} (default: all)")
    parser.add_argument("--reps", type=_positive_int, help="timed repetitions per case of 128 MiB or more (default 3; --quick 2); a smaller "
                             "request repeats more, to move about as many bytes (up to 16x; not with --quick)")
    parser.add_argument("--quick", action="store_true", help="a small matrix in seconds")
    parser.add_argument("--device", type=_device, default="cpu",
                        help="where the KV cache lives: cpu (default), or cuda / cuda:N (stores then go through pinned staging)")
    parser.add_argument("--prefill-tps", type=float, default=10_000.0,
                        help="prefill throughput (tokens/s) of the real model, for transfer vs recompute (default 10000)")  # fmt: skip
    parser.add_argument("--warm", action="store_true",
                        help="time back to back, the CPU's caches as the last call left them (default: evicted before "
                             "every timed call, as a forward pass leaves them; see kvbridge.bench.cold)")
    parser.add_argument("--no-recompute", action="store_true", help="skip the transfer vs recompute section")
    parser.add_argument("--json", metavar="PATH", type=_output,
                        help="where every record goes, as a JSON list (the input of `kvbridge simulate --from-bench`); "
                             "default ./kvbridge-bench-<date>-<time>.json (the temp directory where . is not writable)")
    parser.add_argument("--no-save", action="store_true", help="print the tables only; write no JSON")
    parser.add_argument("--plot", metavar="PATH", type=_output, help="write a PNG of GB/s vs transfer size (needs matplotlib)")
    parser.add_argument("--log", metavar="PATH", type=_output, default=None,
                        help="where the measured systems' own output goes (LMCache's log lines, UCX's errors, child "
                             "processes'); default a kvbridge-bench-*.log in the temp directory")


def matrix(args: argparse.Namespace) -> list[Point]:
    """The points to measure, from the options."""
    picked = [args.shapes, args.tokens, args.block_size, args.ids, args.requests]
    device = getattr(args, "device", "cpu")
    if not any(picked):
        return [dataclasses.replace(p, device=device) for p in (QUICK_MATRIX if args.quick else DEFAULT_MATRIX)]
    unknown = [s for s in args.shapes or () if s not in SHAPES]
    if unknown:
        raise ConfigError(f"unknown shape(s) {unknown}; known: {sorted(SHAPES)}")
    bad_ids = [i for i in args.ids or () if i not in ("contiguous", "scattered")]
    if bad_ids:
        raise ConfigError(f"--ids takes contiguous, scattered; got {bad_ids}")
    return [
        Point(SHAPES[s], t, b, i, r, device)
        for s, t, b, i, r in itertools.product(
            args.shapes or ["8b"], args.tokens or ([64, 256] if args.quick else [256, 1024]), args.block_size or [16],
            args.ids or ["scattered"], args.requests or [1],
        )
    ]  # fmt: skip


def measure(args: argparse.Namespace) -> list[Record]:
    """Every record of the run: each backend's cases, then transfer vs recompute."""
    names = args.backends or bench_names()
    unknown_names = [n for n in names if n not in bench_names()]
    if unknown_names:
        raise ConfigError(f"unknown backend(s) {unknown_names}; known: {bench_names()}")
    points = matrix(args)
    reps = args.reps or (2 if args.quick else 3)
    ops = args.ops or list(OPS)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ConfigError(f"unknown op(s) {unknown}; known: {list(OPS)}")
    log_path = getattr(args, "log", None) or os.path.join(tempfile.gettempdir(), f"kvbridge-bench-{os.getpid()}.log")
    records: list[Record] = []
    with third_party_output(log_path) as ours:
        bar = ProgressBar(ours)
        progress = Progress(count_cases(names, points, ops) + (0 if args.no_recompute else 1), bar)
        measurer = Measurer(reps, progress, ops, quick=args.quick)
        try:
            for name in names:
                records += measurer.measure(name, points)
            if not args.no_recompute:
                progress.step("transfer vs recompute: tiny-llama prefill")
                tiny = measure_prefill(256 if args.quick else 512, reps)
                records += compare(records, args.prefill_tps, tiny, reps)
        finally:
            bar.close()
    lines = _count_lines(log_path)
    if lines:
        print(f"kvbridge bench: {lines} lines of the measured systems' own output (warnings, UCX errors) are in {log_path}",
              file=sys.stderr)  # fmt: skip
    return records


@contextlib.contextmanager
def third_party_output(path: str) -> Iterator[TextIO]:
    """While measuring, file descriptors 1 and 2 go to ``path``: LMCache's log lines, UCX's C-level
    warnings and errors (UCX logs to stdout unless ``UCX_LOG_FILE`` says otherwise) and child processes'
    output land there, not across the progress bar or the table. Yields a stream on the real stderr for
    kvbridge's own progress. Where stderr is no file descriptor (embedded), nothing is redirected."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
    except (OSError, ValueError):
        yield sys.stderr
        return
    ours = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield ours
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
                sys.stderr.flush()
            for fd, was in enumerate(saved, start=1):
                os.dup2(was, fd)
                os.close(was)
            ours.close()


def default_results_path() -> str:
    """``./kvbridge-bench-<date>-<time>.json``, or the same name in the temp directory where ``.`` is not
    writable: a run's results are never lost to a missing option."""
    name = time.strftime("kvbridge-bench-%Y%m%d-%H%M%S.json")
    return name if os.access(".", os.W_OK) else os.path.join(tempfile.gettempdir(), name)


def _count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def run(args: argparse.Namespace) -> int:
    if args.warm:
        os.environ[WARM_ENV] = "1"  # this process's evict() and the children's
    records = measure(args)
    shapes = ", ".join(f"{s.name} = {s.bytes_per_token >> 10} KiB/token" for s in SHAPES.values() if s.name != "tiny")
    print(f"kvbridge bench ({shapes}; ratio = ours/baseline in throughput: 1.00 = as fast as the raw medium)\n")
    print(table(records))
    if legend(records):
        print("\n" + legend(records))
    st = stall_table(records)
    if st:
        print(
            "\nforward-pass stall per step caused by saves (stall = the worker's start_step .. finish_step; "
            "save = the save's own time, on the IO thread; base = the raw medium writing the same bytes)\n"
        )
        print(st)
    rc = recompute_table(records)
    if rc:
        print("\ntransfer vs recompute (transfer = the backend's load; prefill at the given tokens/s)\n")
        print(rc)
    if summary(records):
        print("\n" + summary(records))
    path = None if args.no_save else (args.json or default_results_path())
    if path:
        with open(path, "w") as f:
            json.dump([r.as_dict() for r in records], f, indent=1)
        print(f"\nwrote {len(records)} records to {path} (kvbridge simulate --from-bench {path} replays them)")
    if args.plot:
        problem = plot(records, args.plot)
        print(f"\n{problem}" if problem else f"\nwrote {args.plot}", file=sys.stderr if problem else sys.stdout)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run as ``python -m kvbridge.bench.cli``."""
    parser = argparse.ArgumentParser(prog="kvbridge bench", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
