"""The life of a request's transfers, written once: what every backend's two sides share.

A request's KV moves through a fixed sequence, whatever the medium::

    offered (lookup) -> allocated -> load planned -> loading -> loaded | failed -> ... -> ended
                                                                 saving -> saved ----^   (held until idle)

Backends only move bytes; the bookkeeping of that sequence lives here, in two objects:

- :class:`LoadBook` — on the scheduler side. Which requests have a load planned (not yet handed to
  a worker) or in flight, which load failed (such a request is never offered a load again: an engine
  asks anew after a failure that left nothing computed, and a backend still claiming the blocks
  would fail forever), the failed blocks of a report attributed to their request, and at a
  request's end the one decision there is: drop a load never started, or hold the blocks of one in
  flight until the worker says it is over.
- :class:`Transfers` — on the worker side. Loads and saves run on one background thread per worker
  (first in, first out: a load planned after a save of the same key reads what that save wrote), or
  on a backend's own native threads (``post``, ``post_save``), which a store uses only when nothing
  is queued on that thread; it records which requests finished loading, which blocks failed, and
  reports a *held* request in ``finished_saving`` once nothing reads or writes its blocks any more.
  Work a load leaves behind (a chain's promotion, ``after_load``) waits until the poll that reports
  the load: it then competes with the engine's next step, not with the engine learning of the load.
  The background thread waits for work as ``SCHED_BATCH`` on Linux: woken by the engine's own calls, it
  never takes the engine thread's core from it at once (:func:`_idle_batch`).

Both are thread-safe where they must be (``Transfers``: the engine thread and the IO thread) and cost
nothing per block: the unit of work is one request's load or save.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvbridge.contract import BlockLoad, WorkerReport
from kvbridge.errors import ClosedError

log = logging.getLogger(__name__)

POSTED_SLICE_S = 0.001  # how often a wait over posted loads and IO-thread work beside them looks at the latter


class Running(Protocol):
    """A transfer running where no Python thread waits on it (e.g. a :class:`kvbridge._core.Job`)."""

    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


# what a posted load gives once over: its failed block ids, or the rest of it to run on the IO thread
Finish = Callable[[], "Iterable[int] | Callable[[], Iterable[int]]"]


class Ending(enum.Enum):
    """What a request's end means for its load (:meth:`LoadBook.finish`)."""

    NO_LOAD = "no load"  # none planned, or it was reported: the blocks are free to go
    DROPPED = "dropped"  # planned but never handed to a worker: forgotten, the blocks are free to go
    IN_FLIGHT = "in flight"  # a worker may still write the blocks: hold them (delay_free) until it reports


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """A load a worker reported over, with the blocks of it that did not arrive."""

    op: BlockLoad
    failed: frozenset[int]

    @property
    def ok(self) -> bool:
        return not self.failed


class LoadBook:
    """Scheduler-side record of every request's load, from plan to report. See the module docstring."""

    def __init__(self) -> None:
        self._planned: dict[str, BlockLoad] = {}  # not yet in a plan
        self._in_flight: dict[str, BlockLoad] = {}  # in a plan, not yet reported
        self._failed: set[str] = set()  # live requests whose load failed
        self._held: list[str] = []  # ended with a load in flight: the next plan names them
        self._ended: set[str] = set()  # ended with a load in flight, not yet reported

    def failed_before(self, request_id: str) -> bool:
        """Whether this request's load failed: it must not be offered one again (``Lookup(0)``)."""
        return request_id in self._failed

    def plan(self, op: BlockLoad) -> None:
        """A load for ``op.request_id`` (at allocation); it goes out with the next :meth:`take`."""
        self._planned[op.request_id] = op

    def planned(self, request_id: str) -> BlockLoad | None:
        return self._planned.get(request_id) or self._in_flight.get(request_id)

    def take(self) -> tuple[tuple[BlockLoad, ...], tuple[str, ...]]:
        """This step's loads and held requests (for :class:`~kvbridge.contract.StepPlan`); now in flight."""
        loads = tuple(self._planned.values())
        self._in_flight.update(self._planned)
        self._planned.clear()
        held, self._held = tuple(self._held), []
        return loads, held

    def report(self, report: WorkerReport) -> list[LoadResult]:
        """The loads ``report`` says are over, each with its own failed blocks (a report names only
        block ids: an engine's wire carries no more). A failure is remembered until the request ends."""
        results = []
        for rid in report.finished_loading:
            op = self._in_flight.pop(rid, None)
            if op is None:
                continue
            failed = frozenset(b for b in op.block_ids if b in report.failed_blocks)
            if rid in self._ended:  # its request is gone: nothing to guard (a new one may reuse the id)
                self._ended.discard(rid)
            elif failed:
                self._failed.add(rid)
            results.append(LoadResult(op, failed))
        return results

    def finish(self, request_id: str) -> tuple[Ending, BlockLoad | None]:
        """The request ended: what becomes of its load, and the load itself (to release what it reserved;
        for ``IN_FLIGHT`` it is released when :meth:`report` returns it)."""
        self._failed.discard(request_id)
        op = self._planned.pop(request_id, None)
        if op is not None:
            return Ending.DROPPED, op
        op = self._in_flight.get(request_id)
        if op is not None:
            self._held.append(request_id)
            self._ended.add(request_id)
            return Ending.IN_FLIGHT, op
        return Ending.NO_LOAD, None


Failed = Sequence[int]  # block ids that did not arrive


def _policy(batch: bool) -> None:
    """Make the calling thread SCHED_BATCH (``batch``) or SCHED_OTHER again (Linux; elsewhere, or where refused,
    nothing changes)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH if batch else os.SCHED_OTHER, os.sched_param(0))


def _idle_batch() -> None:
    """The IO thread waits for work as SCHED_BATCH: it is woken by the engine's own calls (a poll queues a chain's
    promotion), and on a busy core the woken thread took the core from the engine's thread at once, which then
    waited ~2 ms to go on (a quarter of the 32 MiB chain loads here). A batch thread that wakes does not preempt;
    it runs on an idle core, or at the next tick. Each job then runs as SCHED_OTHER (:meth:`Transfers._settle`),
    so a thread it makes (a thread pool's, a library's) does not inherit the batch policy."""
    _policy(True)


class Transfers:
    """Worker-side loads and saves of every request, on one background thread. See the module docstring.

    ``load(op, fn)`` runs ``fn() -> failed block ids`` (a raise fails every block of ``op``);
    ``save(request_id, fn)`` runs ``fn()`` (a raise is logged and counted by ``on_save_error``, never
    failing the request). ``hold(ids)``: these requests ended; report each in ``finished_saving`` once
    it has nothing in flight. ``post(op, running, finish)`` and ``post_save(request_id, running,
    finish)``: a load or a save a backend already started elsewhere (a native thread), finished by
    whoever polls or waits once it is over. ``after_load(request_id, fn)``: a save queued once the
    request's load is reported (or waited for).
    """

    def __init__(self, name: str, *, threads: int = 1):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"kvbridge-{name}", initializer=_idle_batch)
        self._lock = threading.Lock()
        self._busy: collections.Counter[str] = collections.Counter()  # request -> transfers in flight
        self._futures: set[concurrent.futures.Future[None]] = set()
        self._queued = 0  # jobs submitted whose work is not over (a future is forgotten a moment after)
        self._loaded: set[str] = set()
        self._saved: set[str] = set()
        self._failed: set[int] = set()
        self._held: set[str] = set()
        self._posted: list[tuple[BlockLoad, Running, Finish]] = []  # loads running off our threads
        # saves running off our threads: request, the running copy, its finish, what counts its failure
        self._posted_saves: list[tuple[str, Running, Callable[[], None], Callable[[Exception], None] | None]] = []
        # saves to queue once their request's load is reported: request -> (fn, on_error)
        self._after: dict[str, list[tuple[Callable[[], None], Callable[[Exception], None] | None]]] = {}
        self._closed = False

    # -- submitting --------------------------------------------------------------------------------
    def load(self, op: BlockLoad, fn: Callable[[], Iterable[int]]) -> None:
        self._submit(op.request_id, lambda: self._run_load(op, fn))

    def save(self, request_id: str, fn: Callable[[], None], on_error: Callable[[Exception], None] | None = None) -> None:
        self._submit(request_id, lambda: self._run_save(request_id, fn, on_error))

    def post(self, op: BlockLoad, running: Running, finish: Finish) -> None:
        """A load already running where no Python thread waits on it (a native read on a thread of its
        own). Once ``running.done()``, ``finish()`` runs on the thread that polls or waits and gives the
        failed block ids, or a function to run on the IO thread that gives them (what is left needs a
        network round trip, which the engine's thread must not wait on)."""
        with self._lock:
            if self._closed:
                raise ClosedError("transfers are closed")
            self._busy[op.request_id] += 1
            self._posted.append((op, running, finish))

    def post_save(
        self, request_id: str, running: Running, finish: Callable[[], None], on_error: Callable[[Exception], None] | None = None
    ) -> None:
        """A save already running where no Python thread waits on it; once ``running.done()``,
        ``finish()`` runs on the thread that polls or waits (a raise is a failed save, as in :meth:`save`)."""
        with self._lock:
            if self._closed:
                raise ClosedError("transfers are closed")
            self._busy[request_id] += 1
            self._posted_saves.append((request_id, running, finish, on_error))

    def after_load(
        self, request_id: str, fn: Callable[[], None], on_error: Callable[[Exception], None] | None = None
    ) -> None:
        """A save to queue once the load of ``request_id`` (which calls this) is reported by :meth:`poll`,
        or waited for by :meth:`wait`. The request counts as busy from now on, so its blocks stay held.
        Queued at once, the save (a chain's promotion: a copy as long as the load) ran beside the thread
        that polls, and the engine learnt of an 8 MiB load ~0.5 ms later here."""
        with self._lock:
            if self._closed:
                raise ClosedError("transfers are closed")
            self._busy[request_id] += 1
            self._after.setdefault(request_id, []).append((fn, on_error))

    def _queue_after(self, request_ids: Iterable[str] | None) -> None:
        """Queue the saves :meth:`after_load` kept for ``request_ids`` (``None``: every one)."""
        with self._lock:
            ids = list(self._after) if request_ids is None else [r for r in request_ids if r in self._after]
            jobs = [(rid, job) for rid in ids for job in self._after.pop(rid)]
        for rid, (fn, on_error) in jobs:
            self.save(rid, fn, on_error)  # busy again before the count after_load took is given back
            with self._lock:
                self._idle(rid)

    def hold(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in request_ids:
                if self._busy[rid]:
                    self._held.add(rid)
                else:
                    self._saved.add(rid)

    def queued(self) -> bool:
        """Whether anything is queued or running on the IO thread (posted loads aside)."""
        with self._lock:
            return self._queued > 0

    def busy(self, request_id: str) -> bool:
        with self._lock:
            return bool(self._busy[request_id])

    def _submit(self, request_id: str, job: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise ClosedError("transfers are closed")
            self._busy[request_id] += 1
            self._queued += 1
            future = self._pool.submit(self._settle, request_id, job)
            self._futures.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    # -- on the IO thread --------------------------------------------------------------------------
    def _settle(self, request_id: str, job: Callable[[], None]) -> None:
        _policy(False)  # woken as a batch thread (_idle_batch); the job itself runs as any other thread
        try:
            job()
        finally:
            _policy(True)
            with self._lock:
                self._queued -= 1  # over now: its future's callback runs later, after a poll may have looked
                self._idle(request_id)

    def _idle(self, request_id: str) -> None:
        """One transfer of ``request_id`` is over (the lock is held)."""
        self._busy[request_id] -= 1
        if not self._busy[request_id]:
            del self._busy[request_id]
            if request_id in self._held:
                self._held.discard(request_id)
                self._saved.add(request_id)

    def _run_load(self, op: BlockLoad, fn: Callable[[], Iterable[int]]) -> None:
        try:
            failed = set(fn())
        except Exception as exc:  # every block of the op is lost; the engine recomputes them
            log.warning("load of %s failed: %s", op.request_id, exc)
            failed = set(op.block_ids)
        with self._lock:
            self._loaded.add(op.request_id)
            self._failed |= failed

    # -- on the thread that polls or waits ---------------------------------------------------------
    def _reap(self) -> None:
        """Finish the posted loads and saves that are over."""
        with self._lock:
            if not self._posted and not self._posted_saves:
                return
            over = [p for p in self._posted if p[1].done()]
            self._posted = [p for p in self._posted if not any(p is q for q in over)]
            saved = [p for p in self._posted_saves if p[1].done()]
            self._posted_saves = [p for p in self._posted_saves if not any(p is q for q in saved)]
        for request_id, _, finish_save, on_error in saved:
            self._run_save(request_id, finish_save, on_error)
            with self._lock:
                self._idle(request_id)
        for op, _, finish in over:
            try:
                out = finish()
            except Exception as exc:  # every block of the op is lost; the engine recomputes them
                log.warning("load of %s failed: %s", op.request_id, exc)
                out = set(op.block_ids)
            if callable(out):  # the rest on the IO thread; submitted first, so the request never looks idle
                self._submit(op.request_id, functools.partial(self._run_load, op, out))
            with self._lock:
                if not callable(out):
                    self._loaded.add(op.request_id)
                    self._failed |= set(out)
                self._idle(op.request_id)

    @staticmethod
    def _run_save(request_id: str, fn: Callable[[], None], on_error: Callable[[Exception], None] | None) -> None:
        try:
            fn()
        except Exception as exc:  # a failed save loses a cache entry, never the request
            log.warning("save of %s failed: %s", request_id, exc)
            if on_error is not None:
                on_error(exc)

    # -- reporting ---------------------------------------------------------------------------------
    def poll(self, also_saved: Iterable[str] = ()) -> WorkerReport:
        """What finished since the previous poll (``also_saved``: requests the caller releases itself)."""
        self._reap()
        with self._lock:
            report = WorkerReport(frozenset(self._loaded), frozenset(self._saved.union(also_saved)), frozenset(self._failed))
            self._loaded.clear()
            self._saved.clear()
            self._failed.clear()
        self._queue_after(report.finished_loading)
        return report

    def wait(self, request_ids: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until nothing (or nothing of ``request_ids``) is in flight; ``False`` on timeout. A save
        kept by :meth:`after_load` is not in flight until the poll that reports its load queues it,
        unless its request is one of ``request_ids``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        wanted = None if request_ids is None else set(request_ids)
        while True:
            self._reap()
            if wanted is not None and self._after:
                self._queue_after(wanted)  # the caller waits for these requests: their kept saves too
            with self._lock:
                futures = set(self._futures)
                posted = [running for _, running, _ in self._posted] + [p[1] for p in self._posted_saves]
                if wanted is None and not futures and not posted:
                    return True
                if wanted is not None and not any(self._busy[r] for r in wanted):
                    return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if posted:  # with IO-thread work beside it, look at that again every millisecond
                posted[0].wait(left if not futures else POSTED_SLICE_S if left is None else min(left, POSTED_SLICE_S))
            else:
                concurrent.futures.wait(futures, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        """Finish what is in flight (loads end by their own deadlines), then stop the thread."""
        self.wait()  # posted loads included: they write into blocks until they are over
        with self._lock:
            self._closed = True
            self._after.clear()  # kept saves whose load nobody polled: copies into a cache that closes
        self._pool.shutdown(wait=True)


__all__ = ["Ending", "Finish", "LoadBook", "LoadResult", "Running", "Transfers"]
