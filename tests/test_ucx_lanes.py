"""Which lane ``lane="auto"`` takes (kvbridge.connectors.ucx.lanes.auto), and where the tcp lane's server
listens for a wildcard host.

The transport-name lists below are written out the way UCX's ``Endpoint.transports()`` reports an
endpoint's lanes (``rc_mlx5``, ``ud_verbs``, ``tcp``, ...), because no RDMA device exists on the machines
these tests run on: the RDMA branch of the choice cannot be reached through a real endpoint here. The
branches a real endpoint reaches (cma on one host, tcp across emulated hosts, ucp on request) are covered
end to end by tests/test_ucx_onesided.py and tests/test_hosts_ucx.py.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
from kvbridge.connectors.ucx import lanes

from kvbridge import native

# what UCX reports (transport names) for an endpoint over ...
CONNECTX = ["rc_mlx5", "rc_mlx5", "ud_mlx5"]  # a ConnectX NIC with mlx5 accelerated verbs
VERBS = ["rc_verbs", "ud_verbs"]  # plain verbs (another vendor's RDMA NIC, or mlx5 without accel)
TCP_ONLY = ["tcp"]  # TCP alone (no RDMA device), with or without keepalive lanes
ROCE_AND_TCP = ["ud_verbs", "tcp"]  # RoCE beside TCP: UCX has an RDMA lane


@pytest.mark.parametrize("transports", [CONNECTX, VERBS, ROCE_AND_TCP])
def test_rdma_keeps_ucp_between_hosts(transports: list[str]) -> None:
    assert lanes.has_rdma(transports)
    assert lanes.auto("host", False, transports, tcp_offered=True) == "ucp"  # a GET the NIC serves
    assert lanes.auto("cuda", False, transports, tcp_offered=False) == "ucp"


@pytest.mark.parametrize("transports", [TCP_ONLY, []])
def test_over_tcp_alone_the_tcp_lane_moves_host_memory(transports: list[str]) -> None:
    assert not lanes.has_rdma(transports)
    assert lanes.auto("host", False, transports, tcp_offered=True) == "tcp"
    assert lanes.auto("host", False, transports, tcp_offered=False) == "ucp"  # a producer without the tcp lane
    assert lanes.auto("cuda", False, transports, tcp_offered=False) == "ucp"  # device memory: never to a socket


def test_same_host_takes_cma_whatever_ucx_has() -> None:
    for transports in (CONNECTX, TCP_ONLY, None):
        assert lanes.auto("host", True, transports, tcp_offered=True) == "cma"
    assert lanes.auto("cuda", True, CONNECTX, tcp_offered=False) == "ucp"  # cma reads host memory only


def test_without_a_ucx_endpoint() -> None:
    assert lanes.auto("host", False, None, tcp_offered=True) == "tcp"
    assert lanes.auto("host", False, None, tcp_offered=False) == ""  # no one-sided lane: the caller says why
    assert lanes.auto("cuda", False, None, tcp_offered=False) == ""


@pytest.mark.skipif(not hasattr(native.load_core()[0], "TcpServer"), reason="kvbridge._core with the tcp lane")
@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "[::]"])
def test_a_wildcard_host_listens_everywhere(host: str) -> None:
    """Every spelling of kvbridge.routable.is_wildcard binds a wildcard (``::`` included) and serves over
    IPv4 loopback, bit-exact."""
    from kvbridge.connectors.ucx import tcplane

    if host.strip("[]") == "::" and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    data = np.arange(1 << 17, dtype=np.uint64)
    server = tcplane.Server([(data.ctypes.data, data.nbytes)], (0, 0), tcplane.Settings(host=host, timeout_s=5))
    try:
        port = server.address.rpartition(":")[2]
        transport = {tcplane.ADDRESS: f"127.0.0.1:{port}".encode(), tcplane.SECRET: server.secret.hex().encode()}
        source = tcplane.connect(transport, tcplane.Settings(timeout_s=5))
        got = np.zeros_like(data)
        one = np.ones(1, dtype=np.uint64)
        nbytes, _ = source.start(one * data.ctypes.data, one * got.ctypes.data, one * data.nbytes).result()
        source.close()
        assert nbytes == data.nbytes and np.array_equal(got, data)
    finally:
        server.close()
