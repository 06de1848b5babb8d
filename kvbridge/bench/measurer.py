"""Running the bench: :class:`Measurer` times each backend's cases (:mod:`kvbridge.bench.cases`) at each
point and puts every figure beside its baselines, measured once per size, op and medium in the run."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvbridge import registry
from kvbridge.bench.baselines import BASELINES, STEPPED
from kvbridge.bench.cases import (
    BENCH,
    DEFAULT_BENCH,
    EXTERNAL,
    OPS,
    BackendBench,
    medium_env,
    opened,
    planned_cases,
    sched_floor,
    sched_points,
)
from kvbridge.bench.core import Case, Point, Record, Timing, make_record, time_interleaved
from kvbridge.bench.pairs import Pair, StallTiming, load_case, save_case, time_save_stall
from kvbridge.bench.peers import POINT_BASELINES


@dataclasses.dataclass
class Progress:
    """A callback per case: ``(done, total, label)``."""

    total: int
    report: Callable[[int, int, str], None] = lambda done, total, label: None
    done: int = 0

    def step(self, label: str) -> None:
        self.report(self.done, self.total, label)
        self.done += 1



def _not_measured(name: str, op: str, point: Point, baselines: Sequence[str], why: str) -> list[Record]:
    return [make_record(name, op, point, None, b, None, note=f"not measured: {why}") for b in baselines]


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
        end = self.progress.done + planned_cases(name, points, self.ops)
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


__all__ = ["MAX_REPS_SCALE", "REPS_BYTES", "Measurer", "Progress"]
