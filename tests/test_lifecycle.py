"""kvbridge.lifecycle on its own: the bookkeeping every backend shares, driven the way backends drive it."""

from __future__ import annotations

import threading

import pytest

from kvbridge.contract import BlockLoad, WorkerReport
from kvbridge.errors import ClosedError
from kvbridge.lifecycle import Ending, LoadBook, Transfers


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
        t.load(BlockLoad("r", (1, 2)), lambda: (gate.wait(5), [2])[1])
        t.save("r", lambda: None)
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
    errors: list[Exception] = []

    def boom() -> None:
        raise OSError("disk gone")

    t.load(BlockLoad("r", (7, 8)), lambda: (_ for _ in ()).throw(OSError("gone")))
    t.save("s", boom, errors.append)
    assert t.wait(timeout=5)
    assert t.poll().failed_blocks == frozenset({7, 8}), "a raising load fails every block of it"
    assert [str(e) for e in errors] == ["disk gone"], "a raising save is reported, never raised"
    t.close()
    with pytest.raises(ClosedError):
        t.save("s", lambda: None)
