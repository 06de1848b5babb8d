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
- :class:`Transfers` — on the worker side. Every load and save in flight is one handle,
  :class:`~kvbridge.transfer.Transfer` (done / wait / failed ids), however it runs: on one background
  thread per worker (``run``: first in, first out, so a load planned after a save of the same key reads
  what that save wrote; a backend may give its own :class:`Pool`, as the ``ucx`` consumer does: a few
  threads per producer), or on a backend's own native threads, which a store uses only when nothing is
  queued on that thread. It records which requests finished loading, which blocks failed, and reports a
  *held* request in ``finished_saving`` once nothing reads or writes its blocks any more. Work a load
  leaves behind (a chain's promotion, ``after_load``) waits until the poll that reports the load: it
  then competes with the engine's next step, not with the engine learning of the load.
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
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from kvbridge.contract import BlockLoad, BlockSave, WorkerReport
from kvbridge.errors import ClosedError
from kvbridge.transfer import Queued, Running, Transfer

log = logging.getLogger(__name__)

POSTED_SLICE_S = 0.001  # how often a wait over several transfers in flight looks at the others

WhenOver = Callable[[Transfer], None]  # what a worker does once a transfer it tracks is over (count it, queue more)
T = TypeVar("T")


class Pool(Protocol):
    """Where :meth:`Transfers.run` runs its jobs, chosen per op (e.g. one lane per producer:
    :class:`kvbridge.connectors.ucx.slots.Slots`); by default, the worker's own shared threads."""

    def submit(self, op: BlockLoad | BlockSave, fn: Callable[[], T]) -> concurrent.futures.Future[T]: ...
    def shutdown(self, wait: bool = True) -> None: ...


class _Shared:
    """The default :class:`Pool`: ``threads`` threads, first in, first out, whatever the op."""

    def __init__(self, name: str, threads: int):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"kvbridge-{name}",
                                                           initializer=_idle_batch)

    def submit(self, op: BlockLoad | BlockSave, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        return self._pool.submit(fn)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)


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
            failed = report.failed_blocks.intersection(op.block_ids)
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


def _policy(batch: bool) -> None:
    """Make the calling thread SCHED_BATCH (``batch``) or SCHED_OTHER again (Linux; elsewhere, or where refused,
    nothing changes)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH if batch else os.SCHED_OTHER, os.sched_param(0))


def _idle_batch() -> None:
    """The IO thread waits for work as SCHED_BATCH: it is woken by the engine's own calls (a poll queues a chain's
    promotion), and on a busy core the woken thread took the core from the engine's thread at once, which then
    waited a scheduler tick to go on (outliers in ``kvbridge bench --backends chain --ops load``). A batch thread that wakes does not preempt;
    it runs on an idle core, or at the next tick. Each job then runs as SCHED_OTHER (:meth:`Transfers._settle`),
    so a thread it makes (a thread pool's, a library's) does not inherit the batch policy."""
    _policy(True)


class Transfers:
    """Worker-side loads and saves of every request, as :class:`~kvbridge.transfer.Transfer` handles. See the
    module docstring.

    ``run(op, fn)``: the IO-thread adapter, ``fn() -> failed block ids`` on the background thread, as a handle.
    ``track(transfer, over)``: a load or save of ``transfer.op.request_id`` in flight, however it runs; the
    thread that polls or waits finds it over, calls ``over(transfer)``, and reports it (a load: in
    ``finished_loading``, its failed blocks in ``failed_blocks``). ``hold(ids)``: these requests ended; report
    each in ``finished_saving`` once it has nothing in flight. ``after_load(op, fn, over)``: a save queued
    once the request's load is reported (or waited for).
    """

    def __init__(self, name: str, *, threads: int = 1, pool: Pool | None = None):
        self._pool: Pool = pool if pool is not None else _Shared(name, threads)
        self._lock = threading.Lock()
        self._busy: collections.Counter[str] = collections.Counter()  # request -> transfers in flight
        self._queued = 0  # jobs submitted to the IO thread whose work is not over
        self._live: dict[Transfer, WhenOver | None] = {}  # tracked transfers not yet seen over, and what to call then
        self._loaded: set[str] = set()
        self._saved: set[str] = set()
        self._failed: set[int] = set()
        self._held: set[str] = set()
        # saves to run once their request's load is reported: request -> (save, its job, its over)
        self._after: dict[str, list[tuple[BlockSave, Callable[[], None], WhenOver | None]]] = {}
        self._closed = False

    # -- submitting --------------------------------------------------------------------------------
    def run(self, op: BlockLoad | BlockSave, fn: Callable[[], Iterable[int] | None],
            before: Callable[[], object] | None = None) -> Transfer:
        """``fn()`` (the failed block ids, ``None`` for none; a raise fails every block) on the IO thread, as a
        handle (not tracked: :meth:`track` it, or chain it). ``before()`` runs first there, outside the
        transfer's own time (a GPU save waits for the forward pass that wrote its blocks)."""
        transfer = Queued(op)

        def job() -> Iterable[int] | None:
            if before is not None:
                before()
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                transfer.seconds = time.perf_counter() - t0

        with self._lock:
            if self._closed:
                raise ClosedError("transfers are closed")
            self._queued += 1
            transfer.future = self._pool.submit(op, functools.partial(self._settle, job))
        return transfer

    def track(self, transfer: Transfer, over: WhenOver | None = None) -> None:
        """``transfer`` is in flight for its request (busy until seen over; its blocking parts run here)."""
        transfer.bind(self)
        with self._lock:
            if self._closed:
                raise ClosedError("transfers are closed")
            self._busy[transfer.op.request_id] += 1
            self._live[transfer] = over

    def after_load(self, op: BlockSave, fn: Callable[[], None], over: WhenOver | None = None) -> None:
        """A save (``fn``, on the IO thread) to start once the load of ``op.request_id`` (which calls this) is
        reported by :meth:`poll`, or waited for by :meth:`wait`. The request counts as busy from now on, so its
        blocks stay held. Started at once, the save (a chain's promotion: a copy as long as the load) would run
        beside the thread that polls, and the engine would learn of the load later (``kvbridge bench
        --backends chain``)."""
        with self._lock:
            if self._closed:
                raise ClosedError("transfers are closed")
            self._busy[op.request_id] += 1
            self._after.setdefault(op.request_id, []).append((op, fn, over))

    def _start_after(self, request_ids: Iterable[str] | None) -> None:
        """Start the saves :meth:`after_load` kept for ``request_ids`` (``None``: every one)."""
        with self._lock:
            ids = list(self._after) if request_ids is None else [r for r in request_ids if r in self._after]
            jobs = [job for rid in ids for job in self._after.pop(rid)]
        for op, fn, over in jobs:
            self.track(self.run(op, fn), over)  # busy again before the count after_load took is given back
            with self._lock:
                self._idle(op.request_id)

    def hold(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in request_ids:
                if self._busy[rid]:
                    self._held.add(rid)
                else:
                    self._saved.add(rid)

    def queued(self) -> bool:
        """Whether anything is queued or running on the IO thread (natively started transfers aside)."""
        with self._lock:
            return self._queued > 0

    def busy(self, request_id: str) -> bool:
        with self._lock:
            return bool(self._busy[request_id])

    # -- on the IO thread --------------------------------------------------------------------------
    def _settle(self, job: Callable[[], Iterable[int] | None]) -> Iterable[int] | None:
        _policy(False)  # woken as a batch thread (_idle_batch); the job itself runs as any other thread
        try:
            return job()
        finally:
            _policy(True)
            with self._lock:
                self._queued -= 1

    def _idle(self, request_id: str) -> None:
        """One transfer of ``request_id`` is over (the lock is held)."""
        self._busy[request_id] -= 1
        if not self._busy[request_id]:
            del self._busy[request_id]
            if request_id in self._held:
                self._held.discard(request_id)
                self._saved.add(request_id)

    # -- on the thread that polls or waits ---------------------------------------------------------
    def _reap(self) -> None:
        """Finish the tracked transfers that are over: their ``over``, then their report."""
        with self._lock:
            if not self._live:
                return
            live = list(self._live.items())
        over = [entry for entry in live if entry[0].done()]  # outside the lock: a Fallback may start its rest
        if not over:
            return
        with self._lock:  # another thread may have reaped some of these meanwhile
            mine = [(t, fn) for t, fn in over if self._live.pop(t, _GONE) is not _GONE]
        for transfer, fn in mine:
            failed = transfer.failed()
            if fn is not None:
                try:
                    fn(transfer)
                except Exception:  # a worker's bookkeeping must not lose the report
                    log.exception("after the transfer of %s", transfer.op.request_id)
            with self._lock:
                if isinstance(transfer.op, BlockLoad):
                    self._loaded.add(transfer.op.request_id)
                    self._failed |= failed
                self._idle(transfer.op.request_id)

    # -- reporting ---------------------------------------------------------------------------------
    def poll(self, also_saved: Iterable[str] = ()) -> WorkerReport:
        """What finished since the previous poll (``also_saved``: requests the caller releases itself)."""
        self._reap()
        with self._lock:
            report = WorkerReport(frozenset(self._loaded), frozenset(self._saved.union(also_saved)), frozenset(self._failed))
            self._loaded.clear()
            self._saved.clear()
            self._failed.clear()
        if self._after:
            self._start_after(report.finished_loading)
        return report

    def wait(self, request_ids: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until nothing (or nothing of ``request_ids``) is in flight; ``False`` on timeout. A save
        kept by :meth:`after_load` is not in flight until the poll that reports its load starts it, unless
        its request is one of ``request_ids``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        wanted = None if request_ids is None else set(request_ids)
        while True:
            self._reap()
            if wanted is not None and self._after:
                self._start_after(wanted)  # the caller waits for these requests: their kept saves too
            with self._lock:
                if wanted is None:
                    live = list(self._live)
                    if not live:
                        return True
                else:
                    if not any(self._busy[r] for r in wanted):
                        return True
                    live = [t for t in self._live if t.op.request_id in wanted] or list(self._live)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            # several in flight: look at the others again every slice (any may end first)
            step = left if len(live) == 1 else POSTED_SLICE_S if left is None else min(left, POSTED_SLICE_S)
            if live:
                live[0].wait(step)
            else:  # busy with kept saves of another request only: they start with the poll of their load
                time.sleep(POSTED_SLICE_S if left is None else min(left, POSTED_SLICE_S))

    def close(self) -> None:
        """Finish what is in flight (loads end by their own deadlines), then stop the thread."""
        self.wait()  # natively started loads included: they write into blocks until they are over
        with self._lock:
            self._closed = True
            self._after.clear()  # kept saves whose load nobody polled: copies into a cache that closes
        self._pool.shutdown(wait=True)


_GONE = object()

__all__ = ["Ending", "LoadBook", "LoadResult", "Running", "Transfer", "Transfers"]
