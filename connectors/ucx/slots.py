"""Where a consumer worker's blocking loads run: a few IO threads per producer address, never shared.

A load that blocks (a ``ucp`` GET, a two-sided pull, a handshake with a new producer, the confirming
release of a started read, its clean-up) holds its thread until it is over, up to its deadline
(``timeout_s``). On one pool shared by every producer, a few loads stuck on a dead or unreachable
producer (its host crashed, its link cut: nothing answers, nothing fails fast) held every thread, and a
healthy producer's load queued behind them for up to ``timeout_s``. Here each producer address has its
own **slots**: at most ``per_key`` threads run its loads (first in, first out among them), and another
producer's load starts at once on its own, whatever the first one's loads are doing.

Why one small lane per address rather than one pool with per-producer quotas: it is the shape of the
releaser's lanes (:mod:`.releaser`), a quota pool would need its own scheduler to pick the next job
that fits, and a lane needs nothing but a queue and a count. A lane starts a thread when a job finds
no idle one (up to ``per_key``); a thread ends once its lane has had nothing to run for ``IDLE_S``, and
a lane with no thread and nothing queued is forgotten, so a consumer that saw many producers keeps no
threads for them. A fresh thread runs its job at once (``Transfers`` sets each job's scheduling policy
itself), so no initializer is needed.

:meth:`Slots.shutdown` lets every lane run what is queued (each job ends by its own deadline), then
joins the threads. The threads are daemons, so an idle one never holds the interpreter's exit up; the
slots a process did not shut down are shut down at its exit all the same, since a load still running
writes into the KV cache until its deadline.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from kvbridge.contract import BlockLoad, BlockSave
from kvbridge.errors import ClosedError

IDLE_S = 30.0  # a thread ends after this long with nothing to run on its lane

T = TypeVar("T")
_Job = tuple[concurrent.futures.Future[Any], Callable[[], Any]]


class _Lane:
    """One key's queue and threads (every field guarded by the slots' lock)."""

    def __init__(self, lock: threading.Lock):
        self.queue: collections.deque[_Job] = collections.deque()
        self.ready = threading.Condition(lock)  # a job was queued, or the slots close
        self.threads: set[threading.Thread] = set()
        self.idle = 0  # threads waiting for a job


class Slots:
    """``submit(op, fn)`` runs ``fn()`` on one of the threads of ``key(op)``'s lane, at most ``per_key`` of
    them at once, and returns its future (see the module docstring). The shape
    :class:`~kvbridge.lifecycle.Transfers` takes as its ``pool``."""

    def __init__(self, name: str, per_key: int, key: Callable[[BlockLoad | BlockSave], str]):
        if per_key < 1:
            raise ValueError(f"per_key={per_key}: a lane needs at least one thread")
        self.name, self.per_key, self.key = name, per_key, key
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}
        self._closed = False
        _OPEN.add(self)

    def submit(self, op: BlockLoad | BlockSave, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        key = self.key(op)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise ClosedError("the load slots are closed")
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(self._lock)
            lane.queue.append((future, fn))
            if len(lane.queue) > lane.idle and len(lane.threads) < self.per_key:
                thread = threading.Thread(target=self._serve, args=(key, lane), daemon=True,
                                          name=f"kvbridge-{self.name}-{key}")
                lane.threads.add(thread)
                thread.start()
            else:
                lane.ready.notify()
        return future

    def _serve(self, key: str, lane: _Lane) -> None:
        while (job := self._next(key, lane)) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - the future carries it to whoever waits
                future.set_exception(exc)
            else:
                future.set_result(result)
            del job, future, fn  # nothing of a finished job stays alive while the thread waits

    def _next(self, key: str, lane: _Lane) -> _Job | None:
        """The lane's next job; ``None``: this thread ends (idle for ``IDLE_S``, or closed with nothing queued)."""
        with self._lock:
            idle_until = time.monotonic() + IDLE_S
            while not lane.queue:
                left = idle_until - time.monotonic()
                if self._closed or left <= 0:
                    lane.threads.discard(threading.current_thread())
                    if not lane.threads and self._lanes.get(key) is lane:
                        del self._lanes[key]  # no thread, nothing queued: the next job makes a fresh lane
                    return None
                lane.idle += 1
                lane.ready.wait(left)
                lane.idle -= 1
            return lane.queue.popleft()

    def threads(self) -> dict[str, int]:
        """Threads alive per key (for tests and stats)."""
        with self._lock:
            return {key: len(lane.threads) for key, lane in self._lanes.items() if lane.threads}

    def shutdown(self, wait: bool = True) -> None:
        """No more jobs; every lane runs what is queued, then its threads end (joined if ``wait``)."""
        with self._lock:
            self._closed = True
            threads = [t for lane in self._lanes.values() for t in lane.threads]
            for lane in self._lanes.values():
                lane.ready.notify_all()
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()


_OPEN: weakref.WeakSet[Slots] = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    """Daemon threads stop where they are once the interpreter finalizes: let the loads still running end first."""
    for slots in list(_OPEN):
        slots.shutdown()


__all__ = ["IDLE_S", "Slots"]
