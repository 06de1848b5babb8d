"""Holding a store's loads or saves back at its :class:`~kvbridge.store.StoreIO` boundary (:func:`gated_io`),
and calls the test expects to block (:class:`BlockingCall`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvbridge.store import StoreWorker
from kvbridge.testing.engine import MiniEngine
from kvbridge.transfer import Started, Transfer


def store_worker(name: str, engine: MiniEngine) -> StoreWorker:
    if not isinstance(engine.worker, StoreWorker):
        pytest.skip(f"{name} is not a store: only a store's IO can be held back at its boundary")
    return engine.worker


class Gate:
    """Holds a store's loads or saves back at the :class:`~kvbridge.store.StoreIO` boundary until
    :meth:`open`: a fake slow medium (a medium that is slow on demand cannot be made real in a unit test);
    the real load or save runs once the gate opens. ``entered`` is set when the first call reaches it.
    A load or save the store starts on native threads (``start_load``/``start_save``) runs at once, but
    is not over until the gate opens."""

    def __init__(self, io: Any, method: str):
        self.io, self.method = io, method
        self.entered = threading.Event()
        self._open = threading.Event()
        self._shadowed: dict[str, Any] = {}  # instance attributes of the io's own (a fault hook's)
        real, start = getattr(io, method), getattr(io, f"start_{method}")

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            if not self._open.wait(30):
                raise TimeoutError(f"conformance gate on {method} never opened")
            return real(*args, **kwargs)

        def gated_start(*args: Any, **kwargs: Any) -> Transfer | None:
            started = start(*args, **kwargs)
            if started is None:
                return None
            self.entered.set()
            return Started(started.op, GatedRunning(started, self._open), started.failed)

        for name, fn in ((method, gated), (f"start_{method}", gated_start)):
            self._shadowed[name] = vars(io).get(name)
            setattr(io, name, fn)

    def open(self) -> None:
        self._open.set()

    def remove(self) -> None:
        self._open.set()
        for name, shadowed in self._shadowed.items():
            if shadowed is not None:
                setattr(self.io, name, shadowed)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(self.io, name)


class GatedRunning:
    """A natively started transfer that is over only once it is, and the gate is open."""

    def __init__(self, running: Transfer, gate: threading.Event):
        self.running, self.gate = running, gate

    def bind(self, io: Any) -> None:
        self.running.bind(io)

    def done(self) -> bool:
        return self.gate.is_set() and bool(self.running.done())

    def wait(self, timeout: float | None = None) -> bool:
        t0 = time.monotonic()
        if not self.gate.wait(timeout):
            return False
        return bool(self.running.wait(None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))))


@contextlib.contextmanager
def gated_io(worker: StoreWorker, method: str) -> Iterator[Gate]:
    gate = Gate(worker.io, method)
    try:
        yield gate
    finally:
        gate.remove()


class BlockingCall(threading.Thread):
    """``fn()`` on a thread of its own, for a call the test expects to block: callers check ``is_alive``,
    then ``error`` (what it raised, if anything)."""

    def __init__(self, fn: Callable[[], Any]):
        super().__init__(daemon=True)
        self.fn = fn
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc


__all__ = ["BlockingCall", "Gate", "gated_io", "store_worker"]
