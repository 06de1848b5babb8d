"""kvbridge.lifecycle on its own: the bookkeeping every backend shares, driven the way backends drive it."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvbridge.contract import BlockLoad, BlockSave, WorkerReport
from kvbridge.errors import ClosedError
from kvbridge.lifecycle import Ending, LoadBook, Transfers
from kvbridge.transfer import Fallback, Started, Transfer


def test_a_failed_load_is_never_offered_again_until_the_request_ends() -> None:
    book = LoadBook()
    book.plan(BlockLoad("r", (4, 5, 6)))
    assert book.take() == ((BlockLoad("r", (4, 5, 6)),), ())
    [result] = book.report(WorkerReport(frozenset({"r"}), failed_blocks=frozenset({5, 99})))
    assert result.failed == frozenset({5}), "only the request's own blocks are its failures"
    assert book.failed_before("r")
    assert book.finish("r") == (Ending.NO_LOAD, None)
    assert not book.failed_before("r")


def test_a_request_that_ends_mid_load_is_held_and_its_id_stays_reusable() -> None:
    book = LoadBook()
    op = BlockLoad("r", (1, 2))
    book.plan(op)
    book.take()
    assert book.finish("r") == (Ending.IN_FLIGHT, op)
    assert book.take() == ((), ("r",)), "the next plan names it held"
    book.report(WorkerReport(frozenset({"r"}), failed_blocks=frozenset({1})))
    assert not book.failed_before("r"), "a failure of an ended request guards nothing (the id may come back)"


def test_a_load_never_handed_out_is_dropped() -> None:
    book = LoadBook()
    op = BlockLoad("r", (1,))
    book.plan(op)
    assert book.finish("r") == (Ending.DROPPED, op)
    assert book.take() == ((), ())


def test_transfers_hold_until_every_transfer_of_the_request_is_over() -> None:
    t = Transfers("test")
    gate = threading.Event()
    try:
        t.track(t.run(BlockLoad("r", (1, 2)), lambda: (gate.wait(5), [2])[1]))
        t.track(t.run(BlockSave("r", (1, 2)), lambda: None))
        t.hold(["r", "idle"])
        assert t.poll() == WorkerReport(finished_saving=frozenset({"idle"}))
        gate.set()
        assert t.wait(["r"], timeout=5)
        assert t.poll() == WorkerReport(frozenset({"r"}), frozenset({"r"}), frozenset({2}))
        assert t.poll() == WorkerReport(), "each event once"
    finally:
        gate.set()
        t.close()


def test_transfers_absorb_failures_and_refuse_after_close() -> None:
    t = Transfers("test")
    over: list[Transfer] = []

    def boom() -> None:
        raise OSError("disk gone")

    t.track(t.run(BlockLoad("r", (7, 8)), lambda: (_ for _ in ()).throw(OSError("gone"))))
    t.track(t.run(BlockSave("s", (3,)), boom), over.append)
    assert t.wait(timeout=5)
    assert t.poll().failed_blocks == frozenset({7, 8}), "a raising load fails every block of it"
    [save] = over
    assert save.failed() == frozenset({3}) and str(save.error) == "disk gone", "a raising save is data, never raised"
    t.close()
    with pytest.raises(ClosedError):
        t.run(BlockSave("s", ()), lambda: None)


class _Gate:
    """A transfer running on a thread Transfers does not own (as a kvbridge._core.Job does): over once set."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.event.wait(timeout)


def test_started_loads_are_finished_by_whoever_polls_or_waits() -> None:
    """A transfer started on a native thread is finished on the thread that polls; a fallback chained on it
    (a confirming round trip, a chain's next tier) runs on the IO thread, only where the first part failed
    blocks, and its failed ids are the load's; a finish that raises fails every block (never raised)."""
    t = Transfers("test")
    sealed, unsealed, broken = _Gate(), _Gate(), _Gate()
    on: list[str] = []

    def rest(first: Transfer) -> list[int]:
        on.append(threading.current_thread().name)
        assert first.failed() == frozenset({3, 4})
        return [4]

    try:
        t.track(Started(BlockLoad("a", (1, 2)), sealed, lambda: (on.append(threading.current_thread().name), set())[1]))
        # what is left needs the IO thread (a confirming round trip), and fails one block there
        t.track(Fallback(Started(BlockLoad("b", (3, 4)), unsealed, lambda: [3, 4]), rest))
        t.track(Started(BlockLoad("c", (5,)), broken, lambda: (_ for _ in ()).throw(OSError("peer gone"))))
        t.hold(["a", "b"])  # both ended mid-load: held until their loads are over
        assert t.poll() == WorkerReport() and not t.wait(timeout=0.05)
        sealed.event.set()
        assert t.wait(["a"], timeout=5)
        assert t.poll() == WorkerReport(frozenset({"a"}), frozenset({"a"}))
        assert on == [threading.current_thread().name], "a posted load is finished on the polling thread"
        unsealed.event.set()
        broken.event.set()
        assert t.wait(timeout=5)
        assert t.poll() == WorkerReport(frozenset({"b", "c"}), frozenset({"b"}), frozenset({4, 5}))
        assert on[1].startswith("kvbridge-test"), "the fallback of a started load runs on the IO thread"
    finally:
        for gate in (sealed, unsealed, broken):
            gate.event.set()
        t.close()


def test_started_saves_hold_their_request_until_a_poll_sees_them_over() -> None:
    """A save started on a native thread: its request stays held (its blocks are still read) until the
    thread that polls or waits sees it over and completes it; a completion that raises is a failed
    save, counted, never raised; ``queued`` tells only of the IO thread's own work."""
    t = Transfers("test")
    good, bad = _Gate(), _Gate()
    done: list[str] = []
    errors: list[Exception] = []

    def over(save: Transfer) -> None:
        if save.error is not None:
            errors.append(save.error)

    try:
        t.track(Started(BlockSave("a", (1,)), good, lambda: done.append(threading.current_thread().name)), over)
        t.track(Started(BlockSave("b", (2,)), bad, lambda: (_ for _ in ()).throw(OSError("copy failed"))), over)
        t.hold(["a", "b"])
        assert not t.queued() and t.busy("a") and t.busy("b")
        assert t.poll() == WorkerReport() and not t.wait(timeout=0.05) and done == []
        good.event.set()
        assert t.wait(["a"], timeout=5)
        assert t.poll() == WorkerReport(finished_saving=frozenset({"a"}))
        assert done == [threading.current_thread().name] and errors == []
        bad.event.set()
        assert t.wait(timeout=5)
        assert t.poll() == WorkerReport(finished_saving=frozenset({"b"}))
        assert [str(e) for e in errors] == ["copy failed"]
        t.track(t.run(BlockSave("c", ()), lambda: time.sleep(0.2)))
        assert t.queued()
    finally:
        good.event.set()
        bad.event.set()
        t.close()


def test_a_save_kept_after_a_load_is_queued_by_the_poll_that_reports_the_load() -> None:
    """``after_load`` (a chain's promotion): the save does not run beside the load's report, but once
    a poll has reported the load; until it is over the request stays busy, so an end holds its blocks.
    A wait that names the request queues it (a preempted request's blocks are about to be reused)."""
    t = Transfers("test")
    ran: list[str] = []
    try:
        def load(rid: str) -> list[int]:
            t.after_load(BlockSave(rid, ()), lambda: ran.append(rid))
            return []

        t.track(t.run(BlockLoad("a", (1,)), lambda: load("a")))
        t.track(t.run(BlockLoad("b", (2,)), lambda: load("b")))
        assert t.wait(timeout=5)  # both loads are over; the kept saves wait for the poll, not for this
        assert ran == [] and t.busy("a") and t.busy("b")
        t.hold(["a"])  # a ends: its blocks are held while its save is owed
        assert t.poll() == WorkerReport(finished_loading=frozenset({"a", "b"}))
        assert t.wait(timeout=5) and sorted(ran) == ["a", "b"]
        assert t.poll() == WorkerReport(finished_saving=frozenset({"a"}))
        t.track(t.run(BlockLoad("c", (3,)), lambda: load("c")))
        assert t.wait(["c"], timeout=5) and ran[-1] == "c" and not t.busy("c")
    finally:
        t.close()


def test_close_waits_for_started_loads() -> None:
    t = Transfers("test")
    gate = _Gate()
    t.track(Started(BlockLoad("r", (1,)), gate, lambda: set()))
    threading.Timer(0.1, gate.event.set).start()
    t.close()  # returns only once the started load is over: it writes into the request's blocks until then
    assert gate.done()
    with pytest.raises(ClosedError):
        t.track(Started(BlockLoad("s", (2,)), _Gate(), lambda: set()))


def test_nothing_is_queued_once_a_poll_reports_the_io_threads_work_over() -> None:
    """``queued()`` (which keeps a native start from overtaking IO-thread work) says False once a poll has
    reported that work over: a store's next load, seeing work still there, would go to the IO thread
    instead of starting natively (the hand-off ``kvbridge bench --backends cpu --ops load`` measures)."""
    t = Transfers("test")
    try:
        for i in range(300):
            t.track(t.run(BlockSave(f"r{i}", ()), lambda: None))
            t.hold([f"r{i}"])
            deadline = time.monotonic() + 10
            while f"r{i}" not in t.poll().finished_saving:
                assert time.monotonic() < deadline
            assert not t.queued(), f"round {i}"
    finally:
        t.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_io_thread_waits_for_work_as_a_batch_thread() -> None:
    """The IO thread waits as SCHED_BATCH: the engine's own calls wake it (a poll queues a chain's promotion),
    and a woken thread that preempts takes the engine thread's core where cores are few (outliers in
    ``kvbridge bench --backends chain --ops load``). A job runs as SCHED_OTHER, so threads it makes do not inherit the batch policy; the
    thread that made the transfers keeps its own."""
    t = Transfers("test")
    seen: list[tuple[int, int]] = []
    try:
        t.track(t.run(BlockSave("r", ()), lambda: seen.append((threading.get_native_id(), os.sched_getscheduler(0)))))
        assert t.wait(timeout=10)
        (tid, during), = seen
        assert during == os.SCHED_OTHER
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(tid) != os.SCHED_BATCH:  # back to waiting, once the job's last line ran
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert os.sched_getscheduler(0) != os.SCHED_BATCH
    finally:
        t.close()
