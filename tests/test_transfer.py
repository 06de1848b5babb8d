"""kvbridge.transfer on its own: the one worker transfer handle, its failed-load rule, and the chaining the core does."""

from __future__ import annotations

import threading
import time

from kvbridge.contract import BlockLoad, BlockSave
from kvbridge.lifecycle import Transfers
from kvbridge.transfer import Fallback, Over, Started, Transfer


class _Gate:
    """A copy running on a thread nobody here owns: over once set."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.event.wait(timeout)


def test_whatever_raises_fails_every_block_and_is_never_raised() -> None:
    op = BlockLoad("r", (3, 4, 5))
    gate = _Gate()
    broken = Started(op, gate, lambda: (_ for _ in ()).throw(OSError("copy failed")))
    assert not broken.done() and not broken.wait(0.01)
    gate.event.set()
    assert broken.done() and broken.failed() == frozenset({3, 4, 5})
    assert isinstance(broken.error, OSError) and broken.failed() is broken.failed(), "finished once"
    assert Over(BlockSave("s", (1, 2)), error=ValueError("x")).failed() == frozenset({1, 2})
    fine = Started(op, gate, lambda: [5])
    assert fine.failed() == frozenset({5}) and fine.error is None and fine.seconds >= 0


def test_a_fallback_runs_only_for_what_the_first_part_failed() -> None:
    op = BlockLoad("r", (1, 2, 3))
    asked: list[frozenset[int]] = []

    def rest(first: Transfer) -> list[int]:
        asked.append(first.failed())
        return [3]

    whole = Fallback(Over(op), rest)
    assert whole.done() and whole.failed() == frozenset() and asked == [], "nothing failed: nothing more runs"
    partial = Fallback(Over(op, [2, 3]), rest)  # unbound: the rest runs where its result is asked for
    assert partial.done() and partial.failed() == frozenset({3}) and asked == [frozenset({2, 3})]
    broken = Fallback(Over(op, [1]), lambda first: (_ for _ in ()).throw(ConnectionError("tier gone")))
    assert broken.done() and broken.failed() == frozenset({1, 2, 3}) and isinstance(broken.error, ConnectionError)


def test_a_tracked_fallback_runs_its_rest_on_the_io_thread_nested_or_not() -> None:
    """A chain's fallback to its next tier, inside another chain's (a transfer wrapping a transfer): the core
    binds every part to its IO thread, starts each rest once its first part is over, and reports the last
    part's failures as the load's."""
    t = Transfers("test")
    gate = _Gate()
    where: list[str] = []

    def rest(failed_after: list[int]) -> object:
        def run(first: Transfer) -> list[int]:
            where.append(threading.current_thread().name)
            return failed_after

        return run

    op = BlockLoad("r", (1, 2, 3))
    inner = Fallback(Started(op, gate, lambda: [2, 3]), rest([3]))  # type: ignore[arg-type]
    outer = Fallback(Started(op, inner, lambda: inner.failed()), rest([]))  # type: ignore[arg-type]
    seen: list[Transfer] = []
    try:
        t.track(outer, seen.append)
        assert not t.wait(timeout=0.05) and t.busy("r")
        gate.event.set()
        assert t.wait(["r"], timeout=10)
        report = t.poll()
        assert report.finished_loading == frozenset({"r"}) and report.failed_blocks == frozenset()
        assert len(where) == 2 and all(name.startswith("kvbridge-test") for name in where)
        assert seen == [outer]
    finally:
        gate.event.set()
        t.close()


def test_the_io_thread_adapter_times_the_work_alone() -> None:
    """``run``: the blocking function on the IO thread, as a handle; ``before`` (a GPU save waiting for the
    forward pass) runs first and is not the transfer's own time."""
    t = Transfers("test")
    go = threading.Event()
    try:
        job = t.run(BlockLoad("r", (1, 2)), lambda: [2] if go.wait(5) else [1, 2], before=lambda: time.sleep(1.0))
        assert not job.done() and t.queued()
        go.set()
        assert job.wait(10) and job.done() and job.failed() == frozenset({2})
        assert 0 <= job.seconds < 1.0, "the wait before it is not its time"
    finally:
        go.set()
        t.close()
