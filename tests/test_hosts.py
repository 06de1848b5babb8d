"""The emulated hosts of kvbridge.testing.hosts: isolated from each other and from this process, joined only
by their link, and the link's faults (down, dropped packets, a crashed host) are real. Needs root."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvbridge.testing.hosts import EmulatedHosts, Host, unavailable

SERVE = """
import socket, sys
s = socket.create_server((sys.argv[1], 7000))
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"hello from " + socket.gethostname().encode())
    c.close()
"""
DIAL = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2])) as c:
        print(c.recv(100).decode())
except OSError as exc:
    print("failed", type(exc).__name__)
"""


def _serve(host: Host, bind: str) -> subprocess.Popen[str]:
    proc = host.popen([sys.executable, "-c", SERVE, bind], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


def _dial(host: Host, address: str, timeout: float = 2.0) -> str:
    return host.run([sys.executable, "-c", DIAL, address, str(timeout)], capture_output=True, text=True).stdout.strip()


def _root_addresses() -> str:
    return subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout


def test_hosts_reach_each_other_only_over_the_link(hosts: list[Host]) -> None:
    a, b = hosts
    assert a.address not in _root_addresses() and b.address not in _root_addresses()  # only inside the hosts
    server = _serve(a, "0.0.0.0")
    try:
        assert _dial(b, a.address) == "hello from kvb-host-a"
        assert _dial(b, "127.0.0.1").startswith("failed")  # b's loopback is b's own
        assert _dial(a, "127.0.0.1") == "hello from kvb-host-a"
    finally:
        server.kill()
        server.wait(10)
    assert b.run(["hostname"], capture_output=True, text=True).stdout.strip() == "kvb-host-b"
    # their own pid namespaces: each host sees its init as pid 1 and none of the other's processes
    ps_a = a.run(["sh", "-c", "ls /proc | grep -c '^[0-9]'"], capture_output=True, text=True).stdout
    assert 0 < int(ps_a) < 10
    assert b.run(["sh", "-c", "ls /dev/shm | wc -l"], capture_output=True, text=True).stdout.strip() == "0"


def test_link_down_and_up(hosts: list[Host]) -> None:
    a, b = hosts
    server = _serve(a, a.address)
    try:
        a.link_down()
        assert _dial(b, a.address, 1.0).startswith("failed")
        a.link_up()
        deadline = time.monotonic() + 10
        while (got := _dial(b, a.address)) != "hello from kvb-host-a":
            assert time.monotonic() < deadline, got
    finally:
        server.kill()
        server.wait(10)


def test_dropped_packets_are_silence_until_undropped(hosts: list[Host]) -> None:
    a, b = hosts
    server = _serve(a, a.address)
    try:
        a.drop()
        t0 = time.monotonic()
        assert _dial(b, a.address, 1.0) == "failed TimeoutError"  # silence, not a refusal
        assert time.monotonic() - t0 >= 0.9
        a.undrop()
        assert _dial(b, a.address) == "hello from kvb-host-a"
    finally:
        server.kill()
        server.wait(10)


def test_crash_kills_every_process_of_the_host_and_boot_brings_it_back(hosts: list[Host]) -> None:
    a, b = hosts
    procs = [a.popen(["sleep", "60"]) for _ in range(3)]
    nested = a.popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    other = b.popen(["sleep", "60"])
    a.crash()
    for p in [*procs, nested]:
        assert p.wait(10) != 0
    assert other.poll() is None  # the other host lives on
    with pytest.raises(RuntimeError, match="down"):
        a.popen(["true"])
    a.boot()
    server = _serve(a, a.address)
    try:
        assert _dial(b, a.address) == "hello from kvb-host-a"
    finally:
        server.kill()
        assert server.wait(10) != 0  # kill() reached the program, not only nsenter
        other.kill()
        other.wait(10)


def test_rate_cap_and_three_hosts_on_a_bridge() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with EmulatedHosts(3, rate="10gbit") as (a, b, c):
        qdisc = subprocess.run(["ip", "netns", "exec", a.netns, "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdisc and "10Gbit" in qdisc
        server = _serve(c, c.address)
        try:
            assert _dial(a, c.address) == "hello from kvb-host-c"
            assert _dial(b, c.address) == "hello from kvb-host-c"
        finally:
            server.kill()
            server.wait(10)


def test_teardown_on_failure_leaves_nothing() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    made = EmulatedHosts(2)
    with pytest.raises(ZeroDivisionError), made as (a, _b):
        sleeper = a.popen(["sleep", "60"])
        _ = 1 / 0
    assert sleeper.wait(10) != 0
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert all(h.netns not in names for h in made.hosts)


def test_bad_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="10gbit"):
        EmulatedHosts(2, rate="fast")


def test_pods_share_the_network_but_not_pids_or_shared_memory() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with EmulatedHosts(2, pods=True) as (a, b):
        assert a.netns == b.netns and a.address == b.address == "127.0.0.1"
        server = _serve(a, "127.0.0.1")
        try:
            assert _dial(b, "127.0.0.1") == "hello from kvb-pod-a"  # one network: loopback crosses
        finally:
            server.kill()
            server.wait(10)
        a.run(["sh", "-c", "echo x > /dev/shm/kvb-probe"], check=True)
        assert b.run(["ls", "/dev/shm"], capture_output=True, text=True).stdout.strip() == ""  # its own /dev/shm
        pids_b = b.run(["sh", "-c", "ls /proc | grep -c '^[0-9]'"], capture_output=True, text=True).stdout
        assert 0 < int(pids_b) < 10  # its own pid namespace
    with pytest.raises(ValueError, match="rate"):
        EmulatedHosts(2, pods=True, rate="10gbit")
