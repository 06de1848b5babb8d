"""The ucx consumer's releaser (connectors/ucx/releaser.py) against real metadata servers in this process:
one lane per producer (a producer that does not answer delays no other), retries until the hand-off's
lease ends (a producer that comes back gets its release; an expired hand-off is not retried), and lanes
whose threads end when idle and start again on the next release."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("grpc", reason="pip install 'kvbridge[grpc]'")

from kvbridge.connectors.ucx import releaser as relmod  # noqa: E402
from kvbridge.connectors.ucx.options import UcxOptions  # noqa: E402
from kvbridge.connectors.ucx.params import UcxSource  # noqa: E402

TIMEOUT_S = 1.0  # the releaser's timeout_s: a call's deadline is half of it, one retry


class _Producer:
    """What a producer's release handler saw: (request id, aborted, when), in arrival order."""

    def __init__(self, hang: threading.Event | None = None):
        self.got: list[tuple[str, bool, float]] = []
        self.hang = hang
        self.cond = threading.Condition()

    def on_release(self, engine_id: str, request_id: str, aborted: bool, grant: bytes) -> bool:
        if self.hang is not None:
            self.hang.wait(30)  # a producer that takes the call and never answers in time
        with self.cond:
            self.got.append((request_id, aborted, time.monotonic()))
            self.cond.notify_all()
        return True

    def wait(self, ids: set[str], timeout: float) -> float:
        """Seconds until every one of ``ids`` arrived; fails past ``timeout``."""
        t0 = time.monotonic()
        with self.cond:
            ok = self.cond.wait_for(lambda: ids <= {rid for rid, _, _ in self.got}, timeout)
        assert ok, f"released {[rid for rid, _, _ in self.got]}, waited for {sorted(ids)}"
        return time.monotonic() - t0


def _source(address: str, rid: str, lease_s: float = 60.0) -> UcxSource:
    return UcxSource("producer", address, (), rid, (1, 2), time.time() + lease_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_producer_that_does_not_answer_delays_no_other(serve: Callable[..., Any]) -> None:
    stuck_gate = threading.Event()
    stuck, healthy = _Producer(hang=stuck_gate), _Producer()
    stuck_addr = f"127.0.0.1:{serve(on_release=stuck.on_release, directory=False).port}"
    healthy_addr = f"127.0.0.1:{serve(on_release=healthy.on_release, directory=False).port}"
    timeout = 4.0  # a call to the stuck producer waits timeout / 2 before it fails, then tries once more
    rel = relmod.Releaser(UcxOptions(timeout_s=timeout), "consumer")
    try:
        rel.release([stuck_addr], _source(stuck_addr, "s0"), aborted=True)
        time.sleep(0.1)  # its call is in flight, waiting on the producer
        ids = {f"h{i}" for i in range(5)}
        for rid in sorted(ids):
            rel.release([healthy_addr], _source(healthy_addr, rid), aborted=False)
        # all in long before the stuck call's first try could even time out (timeout / 2)
        healthy.wait(ids, timeout / 4)
        assert [rid for rid, _, _ in healthy.got] == sorted(ids)  # in order, each once
        assert not stuck.got
    finally:
        stuck_gate.set()
        rel.close()


def test_a_release_is_retried_until_the_producer_is_back_and_not_past_its_lease(serve: Callable[..., Any]) -> None:
    """Nothing listens at the producer's address (a dead host, a cut link): the releases fail and are tried
    again; a producer that then listens there gets the one whose lease still runs, in order after it, a
    later one — but not the one whose lease ended meanwhile (the producer freed those blocks itself)."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    rel = relmod.Releaser(UcxOptions(timeout_s=TIMEOUT_S), "consumer")
    try:
        rel.release([address], _source(address, "short", lease_s=1.0), aborted=True)
        rel.release([address], _source(address, "long"), aborted=True)
        deadline = time.monotonic() + 5
        while rel.pending() < 2:  # both failed once and wait for their retry
            assert time.monotonic() < deadline, "the failed releases were not kept for a retry"
            time.sleep(0.02)
        time.sleep(1.2)  # "short"'s lease ends
        back = _Producer()
        serve(listen=address, on_release=back.on_release, directory=False)
        rel.release([address], _source(address, "later"), aborted=False)
        # the next try: the backoff (timeout_s, doubling, at most RETRY_MAX_S) from the last failure
        back.wait({"long", "later"}, 4 * TIMEOUT_S + 5)
        assert [(rid, aborted) for rid, aborted, _ in back.got] == [("long", True), ("later", False)]
        assert rel.pending() == 0
    finally:
        rel.close()


def test_an_idle_lane_ends_its_thread_and_starts_again(serve: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relmod, "IDLE_S", 0.2)
    producer = _Producer()
    address = f"127.0.0.1:{serve(on_release=producer.on_release, directory=False).port}"
    rel = relmod.Releaser(UcxOptions(timeout_s=TIMEOUT_S), "consumer")

    def lane_threads() -> int:
        return sum(t.name.startswith("kvbridge-ucx-release-") for t in threading.enumerate())

    before = lane_threads()
    try:
        rel.prepare(address)
        rel.release([address], _source(address, "a"), aborted=False)
        producer.wait({"a"}, 5)
        deadline = time.monotonic() + 5
        while lane_threads() > before:
            assert time.monotonic() < deadline, "an idle lane kept its thread"
            time.sleep(0.05)
        rel.release([address], _source(address, "b"), aborted=False)  # a fresh thread, the same client
        producer.wait({"b"}, 5)
    finally:
        rel.close()
    assert lane_threads() == before
