"""The link's faults across emulated hosts, real (short versions for CI): the link cut mid-load (interface
down, or every packet dropped by nftables), the producer's host crashed mid-load (every process of it
killed) and the producer restarted there. Each time the in-flight load fails its blocks within the
consumer's ``timeout_s`` of its start, its handshake included (the aborted release runs off the load's
path, on the consumer's releaser), nothing arrives half-loaded
as loaded, the producer's hold ends (release or lease), and once the link is back the same consumer
process loads again, bit-exact. Needs root (skips, saying why, without).

The producer (host A) sends through a link capped at ``RATE`` so that the load below lasts long enough
to be cut in the middle; the consumer runs on host B; both are tests/helpers/ucx_fault_peer.py processes
(64 KiB per block). A link that trickles (capped at ``TRICKLE_RATE``: bytes keep arriving, every wait on
the socket succeeds) fails the load by ``timeout_s`` from its start all the same, on every lane.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

import hostpeer as hp  # noqa: E402 - tests/helpers, on sys.path by tests/conftest.py

from kvbridge.testing.hosts import Host  # noqa: E402

RATE = "40mbit"  # 160 blocks of 64 KiB (10 MiB) take about 2 s: the cut lands mid-load
TOKENS = 16 * 160 + 3
TIMEOUT_S = 2.0  # the consumer's timeout_s
LEASE_S = 4.0  # the producer's lease: a hold whose release cannot arrive ends by then
CUT_AFTER_S = 0.4
FAIL_WITHIN_S = TIMEOUT_S + 1.0  # the load's deadline, plus the report's scheduling on a loaded machine


def _producer(host: Host, out: Path) -> Any:
    return hp.HostPeer(host, "producer", out, "--lease", str(LEASE_S), "--num-blocks", "256")


def _consumer(host: Host, out: Path, lane: str = "auto") -> Any:
    return hp.HostPeer(host, "consumer", out, "--num-blocks", "256", "--timeout", str(TIMEOUT_S), "--lane", lane)


def _cut_mid_load(producer: Any, consumer: Any, cut: Callable[[], None]) -> dict[str, Any]:
    params, _ = producer.prefill("cut", TOKENS, seed=7)
    assert consumer.ask(op="begin", rid="cut", tokens=TOKENS, seed=7, params=params)["started"] > 0
    time.sleep(CUT_AFTER_S)
    cut()
    got = consumer.ask(op="end", rid="cut", wait=FAIL_WITHIN_S + 10, timeout=FAIL_WITHIN_S + 30)
    assert "error" not in got, got  # the load was reported (failed), not left hanging
    assert got["loaded"] == 0 and got["failed"] == hp.full_blocks(TOKENS), got  # every block fails, none counted
    assert got["seconds"] < FAIL_WITHIN_S, got
    return got


def _loads_again(producer: Any, consumer: Any, rid: str) -> None:
    tokens = 16 * 24 + 1
    params, sent = producer.prefill(rid, tokens, seed=11)
    got = consumer.ask(op="pull", rid=f"{rid}-c", tokens=tokens, seed=11, params=params, wait=30)
    assert got["failed"] == 0 and got["loaded"] == hp.full_blocks(tokens) and got["exact"] and got["sha"] == sent, got


@pytest.mark.parametrize(("fault", "lane"), [("link-down", "auto"), ("nft-drop", "auto"), ("link-down", "ucp")])
def test_link_cut_mid_load_fails_in_time_and_loads_resume(hosts: list[Host], tmp_path: Path, fault: str, lane: str) -> None:
    a, b = hosts  # auto: the tcp lane across hosts
    a.set_rate(RATE)
    producer, consumer = _producer(a, tmp_path / "p"), _consumer(b, tmp_path / "c", lane)
    try:
        _cut_mid_load(producer, consumer, a.link_down if fault == "link-down" else a.drop)
        if fault == "link-down":
            a.link_up()
        else:
            a.undrop()
        producer.wait_released(LEASE_S + 10)  # no leaked hold: the aborted release, or the lease
        a.set_rate(None)
        _loads_again(producer, consumer, "after")  # the same consumer process, no restart
        producer.wait_released(10)
    finally:
        assert consumer.close() == 0
        producer.close()


def test_producer_host_crash_mid_load_then_restarted(hosts: list[Host], tmp_path: Path) -> None:
    a, b = hosts
    a.set_rate(RATE)
    producer, consumer = _producer(a, tmp_path / "p"), _consumer(b, tmp_path / "c")
    try:
        _cut_mid_load(producer, consumer, a.crash)
        assert producer.proc.wait(10) != 0  # the producer died with its host
        producer.close()
        a.boot()  # the host comes back, same address, and the producer is started again
        a.set_rate(None)
        producer = _producer(a, tmp_path / "p2")
        _loads_again(producer, consumer, "restarted")
        producer.wait_released(10)
    finally:
        assert consumer.close() == 0
        producer.close()


TRICKLE_RATE = "2mbit"
TRICKLE_TOKENS = 16 * 512 + 3  # 32 MiB: over two minutes at TRICKLE_RATE
# the load's deadline and a scheduling slack: the report after it (the failed read's clean-up, the IO
# thread's hand-off, the peer's pump) on a loaded machine. The aborted release is not in it: it goes to its
# producer's own lane of the releaser, off the load's path.
TRICKLE_WITHIN_S = TIMEOUT_S + 1.0


@pytest.mark.parametrize("lane", ["auto", "ucp", "two-sided"])
def test_a_trickling_link_fails_the_load_by_its_deadline(hosts: list[Host], tmp_path: Path, lane: str) -> None:
    """``timeout_s`` bounds the whole load, not each wait: at a trickle the 32 MiB load would take minutes,
    yet it is reported within the deadline, every block failed and none counted (two-sided: the blocks not
    in by then); with the rate restored the same consumer loads bit-exact and the producer holds nothing
    (the aborted release, else the lease)."""
    a, b = hosts
    producer = hp.HostPeer(a, "producer", tmp_path / "p", "--lease", str(LEASE_S), "--num-blocks", "768")
    consumer = hp.HostPeer(b, "consumer", tmp_path / "c", "--num-blocks", "768", "--timeout", str(TIMEOUT_S),
                           "--lane", lane)
    try:
        _loads_again(producer, consumer, "warm")  # handshaken at full speed: what follows is the load alone
        producer.wait_released(10)
        a.set_rate(TRICKLE_RATE)
        params, _ = producer.prefill("slow", TRICKLE_TOKENS, seed=5)
        assert consumer.ask(op="begin", rid="slow", tokens=TRICKLE_TOKENS, seed=5, params=params)["started"] > 0
        got = consumer.ask(op="end", rid="slow", wait=TRICKLE_WITHIN_S + 10, timeout=TRICKLE_WITHIN_S + 30)
        assert "error" not in got, got  # reported (failed), not left hanging
        if lane == "two-sided":  # whole chunks that arrived before the deadline count there; the rest fail
            assert 0 < got["failed"] <= hp.full_blocks(TRICKLE_TOKENS), got
        else:  # one-sided: all or nothing
            assert got["loaded"] == 0 and got["failed"] == hp.full_blocks(TRICKLE_TOKENS), got
        assert got["seconds"] < TRICKLE_WITHIN_S, got
        a.set_rate(None)
        producer.wait_released(LEASE_S + 10)
        _loads_again(producer, consumer, "after")
        producer.wait_released(10)
    finally:
        assert consumer.close() == 0
        producer.close()
