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
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge import registry
from kvbridge.bench import lmcache_native as _lmcache_native
from kvbridge.bench import ucx_baselines as _ucx_baselines  # noqa: F401 - registers the "ucxx-wa" baseline
from kvbridge.bench.baselines import BASELINES, ON_DEVICE, STEPPED, Unavailable
from kvbridge.bench.core import (
    SHAPES,
    Case,
    Point,
    Record,
    Timing,
    make_record,
    time_interleaved,
)
from kvbridge.bench.pairs import Pair, StallTiming, load_case, save_case, save_stall_case, time_save_stall
from kvbridge.bench.peers import POINT_BASELINES, UCX_PEERS
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


def _not_measured(name: str, op: str, point: Point, baselines: Sequence[str], why: str) -> list[Record]:
    return [make_record(name, op, point, None, b, None, note=f"not measured: {why}") for b in baselines]


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


@dataclasses.dataclass
class _Target:
    name: str
    target: Target
    tmp: Path

    @property
    def kind(self) -> str:
        return self.target.producer.kind


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


@dataclasses.dataclass
class Progress:
    """A callback per case: ``(done, total, label)``."""

    total: int
    report: Callable[[int, int, str], None] = lambda done, total, label: None
    done: int = 0

    def step(self, label: str) -> None:
        self.report(self.done, self.total, label)
        self.done += 1


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


def _planned(name: str, points: Sequence[Point], ops: Sequence[str] = OPS) -> int:
    if name in EXTERNAL:
        return len(points)
    per_point = max(1, len({"save", "load", "save_stall"} & set(ops)))
    return per_point * len(points) + (len(sched_points(points)) if "sched_step" in ops else 0)


def count_cases(names: Sequence[str], points: Sequence[Point], ops: Sequence[str] = OPS) -> int:
    """How many cases :meth:`Measurer.measure` runs for ``names`` (for the progress bar; an upper bound)."""
    return sum(_planned(n, points, ops) for n in names)


# Small requests repeat more: every case of a point moves about as many bytes as ``reps`` repetitions of 128 MiB
# (at most 16x the repetitions), so an 8 MiB median rests on 16x the samples at about the same cost: a small
# sample is over in a millisecond, and the median of three would carry a shared machine's noise.
REPS_BYTES = 128 << 20
MAX_REPS_SCALE = 16


class Measurer:
    """Runs the cases of each backend; baselines are measured once per size, op and medium in this run."""

    def __init__(self, reps: int, progress: Progress | None = None, ops: Sequence[str] = OPS, *, quick: bool = False):
        unknown = sorted(set(ops) - set(OPS))
        if unknown:
            raise ValueError(f"unknown op(s) {unknown}; known: {list(OPS)}")
        self.reps = reps
        self.quick = quick  # BackendBench.quick's baselines only
        self.progress = progress or Progress(0)
        self.ops = tuple(ops)
        self._base: dict[tuple[Any, ...], Timing | str] = {}

    def reps_for(self, point: Point) -> int:
        """The repetitions of ``point``'s cases and baselines: :attr:`reps`, times 128 MiB over the point's bytes (1
        to :data:`MAX_REPS_SCALE`); ``--quick`` keeps :attr:`reps`."""
        if self.quick:
            return self.reps
        return self.reps * max(1, min(MAX_REPS_SCALE, REPS_BYTES // max(1, point.nbytes)))

    def baseline(self, name: str, point: Point, op: str, env: Mapping[str, Any]) -> Timing | str:
        """The baseline's timing, or why it could not be measured. A point-aware one (a peer reading the
        same request, :data:`kvbridge.bench.peers.POINT_BASELINES`) is measured per point."""
        per_point = POINT_BASELINES.get(name)
        size: Any = point if per_point else point.nbytes
        key = (name, size, op, tuple(sorted(env.items())) if name == "file" else ())
        if key not in self._base:
            try:
                reps = self.reps_for(point)
                self._base[key] = per_point(point, reps) if per_point else BASELINES[name](point.nbytes, op, env, reps)
            except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported, not raised
                self._base[key] = f"baseline {name} not measured: {exc}"
        return self._base[key]

    def _records(
        self,
        name: str,
        op: str,
        point: Point,
        ours: Timing | None,
        baselines: Sequence[str],
        env: Mapping[str, Any],
        note: str,
        paired: Mapping[tuple[str, str], Timing | str] | None = None,
    ) -> list[Record]:
        """One record per baseline: the one timed round by round with ours (``paired[op, b]``) where there
        is one, else the baseline measured apart (:meth:`baseline`)."""
        out = []
        for b in baselines:
            together = (paired or {}).get((op, b))
            base = together if together is not None else self.baseline(b, point, op, env) if ours else None
            out.append(
                make_record(
                    name,
                    op,
                    point,
                    ours,
                    b,
                    base if isinstance(base, Timing) else None,
                    note=note or (base if isinstance(base, str) else getattr(base, "note", "")),
                    interleaved=together is not None,
                )
            )
        return out

    def _stall_records(
        self,
        name: str,
        point: Point,
        ours: StallTiming | None,
        baselines: Sequence[str],
        env: Mapping[str, Any],
        note: str,
        paired: Mapping[tuple[str, str], Timing | str] | None = None,
    ) -> list[Record]:
        """``save_stall`` rows: the stall beside the save's own time, and the raw medium writing the same
        bytes (the ``save`` baseline, measured once for both)."""
        out = []
        for b in baselines:
            together = (paired or {}).get(("save", b))  # the save's, where it was timed with the save's case
            base = together if together is not None else self.baseline(b, point, "save", env) if ours else None
            record = make_record(
                name,
                "save_stall",
                point,
                ours.stall if ours else None,
                b,
                base if isinstance(base, Timing) else None,
                note=note or (base if isinstance(base, str) else getattr(base, "note", "")),
                moves_bytes=False,
            )
            if ours:
                record = dataclasses.replace(record, save_s=ours.save.median, stall_frac=ours.frac)
            out.append(record)
        return out

    def measure(self, name: str, points: Sequence[Point]) -> list[Record]:
        """Every case (of :attr:`ops`) of backend (or external peer) ``name`` at ``points``."""
        end = self.progress.done + _planned(name, points, self.ops)
        try:
            return self._measure(name, points)
        finally:
            self.progress.done = end

    def _measure(self, name: str, points: Sequence[Point]) -> list[Record]:
        if name in EXTERNAL:
            return self._external(name, points)
        spec = BENCH.get(name, DEFAULT_BENCH)
        problem = registry.check(name)
        if problem:
            self.progress.step(f"{name}: not available")
            return _not_measured(name, "-", points[0], spec.chosen(self.quick), problem)
        records: list[Record] = []
        if self.quick and getattr(registry.get(name), "kind", "store") == "peer":
            points = points[-1:]  # a peer's point costs seconds of child processes: --quick measures one
        for point in points:
            records += self._point(name, spec, point)
        for point in sched_points(points) if "sched_step" in self.ops else ():
            self.progress.step(f"{name} sched_step {point.label()}")
            records += self._sched(name, point)
        return records

    def _ops(self, peer: bool) -> list[str]:
        return [op for op in (("transfer",) if peer else ("save", "load", "save_stall")) if op in self.ops]

    def _point(self, name: str, spec: BackendBench, point: Point) -> list[Record]:
        records: list[Record] = []
        peer = getattr(registry.get(name), "kind", "store") == "peer"
        if not self._ops(peer):
            return records  # none of the chosen ops applies: the backend is not even opened
        bases = spec.chosen(self.quick, point.device)
        if peer and point.device != "cpu":
            why = "a peer's transfer is benched from host memory (its GPU path: tests/test_gpu.py)"
            return _not_measured(name, "transfer", point, bases, why)
        if peer and spec.transfer is not None:
            return self._deployed(name, spec, point, spec.transfer)
        try:
            with opened(name, point) as (target, tmp):
                peer = target.producer.kind == "peer"
                ops = self._ops(peer)
                pair = Pair(target, point)
                env = medium_env(target, tmp, point) | {"fresh": spec.fresh, "device": point.device}
                timed: list[tuple[str, Timing | StallTiming | None, str]] = []
                paired: dict[tuple[str, str], Timing | str] = {}  # (op, baseline): timed with the op's case
                try:
                    for op in ops:
                        self.progress.step(f"{name} {op} {point.label()}")
                        try:
                            timed.append((op, self._time(op, pair, peer, spec.fresh, bases, env, paired), ""))
                        except Exception as exc:  # noqa: BLE001 - one failing case is a row, not a crash
                            timed.append((op, None, f"not measured: {type(exc).__name__}: {exc}"))
                finally:
                    pair.close()
                # the other baselines right after, with the backend's engines closed: their threads (a
                # spinning one costs a core of two) must not slow the raw medium or a peer down
                for op, ours, note in timed:
                    if op == "save_stall":
                        stall = ours if isinstance(ours, StallTiming) else None
                        records += self._stall_records(name, point, stall, bases, env, note, paired)
                    else:
                        plain = ours if isinstance(ours, Timing) else None
                        records += self._records(name, op, point, plain, bases, env, note, paired)
        except Exception as exc:  # noqa: BLE001 - the backend would not start
            records += _not_measured(name, "-", point, bases, f"{type(exc).__name__}: {exc}")
        return records

    def _deployed(self, name: str, spec: BackendBench, point: Point, transfer: Callable[[Point, int], Timing]) -> list[Record]:
        """A peer's ``transfer`` row timed by ``transfer(point, reps)`` in processes of its own."""
        self.progress.step(f"{name} transfer {point.label()} (producer in a child process)")
        try:
            ours: Timing | None = transfer(point, self.reps_for(point))
            note = ""
        except Exception as exc:  # noqa: BLE001 - one failing case is a row, not a crash
            ours, note = None, f"not measured: {type(exc).__name__}: {exc}"
        return self._records(name, "transfer", point, ours, spec.chosen(self.quick), {}, note)

    def _time(
        self,
        op: str,
        pair: Pair,
        peer: bool,
        fresh: bool = False,
        baselines: Sequence[str] = (),
        env: Mapping[str, Any] | None = None,
        paired: dict[tuple[str, str], Timing | str] | None = None,
    ) -> Timing | StallTiming:
        """Op ``op``'s case timed; those of ``baselines`` that run in this process (:data:`STEPPED`) are
        timed round by round with it, their timings (or why they could not run) put in ``paired``."""
        reps = self.reps_for(pair.point)
        if op == "save_stall":
            return time_save_stall(pair, reps)
        case = save_case(pair) if op == "save" else load_case(pair, peer=peer, fresh=fresh)
        stepped = [b for b in baselines if b in STEPPED]
        if not stepped or paired is None:
            return case.time(reps)
        return self._interleaved(case, stepped, pair.point, op, env or {}, reps, paired)

    @staticmethod
    def _interleaved(
        case: Case,
        baselines: Sequence[str],
        point: Point,
        op: str,
        env: Mapping[str, Any],
        reps: int,
        paired: dict[tuple[str, str], Timing | str],
    ) -> Timing:
        """``case`` and each baseline's case timed round by round (:func:`time_interleaved`); ours, or its error.
        A baseline that cannot start, or fails on the way, is reported in its row; ours is measured anyway."""
        with contextlib.ExitStack() as stack:
            cases, names = [case], []
            for b in baselines:
                try:
                    cases.append(stack.enter_context(STEPPED[b](point.nbytes, op, env)))
                    names.append(b)
                except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported, not raised
                    paired[op, b] = f"baseline {b} not measured: {exc}"
            ours, *theirs = time_interleaved(cases, reps)
        for b, got in zip(names, theirs):
            paired[op, b] = got if isinstance(got, Timing) else f"baseline {b} not measured: {got}"
        if isinstance(ours, Exception):
            raise ours
        return ours

    def _sched(self, name: str, point: Point) -> list[Record]:
        try:
            with opened(name, point) as (target, _tmp):
                pair = Pair(target, point)
                try:
                    case = load_case(pair, peer=target.producer.kind == "peer", timed="plan")
                    ours: Timing | None = case.time(self.reps)
                    note = ""
                finally:
                    pair.close()
        except Exception as exc:  # noqa: BLE001
            ours, note = None, f"not measured: {type(exc).__name__}: {exc}"
        base = sched_floor(point, self.reps) if ours else None
        return [
            make_record(name, "sched_step", point, ours, "dict", base, note=note, per=point.requests, moves_bytes=False,
                        warm=True)
        ]

    def _external(self, name: str, points: Sequence[Point]) -> list[Record]:
        peer = EXTERNAL[name]
        rows = dict(peer.rows) or {name: peer.baselines}
        ops = [op for op in peer.ops if op in self.ops]
        if not ops:
            return []  # none of the chosen ops applies
        if importlib.util.find_spec(peer.package) is None:
            why = f"{peer.package} not installed"
            return [r for row, bases in rows.items() for r in _not_measured(row, "-", points[0], bases, why)]
        if peer.run is None:
            why = f"{peer.package} is installed but has no bench case yet (EXTERNAL[{name!r}].run in kvbridge/bench/cases.py)"
            return [r for row, bases in rows.items() for r in _not_measured(row, "-", points[0], bases, why)]
        records: list[Record] = []
        for point in points:
            self.progress.step(f"{name} {point.label()} (external)")
            if point.device != "cpu":
                why = f"{name}'s case runs on host memory"
                records += [r for row, bases in rows.items() for r in _not_measured(row, "-", point, bases, why)]
                continue
            try:
                got, note = peer.run(point, self.reps_for(point)), ""
            except Exception as exc:  # noqa: BLE001
                got, note = None, f"not measured: {type(exc).__name__}: {exc}"
            timings = got if isinstance(got, Mapping) else {(name, "transfer"): got} if got is not None else {}
            for row, bases in rows.items():
                for op in ops:
                    ours = timings.get((row, op))
                    why = note or ("" if ours else f"not measured: {name}'s case gave no {op} figure for {row}")
                    records += self._records(row, op, point, ours, bases, {}, why)
        return records


__all__ = [
    "BENCH",
    "DEFAULT_BENCH",
    "EXTERNAL",
    "OPS",
    "BackendBench",
    "Case",
    "ExternalPeer",
    "Measurer",
    "Pair",
    "Progress",
    "StallTiming",
    "bench_names",
    "count_cases",
    "load_case",
    "medium_env",
    "opened",
    "save_case",
    "save_stall_case",
    "sched_floor",
    "sched_floor_case",
    "sched_points",
    "time_save_stall",
]
