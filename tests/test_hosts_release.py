"""Releases and pulls around a cut-off producer, across emulated hosts (needs root; skips, saying why,
without): a producer whose link is cut delays nobody else, its hold ends once the link is back (the
release, retried, long before the lease), and a two-sided producer serves a pull whole within
``timeout_s`` of its arrival, not per chunk. Peers are tests/helpers/ucx_fault_peer.py processes (64 KiB
per block) driven through tests/helpers/hostpeer.py; every load that arrives is compared byte for byte
with what its producer computed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

import hostpeer as hp  # noqa: E402 - tests/helpers, on sys.path by tests/conftest.py

from kvbridge.testing.hosts import Host  # noqa: E402

TIMEOUT_S = 3.0  # the consumer's timeout_s: a release to the cut producer waits up to this long per try
LONG_LEASE_S = 120.0  # far past the test: a hold that ends did so by the release, not the lease
TOKENS = 16 * 24 + 1


def _pull_exact(producer: Any, consumer: Any, rid: str, seed: int) -> dict[str, Any]:
    params, sent = producer.prefill(rid, TOKENS, seed=seed)
    got = consumer.ask(op="pull", rid=f"{rid}-c", tokens=TOKENS, seed=seed, params=params, wait=30)
    assert got["failed"] == 0 and got["loaded"] == hp.full_blocks(TOKENS) and got["exact"] and got["sha"] == sent, got
    return got


def _warm(producer: Any, consumer: Any, rid: str, seed: int) -> None:
    """The consumer's first load from ``producer`` (handshake, dial, read), bit-exact, then released. Its
    dialling shares ``timeout_s`` with nothing but a busy machine: one failed try (all blocks failed,
    nothing counted) is tried again, since what follows tests the loads after it, not this one."""
    params, sent = producer.prefill(rid, TOKENS, seed=seed)
    got = consumer.ask(op="pull", rid=f"{rid}-c", tokens=TOKENS, seed=seed, params=params, wait=30)
    if got["failed"]:
        assert got["loaded"] == 0, got  # all or nothing
        producer.wait_released(LONG_LEASE_S)  # the aborted release, on the consumer's releaser
        params, sent = producer.prefill(f"{rid}-again", TOKENS, seed=seed)
        got = consumer.ask(op="pull", rid=f"{rid}-again-c", tokens=TOKENS, seed=seed, params=params, wait=30)
    assert got["failed"] == 0 and got["loaded"] == hp.full_blocks(TOKENS) and got["exact"] and got["sha"] == sent, got
    producer.wait_released(10)


def test_a_cut_producer_delays_no_other_and_its_hold_ends_when_the_link_returns(three_hosts: list[Host],
                                                                                tmp_path: Path) -> None:
    """Host A's packets are dropped (connections hang, nothing fails fast) while the consumer on host B
    loads from A: that load fails by its deadline and its aborted release keeps failing on A's lane. Loads
    from the healthy producer on host C meanwhile arrive bit-exact, each reported within ``timeout_s``,
    and C's holds end at once: its releases never wait behind A's (one release to A takes up to
    ``timeout_s``). Once A's link is back, A's hold ends by the retried release, long before its lease."""
    a, b, c = three_hosts
    pa = hp.HostPeer(a, "producer", tmp_path / "pa", "--engine-id", "pa", "--lease", str(LONG_LEASE_S))
    pc = hp.HostPeer(c, "producer", tmp_path / "pc", "--engine-id", "pc", "--lease", str(LONG_LEASE_S))
    consumer = hp.HostPeer(b, "consumer", tmp_path / "b", "--timeout", str(TIMEOUT_S))
    try:
        for i, p in enumerate((pa, pc)):  # both handshaken at full speed
            _warm(p, consumer, f"warm{i}", seed=20 + i)
        params, _ = pa.prefill("cut", TOKENS, seed=7)
        a.drop()
        assert consumer.ask(op="begin", rid="cut", tokens=TOKENS, seed=7, params=params)["started"] > 0
        got = consumer.ask(op="end", rid="cut", wait=TIMEOUT_S + 10, timeout=TIMEOUT_S + 30)
        assert "error" not in got, got
        assert got["loaded"] == 0 and got["failed"] == hp.full_blocks(TOKENS), got
        assert got["seconds"] < TIMEOUT_S + 1.0, got  # the deadline, not the release to A after it
        assert pa.ask(op="state")["held"] == ["cut"]  # A never heard of the failure: its link is cut
        for i in range(3):  # A's aborted release is now on A's lane, failing (a try takes up to TIMEOUT_S)
            got = _pull_exact(pc, consumer, f"ok{i}", seed=30 + i)
            assert got["seconds"] < TIMEOUT_S, got
            assert pc.wait_released(TIMEOUT_S / 2) < TIMEOUT_S / 2  # not behind a release to A
        a.undrop()
        pa.wait_released(40)  # the retried release (its backoff: TIMEOUT_S, doubling), not the 120 s lease
        assert pa.ask(op="state")["stats"]["expired_leases"] == 0
        _pull_exact(pa, consumer, "back", seed=9)  # A serves the same consumer again, no restart
        pa.wait_released(10)
    finally:
        assert consumer.close() == 0
        pa.close()
        pc.close()


def test_a_two_sided_pull_is_served_within_timeout_s_of_its_arrival(hosts: list[Host], tmp_path: Path) -> None:
    """A 32 MiB two-sided pull at 40 Mbit/s (each 1 MiB chunk goes out well within ``timeout_s``, the whole
    would take over six seconds); just before its deadline the consumer's host stops answering (every
    packet dropped: the consumer cannot close its endpoint, nothing fails fast). The consumer fails the
    load by its deadline, and the producer stops serving it by the same deadline, counted from the
    pull's arrival — not one ``timeout_s`` after its last chunk's send began. With the link back, the
    producer's hold ends (the retried release, else the lease) and the next pull is bit-exact."""
    a, b = hosts
    timeout, blocks = 2.0, 768
    producer = hp.HostPeer(a, "producer", tmp_path / "p", "--lease", "8", "--num-blocks", str(blocks))
    consumer = hp.HostPeer(b, "consumer", tmp_path / "c", "--timeout", str(timeout), "--lane", "two-sided",
                           "--num-blocks", str(blocks))
    try:
        _pull_exact(producer, consumer, "warm", seed=3)
        producer.wait_released(10)
        a.set_rate("40mbit")
        tokens = 16 * 512 + 3
        params, _ = producer.prefill("long", tokens, seed=5)
        t0 = time.monotonic()
        assert consumer.ask(op="begin", rid="long", tokens=tokens, seed=5, params=params)["started"] > 0
        time.sleep(max(0.0, t0 + 0.9 * timeout - time.monotonic()))
        assert producer.ask(op="state")["serving"] == 1  # mid-pull
        b.drop()
        while producer.ask(op="state")["serving"]:  # the pull arrived just after t0
            assert time.monotonic() - t0 < timeout + 1.0, "the producer still serves the pull past its deadline"
            time.sleep(0.05)
        got = consumer.ask(op="end", rid="long", wait=timeout + 10, timeout=timeout + 30)
        assert "error" not in got, got
        assert 0 < got["failed"] <= hp.full_blocks(tokens) and got["seconds"] < timeout + 1.0, got
        b.undrop()
        a.set_rate(None)
        producer.wait_released(8 + 10)
        _pull_exact(producer, consumer, "after", seed=11)
        producer.wait_released(10)
    finally:
        assert consumer.close() == 0
        producer.close()
