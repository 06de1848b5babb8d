"""The producer restarted elsewhere: host A dies for good (every process killed, its link down, as a
machine that lost power), and the producer comes back on host C at another address. Hand-offs already
given out name host A: their loads fail every block within the consumer's ``timeout_s``, none counted
as loaded. New hand-offs name host C: the same consumer process (never restarted) loads them bit-exact,
dialling C's metadata server and lane it has never seen. Three emulated hosts on one bridge; needs root
(skips, saying why, without).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

import hostpeer as hp  # noqa: E402 - tests/helpers, on sys.path by tests/conftest.py

from kvbridge.testing.hosts import Host  # noqa: E402

TIMEOUT_S = 2.0  # the consumer's timeout_s
# one deadline for the handshake's dial, then room for a busy machine (the aborted release runs off the path)
FAIL_WITHIN_S = TIMEOUT_S + 4.0
TOKENS = 16 * 24 + 1


def _producer(host: Host, out: Path) -> hp.HostPeer:
    return hp.HostPeer(host, "producer", out, "--lease", "4", "--num-blocks", "256")


def _pull(consumer: hp.HostPeer, rid: str, params: dict, seed: int, wait: float) -> dict:
    return consumer.ask(op="pull", rid=rid, tokens=TOKENS, seed=seed, params=params, wait=wait, timeout=wait + 30)


def test_producer_restarted_on_another_host(three_hosts: list[Host], tmp_path: Path) -> None:
    a, b, c = three_hosts
    producer = _producer(a, tmp_path / "pa")
    consumer = hp.HostPeer(b, "consumer", tmp_path / "c", "--num-blocks", "256", "--timeout", str(TIMEOUT_S))
    moved: hp.HostPeer | None = None
    try:
        params, sent = producer.prefill("first", TOKENS, seed=3)
        assert params["metadata_address"].rpartition(":")[0] == a.address, params
        got = _pull(consumer, "first-c", params, 3, 30)
        assert got["failed"] == 0 and got["exact"] and got["sha"] == sent, got
        stale, _ = producer.prefill("stale", TOKENS, seed=4)  # given out, never pulled before A dies

        a.crash()
        a.link_down()  # a dead machine: nothing answers at its address, not even a reset
        assert producer.proc.wait(10) != 0
        producer.close()

        t0 = time.monotonic()
        got = _pull(consumer, "stale-c", stale, 4, FAIL_WITHIN_S + 10)
        took = time.monotonic() - t0
        assert got["loaded"] == 0 and got["failed"] == hp.full_blocks(TOKENS), got  # nothing counted as loaded
        assert took < FAIL_WITHIN_S, f"a load from the dead host took {took:.1f}s"

        moved = _producer(c, tmp_path / "pc")
        params, sent = moved.prefill("moved", TOKENS, seed=5)
        assert params["metadata_address"].rpartition(":")[0] == c.address, params
        got = _pull(consumer, "moved-c", params, 5, 30)
        assert got["failed"] == 0 and got["loaded"] == hp.full_blocks(TOKENS) and got["exact"] and got["sha"] == sent, got
        moved.wait_released(10)
    finally:
        assert consumer.close() == 0
        if moved is not None:
            moved.close()
        producer.close()
