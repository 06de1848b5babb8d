"""A dead producer's loads delay no other producer's, across emulated hosts (needs root; skips, saying why,
without). The consumer on host B runs more loads from producer A than it has IO threads per producer
(``LOAD_THREADS``) while A's packets are dropped (its host unreachable: nothing answers, nothing fails
fast), so each of them holds its thread up to ``timeout_s``; a load from producer C, started just after,
must arrive bit-exact in a fraction of ``timeout_s`` (connectors/ucx/slots.py: each producer has its own
threads). Once on lanes whose loads block an IO thread (``ucp``, two-sided) with both producers already
handshaken, once on the ``auto`` lane where the first loads from A and C each need a handshake on an IO
thread. A's loads fail every block by their deadlines. Peers are tests/helpers/ucx_fault_peer.py
processes driven through tests/helpers/hostpeer.py; the slot machinery alone: tests/test_ucx_slots.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

import hostpeer as hp  # noqa: E402 - tests/helpers, on sys.path by tests/conftest.py
from kvbridge.connectors.ucx.puller import LOAD_THREADS  # noqa: E402

from kvbridge.testing.hosts import Host  # noqa: E402

TIMEOUT_S = 4.0  # the consumer's timeout_s: each of A's loads holds its IO thread this long
HEALTHY_S = TIMEOUT_S / 4  # C's load arrives within this: on one shared pool it waited for A's first loads to time out
DUE_S = TIMEOUT_S + 1.0  # each of A's loads fails by its deadline, plus the report's scheduling on a loaded machine
STUCK = LOAD_THREADS + 2  # loads from A at once: more than the threads one producer may hold
TOKENS = 16 * 24 + 1  # C's load
STUCK_TOKENS = 16 * 4 + 1  # each of A's


def _warm(producer: Any, consumer: Any, rid: str, seed: int) -> None:
    """A first load from ``producer`` (handshake, dial), bit-exact, then released: what follows tests the loads
    after the handshake. A first try failed by a busy machine (all blocks failed) is tried once more."""
    for attempt in range(2):
        params, sent = producer.prefill(f"{rid}{attempt}", TOKENS, seed=seed)
        got = consumer.ask(op="pull", rid=f"{rid}{attempt}-c", tokens=TOKENS, seed=seed, params=params, wait=30)
        if not got["failed"]:
            break
        assert got["loaded"] == 0, got  # all or nothing
    assert got["failed"] == 0 and got["exact"] and got["sha"] == sent, got
    producer.wait_released(10)


def _stuck_and_healthy(a: Host | None, pa: Any, pc: Any, consumer: Any) -> None:
    """Host ``a`` (if given) drops every packet; the consumer begins ``STUCK`` loads from A, then pulls from
    C: C's load is bit-exact within ``HEALTHY_S``. Then A's loads fail every block, each within ``DUE_S`` of
    its start, those queued behind A's own busy threads too (a load is due timeout_s after the engine
    started it, however long it waited for a thread)."""
    got = pa.ask(op="prefill", reqs=[[f"a{i}", STUCK_TOKENS, 40 + i] for i in range(STUCK)])
    params_a = got["params"]
    params_c, sent_c = pc.prefill("healthy", TOKENS, seed=9)
    if a is not None:
        a.drop()
    for i in range(STUCK):
        assert consumer.ask(op="begin", rid=f"a{i}", tokens=STUCK_TOKENS, seed=40 + i, params=params_a[f"a{i}"])["started"] > 0
    got = consumer.ask(op="pull", rid="healthy", tokens=TOKENS, seed=9, params=params_c, wait=3 * TIMEOUT_S)
    assert "error" not in got, got
    assert got["failed"] == 0 and got["loaded"] == hp.full_blocks(TOKENS) and got["exact"] and got["sha"] == sent_c, got
    assert got["seconds"] < HEALTHY_S, f"C's load waited behind A's: {got}"
    for i in range(STUCK):
        got = consumer.ask(op="end", rid=f"a{i}", wait=STUCK * 2 * TIMEOUT_S + 10, timeout=STUCK * 2 * TIMEOUT_S + 30)
        assert "error" not in got, got
        assert got["loaded"] == 0 and got["failed"] == hp.full_blocks(STUCK_TOKENS), got
        assert got["seconds"] < DUE_S, got
    pc.wait_released(10)  # C's hold ended: its release went on C's own lane


@pytest.mark.parametrize("lane", ["ucp", "two-sided"])
def test_loads_stuck_on_a_dead_producer_delay_no_other(three_hosts: list[Host], tmp_path: Path, lane: str) -> None:
    a, b, c = three_hosts
    pa = hp.HostPeer(a, "producer", tmp_path / "pa", "--engine-id", "pa")
    pc = hp.HostPeer(c, "producer", tmp_path / "pc", "--engine-id", "pc")
    consumer = hp.HostPeer(b, "consumer", tmp_path / "b", "--timeout", str(TIMEOUT_S), "--lane", lane)
    try:
        for i, p in enumerate((pa, pc)):  # both handshaken at full speed: A's loads block in the read itself
            _warm(p, consumer, f"warm{i}", seed=20 + i)
        # No load from A waits past its own deadline: not for a thread (a load is due timeout_s after its start;
        # before, those queued failed a round later, up to 4 x timeout_s), not for a handshake a queued load
        # began (before, the failed loads' clean-up waited for it to end: 2 x timeout_s)
        _stuck_and_healthy(a, pa, pc, consumer)
    finally:
        a.undrop()
        assert consumer.close() == 0
        pa.close()
        pc.close()


def test_first_loads_from_a_wedged_producer_delay_no_others_handshake(three_hosts: list[Host], tmp_path: Path) -> None:
    """No producer handshaken yet (``auto``: the ``tcp`` lane across hosts, whose loads start on native
    threads once handshaken): C's first load needs a handshake on an IO thread, while A's loads wait in
    theirs. A's server accepts and never answers a handshake (a wedged process: where A's packets are
    dropped, a new handshake fails at gRPC's connect timeout, long before ``timeout_s``). The loads that
    waited for A's failed handshake fail with it, not one handshake's deadline each after it."""
    a, b, c = three_hosts
    pa = hp.HostPeer(a, "producer", tmp_path / "pa", "--engine-id", "pa", "--hang-handshake")
    pc = hp.HostPeer(c, "producer", tmp_path / "pc", "--engine-id", "pc")
    consumer = hp.HostPeer(b, "consumer", tmp_path / "b", "--timeout", str(TIMEOUT_S))
    try:
        _stuck_and_healthy(None, pa, pc, consumer)
        assert consumer.ask(op="state")["stats"]["lane_tcp_loads"] == 1  # C's, over the lane auto took
    finally:
        assert consumer.close() == 0
        pa.close()
        pc.close()
