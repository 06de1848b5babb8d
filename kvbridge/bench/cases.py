"""Benchmark cases per backend and operation, each measured beside its baselines in the same run.

Every backend in :func:`kvbridge.registry.available` is measured; nothing here names the ones that
exist today except to choose their baselines. A backend is built as its conformance target
(:func:`kvbridge.testing.targets.target_for`: the same producer/consumer pair the conformance suite
uses, temp dirs, its own servers), unless its :data:`BENCH` entry brings a ``target`` builder.

Operations: ``save`` and ``load`` for stores, ``transfer`` for peers (the consumer's pull),
``save_stall`` for stores — the forward-pass stall of a step that saves (the worker's ``start_step`` …
``finish_step``) beside the save's own time — and ``sched_step`` for both: scheduler-side ``lookup`` +
``on_allocated`` + ``plan_step`` per request.

To add a backend's baselines, add one :data:`BENCH` entry; to add a third-party system to compare
against, give its :data:`EXTERNAL` entry a ``run``, or, to read the same request as a peer backend
(NIXL, Mooncake, the raw media of ``ucx``), a row in :data:`kvbridge.bench.peers.PEERS`.
:class:`~kvbridge.bench.measurer.Measurer` runs the cases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge import registry
from kvbridge.bench import lmcache_native as _lmcache_native
from kvbridge.bench import ucx_baselines as _ucx_baselines  # noqa: F401 - registers the "ucxx-wa" baseline
from kvbridge.bench.baselines import ON_DEVICE, Unavailable
from kvbridge.bench.core import (
    SHAPES,
    Case,
    Point,
    Timing,
)
from kvbridge.bench.pairs import Pair, StallTiming, load_case, save_case, save_stall_case, time_save_stall
from kvbridge.bench.peers import UCX_PEERS
from kvbridge.contract import BlockLoad
from kvbridge.testing.engine import Target
from kvbridge.testing.targets import target_for


@dataclasses.dataclass(frozen=True)
class BackendBench:
    """How to benchmark one backend: its baselines (one record each) and, optionally, how to build it."""

    baselines: tuple[str, ...] = ("memcpy",)
    target: Callable[[Path, Point], Target] | None = None  # default: kvbridge.testing.targets.target_for
    quick: tuple[str, ...] | None = None  # the baselines of a --quick run (default: all of them)
    # a peer's transfer timed as deployed (its own processes) instead of both engines in the bench's process
    transfer: Callable[[Point, int], Timing] | None = None
    # every load reads a prompt the consumer never saw (a chain's consumer would otherwise read the faster
    # tier it promoted into on the first rep, not the shared one a P/D hand-off reads)
    fresh: bool = False

    def chosen(self, quick: bool, device: str = "cpu") -> tuple[str, ...]:
        """The baselines to measure; for a KV cache on a GPU the host-memory ones become ``pcie``."""
        picked = self.quick if quick and self.quick is not None else self.baselines
        if device == "cpu":
            return picked
        return tuple(dict.fromkeys(ON_DEVICE.get(b, b) for b in picked))


def _cpu(tmp: Path, point: Point) -> Target:
    # room for the saves of one point and the set loaded back; LRU evicts the older ones
    return Target(registry.create("cpu", {"capacity_bytes": 3 * point.nbytes + (64 << 20)}))


def _chain(tmp: Path, point: Point) -> Target:
    """The chain as deployed for P/D: each engine's own ``cpu`` tier in front of a shared ``fs`` directory;
    the consumer's cpu lacks the prompt, so its blocks come from fs (and are promoted into its cpu)."""
    (tmp / "fs").mkdir(exist_ok=True)
    tiers = [{"backend": "cpu", "capacity_bytes": 3 * point.nbytes + (64 << 20)}, {"backend": "fs", "path": str(tmp / "fs")}]
    return Target(registry.create("chain", {"tiers": tiers}), registry.create("chain", {"tiers": tiers}))  # two engines


BENCH: dict[str, BackendBench] = {
    "memory": BackendBench(("memcpy",)),
    "cpu": BackendBench(("memcpy", "memcpy:nt"), _cpu),  # the cpu tier copies with streaming stores
    "chain": BackendBench(("file",), _chain, fresh=True),  # cpu then fs; the consumer reads fs: file's medium
    "fs": BackendBench(("file",)),
    "lmcache": BackendBench(("file",)),  # its bench target's medium is LMCache's disk tier (the arena alone: lmcache:cpu)
    # ucxx-wa: the medium the two-sided path rides (kvbridge/bench/ucx_baselines.py); UCX_PEERS: raw cma and ucp
    # GET, NIXL and Mooncake reading the same request (kvbridge/bench/peers.py)
    # --quick keeps the raw medium of the default lane and the peer a user would pick (the cheap rows of a point).
    # The transfer is timed with the producer in a child process, as deployed and as the peers run: two engines
    # in one process share its allocator and GIL, and read slower than a deployment does.
    "ucx": BackendBench(("ucxx-wa", "ucxx", "tcp", *UCX_PEERS), quick=("cma", "cma:2t", "nixl:sm"),
                        transfer=_ucx_baselines.two_processes),
}
DEFAULT_BENCH = BackendBench()


@dataclasses.dataclass(frozen=True)
class ExternalPeer:
    """A third-party transfer system to compare against: the package to import, and a case once written.

    ``run(point, reps)`` moves ``point.nbytes`` with that system's own API and returns the :class:`Timing` of
    one ``transfer`` row beside ``baselines``; a peer with ``rows`` (row name -> its baselines) returns
    ``{(row, op): Timing}`` instead, one per row and each op of ``ops`` (ops not chosen by ``--ops`` are
    not reported).
    """

    package: str
    run: Callable[[Point, int], Timing | Mapping[tuple[str, str], Timing]] | None = None
    baselines: tuple[str, ...] = ("tcp",)
    rows: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    ops: tuple[str, ...] = ("transfer",)


EXTERNAL: dict[str, ExternalPeer] = {
    # LMCache's own engine (store / retrieve, as its vLLM integration calls them) on its CPU and disk tiers
    "lmcache-native": ExternalPeer("lmcache", _lmcache_native.run, rows=_lmcache_native.ROWS, ops=_lmcache_native.OPS),
}  # NIXL and Mooncake are measured beside ucx, as its baselines (kvbridge/bench/peers.py)

STORE_OPS = ("save", "load", "save_stall", "sched_step")
PEER_OPS = ("transfer", "sched_step")
OPS = ("save", "load", "save_stall", "transfer", "sched_step")  # every op, in the order they run
SCHED_REQUESTS = 16  # requests per scheduler step in sched_step


def bench_names() -> list[str]:
    """Every backend name to measure by default: the registry's, then the external peers."""
    return [*registry.available(), *EXTERNAL]


def medium_env(target: Target, tmp: Path, point: Point | None = None) -> dict[str, Any]:
    """What a baseline must match: the backend's directory (a path option that exists), fsync setting,
    and the size of the objects it writes (``object_bytes``: an fs chunk, whether fs stands alone or is a
    chain's tier; files that large are what the medium is asked to write)."""
    env: dict[str, Any] = {"dir": str(tmp), "fsync": False}
    options = getattr(target.producer, "options", None)
    if dataclasses.is_dataclass(options):
        for f in dataclasses.fields(options):
            value = getattr(options, f.name)
            if isinstance(value, bool) and "fsync" in f.name:
                env["fsync"] = value
            elif isinstance(value, (str, Path)) and str(value) and os.path.isdir(value):
                env["dir"] = str(value)
    tiers = [t for t in getattr(options, "tiers", ()) if isinstance(t, Mapping) and t.get("backend") == "fs"]
    chunk = getattr(options, "chunk_tokens", None) or (tiers[0].get("chunk_tokens", 256) if tiers else None)
    if chunk and point is not None:
        env["object_bytes"] = int(chunk) * point.shape.bytes_per_token
    return env


def _open(name: str, tmp: Path, point: Point) -> Target:
    spec = BENCH.get(name, DEFAULT_BENCH)
    if spec.target is not None:
        return spec.target(tmp, point)
    try:
        return target_for(name, tmp)
    except LookupError as exc:
        raise Unavailable(str(exc)) from None


def sched_floor_case(point: Point) -> Case:
    """What any Python scheduler pays per step (the ``dict`` baseline of ``sched_step``): a C-level set
    intersection of each request's keys with the index, and one BlockLoad per request."""
    keys = [tuple(os.urandom(32) for _ in range(point.blocks_per_request)) for _ in range(point.requests)]
    index = dict.fromkeys(k for ks in keys for k in ks)
    ids = tuple(range(point.blocks_per_request))

    def step(_: object) -> None:
        for i, ks in enumerate(keys):
            _ = len(index.keys() & ks)
            BlockLoad(f"r{i}", ids, ks)

    return Case(lambda i: None, step, lambda s: None, cold=False)


def sched_floor(point: Point, reps: int) -> Timing:
    """:func:`sched_floor_case`, timed."""
    return sched_floor_case(point).time(reps)


@contextlib.contextmanager
def opened(name: str, point: Point) -> Iterator[tuple[Target, Path]]:
    """Backend ``name``'s target for ``point`` in a fresh temp dir; cleaned up and removed on exit."""
    tmp = Path(tempfile.mkdtemp(prefix=f"kvbridge-bench-{name}-"))
    target = None
    try:
        target = _open(name, tmp, point)
        yield target, tmp
    finally:
        if target is not None and target.cleanup is not None:
            target.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def sched_points(points: Sequence[Point]) -> list[Point]:
    """The ``sched_step`` points: one per (tokens, block size), :data:`SCHED_REQUESTS` requests, tiny KV."""
    seen = dict.fromkeys((p.tokens, p.block_size) for p in points)
    return [Point(SHAPES["tiny"], tokens, bs, "scattered", SCHED_REQUESTS) for tokens, bs in seen]


def planned_cases(name: str, points: Sequence[Point], ops: Sequence[str] = OPS) -> int:
    """How many cases backend (or external peer) ``name`` runs at ``points`` (an upper bound)."""
    if name in EXTERNAL:
        return len(points)
    per_point = max(1, len({"save", "load", "save_stall"} & set(ops)))
    return per_point * len(points) + (len(sched_points(points)) if "sched_step" in ops else 0)


def count_cases(names: Sequence[str], points: Sequence[Point], ops: Sequence[str] = OPS) -> int:
    """How many cases :meth:`~kvbridge.bench.measurer.Measurer.measure` runs for ``names`` (for the progress bar; an upper bound)."""
    return sum(planned_cases(n, points, ops) for n in names)


__all__ = [
    "BENCH",
    "DEFAULT_BENCH",
    "EXTERNAL",
    "OPS",
    "BackendBench",
    "Case",
    "ExternalPeer",
    "Pair",
    "StallTiming",
    "bench_names",
    "count_cases",
    "load_case",
    "medium_env",
    "opened",
    "planned_cases",
    "save_case",
    "save_stall_case",
    "sched_floor",
    "sched_floor_case",
    "sched_points",
    "time_save_stall",
]
