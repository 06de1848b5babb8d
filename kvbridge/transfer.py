"""The one handle of a worker-side transfer: every way a load or a save runs gives a :class:`Transfer`.

A transfer is over once :meth:`Transfer.done` (which never blocks); :meth:`Transfer.wait` blocks until
then; :meth:`Transfer.failed`, once it is over, names the block ids of its op that did not arrive (a load)
or were not stored (a save). How one is made:

- :class:`Started` — a copy already running where no Python thread waits on it (a native thread), and
  what finishes it on the thread that polls once it is over (compare checksums, tag slots): cheap, and
  never blocking.
- :meth:`kvbridge.lifecycle.Transfers.run` — a blocking function on a worker's IO thread: the one adapter
  for every transfer that blocks (:class:`Queued`).
- :class:`Fallback` — a transfer, then, for the blocks it failed, a blocking function on the IO thread
  (a chain's next tier, a pull's confirming round trip). The core chains it: the thread that polls starts
  the second part once the first is over; nothing is returned up to be run.
- :class:`Over` — nothing to wait for.

**The failed-load rule, written once** (:meth:`Transfer.failed`): a failure is data, not an exception.
Whatever raises while a transfer runs or is finished (a native copy's error, a store's ``load``, a chain's
tier) fails every block of its op: logged here, counted by its worker, never raised to the engine, which
recomputes those blocks over whatever landed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from kvbridge.contract import BlockLoad, BlockSave

log = logging.getLogger(__name__)

Op = BlockLoad | BlockSave


class Running(Protocol):
    """A copy running where no Python thread waits on it (e.g. a :class:`kvbridge._core.Job`), or a :class:`Transfer`."""

    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


class IOThread(Protocol):
    """Where the blocking part of a transfer runs (:class:`kvbridge.lifecycle.Transfers`)."""

    def run(self, op: Op, fn: Callable[[], Iterable[int] | None]) -> Transfer: ...


class _Now:
    """Over already (a :class:`Running` with nothing running)."""

    @staticmethod
    def done() -> bool:
        return True

    @staticmethod
    def wait(timeout: float | None = None) -> bool:
        return True


_NOW = _Now()


class Transfer:
    """A load or a save in flight: :meth:`done`, :meth:`wait`, :meth:`failed`. ``seconds``: how long it ran,
    once over (what a worker counts as the transfer's own time)."""

    __slots__ = ("op", "error", "seconds", "_failed", "_io")

    def __init__(self, op: Op):
        self.op = op
        self.error: Exception | None = None  # what made every block of it fail, where something raised
        self.seconds = 0.0
        self._failed: frozenset[int] | None = None
        self._io: IOThread | None = None

    def done(self) -> bool:
        """Whether it is over: :meth:`failed` then answers at once. Never blocks."""
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> bool:
        """Block until it is over; ``False`` if ``timeout`` passed first."""
        raise NotImplementedError

    def failed(self) -> frozenset[int]:
        """Once over: the op's block ids that did not arrive (or were not stored). Never raises: a raise while
        it ran or finishes fails every block of the op (the failed-load rule, here and nowhere else)."""
        if self._failed is None:
            try:
                out = self._finish()
                self._failed = frozenset(out) if out is not None else frozenset()
            except Exception as exc:  # every block of the op is lost; the engine recomputes them
                kind = "load" if isinstance(self.op, BlockLoad) else "save"
                log.warning("%s of %s failed: %s: %s", kind, self.op.request_id, type(exc).__name__, exc)
                self.error = exc
                self._failed = frozenset(self.op.block_ids)
        return self._failed

    def _finish(self) -> Iterable[int] | None:
        """The failed block ids (``None``: none), once over; may raise (see :meth:`failed`)."""
        raise NotImplementedError

    def bind(self, io: IOThread) -> None:
        """Where this transfer's blocking parts run (set by the worker's :class:`~kvbridge.lifecycle.Transfers`
        when it tracks it); unbound, a :class:`Fallback` runs its second part on the thread that polls."""
        self._io = io


class Over(Transfer):
    """A transfer with nothing left to wait for: ``failed`` block ids (or a raise's ``error``: every block)."""

    __slots__ = ()

    def __init__(self, op: Op, failed: Iterable[int] = (), error: Exception | None = None):
        super().__init__(op)
        if error is not None:
            self.error, self._failed = error, frozenset(op.block_ids)
        else:
            self._failed = frozenset(failed)

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return True


class Started(Transfer):
    """``running`` (a native copy, or another transfer), finished by ``finish()`` once over, on the thread that
    polls: it gives the failed block ids (``None``: none) or raises (every block failed)."""

    __slots__ = ("running", "finish", "_t0")

    def __init__(self, op: Op, running: Running, finish: Callable[[], Iterable[int] | None]):
        super().__init__(op)
        self.running, self.finish = running, finish
        self._t0 = time.perf_counter()

    def done(self) -> bool:
        return self.running.done()

    def wait(self, timeout: float | None = None) -> bool:
        return self.running.wait(timeout)

    def _finish(self) -> Iterable[int] | None:
        try:
            return self.finish()
        finally:
            self.seconds = time.perf_counter() - self._t0

    def bind(self, io: IOThread) -> None:
        self._io = io
        bind = getattr(self.running, "bind", None)  # a transfer (or a wrapper of one) runs its parts there too
        if bind is not None:
            bind(io)


class Queued(Transfer):
    """A blocking function on an IO thread (made by :meth:`kvbridge.lifecycle.Transfers.run`); its result is
    the failed block ids (``None``: none)."""

    __slots__ = ("future",)

    def __init__(self, op: Op, future: concurrent.futures.Future[Iterable[int] | None] | None = None):
        super().__init__(op)
        self.future: concurrent.futures.Future[Iterable[int] | None] = future or concurrent.futures.Future()

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None = None) -> bool:
        concurrent.futures.wait((self.future,), timeout=timeout)
        return self.future.done()

    def _finish(self) -> Iterable[int] | None:
        return self.future.result()


class Fallback(Transfer):
    """``first``, then ``rest(first)`` on the IO thread where ``first`` failed blocks: its failed block ids are
    the result (``rest`` sees ``first.failed()`` and ``first.error``). Started by whoever finds ``first`` over
    (:meth:`done` or :meth:`wait`, on the thread that polls); a ``first`` that failed nothing is the result."""

    __slots__ = ("first", "rest", "_second", "_lock")

    def __init__(self, first: Transfer, rest: Callable[[Transfer], Iterable[int] | None]):
        super().__init__(first.op)
        self.first, self.rest = first, rest
        self._second: Transfer | None = None
        self._lock = threading.Lock()  # two threads finding ``first`` over start ``rest`` once

    def bind(self, io: IOThread) -> None:
        self._io = io
        self.first.bind(io)

    def _advance(self) -> Transfer | None:
        """The part that decides the result, once ``first`` is over (``None`` before)."""
        if self._second is not None or not self.first.done():
            return self._second
        with self._lock:
            if self._second is not None:
                pass
            elif not self.first.failed():
                self._second = self.first
            elif self._io is not None:
                self._second = self._io.run(self.op, lambda: self.rest(self.first))
            else:  # unbound: run here, when its result is asked for
                self._second = Started(self.op, _NOW, lambda: self.rest(self.first))
            return self._second

    def done(self) -> bool:
        second = self._advance()
        return second is not None and second.done()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.first.wait(timeout):
            return False
        second = self._advance()
        assert second is not None
        return second.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _finish(self) -> Iterable[int] | None:
        assert self._second is not None
        failed = self._second.failed()
        self.error = self._second.error
        self.seconds = self.first.seconds + (self._second.seconds if self._second is not self.first else 0.0)
        return failed


__all__ = ["Fallback", "IOThread", "Over", "Queued", "Running", "Started", "Transfer"]
