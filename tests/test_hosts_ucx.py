"""The ``ucx`` backend across emulated hosts (kvbridge.testing.hosts): the producer on host A, the consumer on
host B, only a veth link between them (no cma, no shared memory, no common loopback), this process outside
both. Loads arrive bit-exact on the one-sided lanes (``auto`` takes ``tcp``, kvbridge's own streams; ``ucp``
over UCX's TCP on request) and the two-sided one; the
producer advertises a routable address without being told; a loopback address from another host is a
refusal that says which option to set, never a silent miss. Needs root (skips, saying why, without).

Peers: tests/helpers/ucx_fault_peer.py through tests/helpers/hostpeer.py — 4 layers, 4 KV heads, head size 64, bf16, block
size 16: 64 KiB per block.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

import hostpeer as hp  # noqa: E402 - tests/helpers, on sys.path by tests/conftest.py

from kvbridge.testing.hosts import Host  # noqa: E402


@pytest.mark.parametrize("lane", ["auto", "ucp", "two-sided"])
def test_loads_across_hosts_are_bit_exact(hosts: list[Host], tmp_path: Path, lane: str) -> None:
    a, b = hosts
    producer = hp.HostPeer(a, "producer", tmp_path / "p", "--lease", "30", "--num-blocks", "256")
    consumer = hp.HostPeer(b, "consumer", tmp_path / "c", "--lane", lane, "--num-blocks", "256", "--timeout", "5")
    try:
        for i, tokens in enumerate([16 * 3 + 5, 16 * 64, 16 * 200 + 1]):
            params, sent = producer.prefill(f"r{i}", tokens, seed=i)
            assert params["metadata_address"].rpartition(":")[0] == a.address  # derived, routable from b
            assert "net" not in params
            got = consumer.ask(op="pull", rid=f"c{i}", tokens=tokens, seed=i, params=params)
            assert got["failed"] == 0 and got["loaded"] == hp.full_blocks(tokens), got
            assert got["exact"] and got["sha"] == sent  # the bytes that arrived are the bytes that left
        producer.wait_released(10)
        stats = consumer.ask(op="state")["stats"]
        assert stats["refused_handoffs"] == 0
        if lane == "auto":  # tcp: cma cannot cross hosts; a load after the handshake starts from the step
            assert stats["started_loads"] == 2, stats
        if lane == "ucp":  # the one-sided lane over UCX, confirmed by the seal or the release
            assert stats["started_loads"] == 0
    finally:
        assert consumer.close() == 0
        assert producer.close() == 0


def test_loopback_from_another_host_is_refused_saying_which_option(hosts: list[Host], tmp_path: Path) -> None:
    a, b = hosts
    producer = hp.HostPeer(a, "producer", tmp_path / "p", "--advertise-host", "127.0.0.1", "--lease", "3")
    consumer = hp.HostPeer(b, "consumer", tmp_path / "c", "--timeout", "2")
    try:
        params, _ = producer.prefill("r", 16 * 8, seed=1)
        assert params["metadata_address"].startswith("127.0.0.1:") and params["net"]
        assert consumer.ask(op="begin", rid="c", tokens=16 * 8, seed=1, params=params)["started"] == 0  # a miss
        assert consumer.ask(op="state")["stats"]["refused_handoffs"] == 1
        assert "advertises the loopback address" in consumer.log() and "advertise_host" in consumer.log()
    finally:
        consumer.close()
        producer.close()


DERIVE = """
from kvbridge.connectors.ucx import UcxOptions
from kvbridge.errors import ConfigError
try:
    print(UcxOptions().advertised_host)
except ConfigError as exc:
    print("ConfigError:", exc)
"""


def _derived(host: Host) -> str:
    return host.run([sys.executable, "-c", DERIVE], capture_output=True, text=True, check=True).stdout.strip()


def test_the_advertised_host_is_derived_or_refused(hosts: list[Host]) -> None:
    a, _ = hosts
    assert _derived(a) == a.address  # the only address but loopback
    subprocess.run(["ip", "-n", a.netns, "addr", "add", "10.214.0.1/24", "dev", "eth0"], check=True)
    refused = _derived(a)  # two addresses and no default route: which one is the user's to say
    assert refused.startswith("ConfigError: advertise_host:") and "10.214.0.1" in refused and a.address in refused
    subprocess.run(["ip", "-n", a.netns, "route", "add", "default", "via", "10.214.0.2", "src", "10.214.0.1"],
                   check=True)
    assert _derived(a) == "10.214.0.1"  # the default route's source address
