"""Emulated hosts on one Linux machine, for tests and benchmarks of kvbridge across machines (needs root).

Each :class:`Host` is its own network namespace with one interface ``eth0`` and one address that exists only
there (``10.213.0.1``, ``10.213.0.2``, ...), plus one long-lived init process that owns the host's pid, uts
(hostname), IPC and mount namespaces (a private ``/proc`` and an empty ``/dev/shm``). Every process started
on a host (:meth:`Host.popen`) joins all of them, so nothing that works only on one machine can cross: no
``process_vm_readv`` of the peer (cma), no shared memory, no loopback, no ``/proc`` of the other side — only
the link. The file system is shared (a directory can play a shared volume).

Two hosts are joined by one veth pair; three or more by veths to a bridge in a ``switch`` namespace.
Faults: :meth:`Host.link_down` / :meth:`Host.link_up` (the interface), :meth:`Host.drop` / :meth:`Host.undrop`
(every packet in and out dropped by nftables, or by a ``tc`` filter where ``nft`` is missing; the interface
stays up, so connections hang rather than fail), :meth:`Host.crash` (SIGKILL to the host's init: the kernel
kills every process of the host) and :meth:`Host.boot` (a fresh init, same address). ``rate`` caps each
host's egress with ``tc tbf``, the way a NIC caps a link.

    with EmulatedHosts(2, rate="10gbit") as (a, b):
        producer = a.popen([sys.executable, "producer.py"])
        consumer = b.popen([sys.executable, "consumer.py", a.address])

:func:`unavailable` says why hosts cannot be made here (not root, no ``ip``/``unshare``/``nsenter``, no
network namespaces), for a test's skip reason. Teardown kills every host's processes and deletes the
namespaces, which removes the veths; names carry this process's id, so concurrent runs do not collide.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import Any

SUBNET = "10.213.0"
_COUNTER = itertools.count()
_INIT_SCRIPT = 'hostname "$0" && mount -t tmpfs tmpfs /dev/shm && exec sleep infinity'


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why emulated hosts cannot be made here (a skip reason), or ``None`` if they can."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network, pid and IPC namespaces)"
    missing = [tool for tool in ("ip", "unshare", "nsenter", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated hosts need {', '.join(missing)} (iproute2, util-linux)"
    probe = f"kvbprobe{os.getpid()}-{next(_COUNTER)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


def _child_pid(proc: subprocess.Popen[Any], timeout: float) -> int:
    """The first child of ``proc`` (nsenter's or unshare's program), or ``proc``'s own pid once it is gone."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = f.read().split()
            if children:
                return int(children[0])
        if proc.poll() is not None or time.monotonic() > deadline:
            return proc.pid
        time.sleep(0.005)


class _NsPopen(subprocess.Popen):  # type: ignore[type-arg]
    """A process started by ``nsenter``: signals go to the program inside the host, not to nsenter.

    nsenter forks the program into the host's pid namespace and waits for it (exiting with its status, or
    by its signal) but does not forward signals, so :meth:`send_signal` (and ``kill``/``terminate``)
    targets its child.
    """

    def inner_pid(self, timeout: float = 5.0) -> int:
        """The program's pid as this (outer) namespace sees it."""
        return _child_pid(self, timeout)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.inner_pid(), sig)


class Host:
    """One emulated host: see the module's text. Made by :class:`EmulatedHosts`."""

    def __init__(self, netns: str, hostname: str, address: str):
        self.netns, self.hostname, self.address = netns, hostname, address
        self.iface = "eth0"
        self._init: subprocess.Popen[bytes] | None = None
        self._init_pid = 0
        self._drop = ""  # "nft" or "tc" while packets are dropped

    # ---- processes -------------------------------------------------------------------------------------
    def boot(self) -> None:
        """Start the host's init (its pid, uts, IPC and mount namespaces); a crashed host comes back."""
        if self.alive:
            return
        self._init = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--uts", "--ipc", "--mount-proc",
             "--", "sh", "-c", _INIT_SCRIPT, self.hostname],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        probe = _child_pid(self._init, 10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the init has set the hostname and mounted /dev/shm once it sleeps
            with contextlib.suppress(OSError):
                with open(f"/proc/{probe}/comm") as f:
                    booted = f.read().strip() == "sleep"
                if booted and probe != self._init.pid:
                    self._init_pid = probe
                    return
            if self._init.poll() is not None:
                break
            time.sleep(0.01)
        err = self._init.stderr.read().decode() if self._init.poll() is not None and self._init.stderr else ""
        raise RuntimeError(f"host {self.hostname} did not boot: {err.strip()}")

    @property
    def alive(self) -> bool:
        return self._init is not None and self._init.poll() is None and self._init_pid > 0

    def prefix(self) -> list[str]:
        """The argv prefix that runs a command on this host (all its namespaces)."""
        if not self.alive:
            raise RuntimeError(f"host {self.hostname} is down (crashed, or not booted)")
        return ["nsenter", "-t", str(self._init_pid), "-n", "-p", "-u", "-i", "-m", "--"]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` of ``argv`` on this host; its ``kill()`` reaches the program itself."""
        return _NsPopen([*self.prefix(), *argv], **kwargs)

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        kwargs.setdefault("timeout", 60)
        return subprocess.run([*self.prefix(), *argv], **kwargs)

    def crash(self) -> None:
        """Every process of this host dies at once (SIGKILL to its init: the kernel kills the namespace)."""
        if self._init is None:
            return
        if self._init_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._init_pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._init.wait(10)
        if self._init.poll() is None:
            self._init.kill()
            self._init.wait(10)
        if self._init.stderr:
            self._init.stderr.close()
        self._init, self._init_pid = None, 0

    # ---- the link --------------------------------------------------------------------------------------
    def _in_ns(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], check=check, capture_output=True, text=True,
                              timeout=30)

    def link_down(self) -> None:
        """Cut this host's link (its interface goes down: peers' packets are lost, local sends fail)."""
        _ip("-n", self.netns, "link", "set", self.iface, "down")

    def link_up(self) -> None:
        _ip("-n", self.netns, "link", "set", self.iface, "up")

    def drop(self) -> None:
        """Drop every packet to and from this host (the interface stays up: peers see silence, not errors)."""
        if self._drop:
            return
        if shutil.which("nft"):
            self._in_ns("nft", "add table inet kvbfault; "
                        "add chain inet kvbfault in { type filter hook input priority -10 ; policy drop ; }; "
                        "add chain inet kvbfault out { type filter hook output priority -10 ; policy accept ; }; "
                        f'add rule inet kvbfault out oifname "{self.iface}" drop')
            self._in_ns("nft", f'insert rule inet kvbfault in iifname != "{self.iface}" accept')
            self._drop = "nft"
        else:
            for direction in ("ingress", "egress"):
                self._in_ns("tc", "qdisc", "replace", "dev", self.iface, "clsact")
                self._in_ns("tc", "filter", "add", "dev", self.iface, direction, "matchall", "action", "drop")
            self._drop = "tc"

    def undrop(self) -> None:
        if self._drop == "nft":
            self._in_ns("nft", "delete", "table", "inet", "kvbfault")
        elif self._drop == "tc":
            self._in_ns("tc", "qdisc", "del", "dev", self.iface, "clsact", check=False)
        self._drop = ""

    def set_rate(self, rate: str | None) -> None:
        """Cap this host's egress at ``rate`` (tc units: ``10gbit``), or lift the cap (``None``)."""
        if rate is None:
            self._in_ns("tc", "qdisc", "del", "dev", self.iface, "root", check=False)
            return
        bits = _rate_bits(rate)
        burst = max(1 << 20, bits // 8 // 500)  # 2 ms of the rate: tbf needs a bucket of a timer tick's bytes
        self._in_ns("tc", "qdisc", "replace", "dev", self.iface, "root", "tbf", "rate", rate, "burst", str(burst),
                    "latency", "50ms")

    def __repr__(self) -> str:
        return f"Host({self.hostname}, {self.address}, {'up' if self.alive else 'down'})"


def _rate_bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12, "bit": 1}
    text = rate.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * scale)
    raise ValueError(f"link rate {rate!r}: expected a number and kbit/mbit/gbit/tbit (e.g. 10gbit)")


class EmulatedHosts:
    """``n`` hosts joined by a link (veth pair, or a bridge for three or more); a context manager.

    ``pods=True`` makes ``n`` pods on one node instead: one network namespace (loopback only, address
    ``127.0.0.1``) shared by all, each pod its own pid, uts, IPC and mount namespaces — the placement where
    the network is common but cma and shared memory cannot cross. No link faults or rate cap there."""

    def __init__(self, n: int = 2, *, rate: str | None = None, mtu: int | None = None, pods: bool = False):
        if n < 2:
            raise ValueError(f"EmulatedHosts needs at least two hosts, got {n}")
        if rate is not None:
            _rate_bits(rate)
        if pods and (rate or mtu):
            raise ValueError("pods on one node share their network: no rate cap or mtu")
        tag = f"kvb{os.getpid()}x{next(_COUNTER)}"
        self.pods = pods
        self.switch = f"{tag}-sw" if n > 2 and not pods else ""
        if pods:
            self.hosts = [Host(f"{tag}-node", f"kvb-pod-{chr(97 + i)}", "127.0.0.1") for i in range(n)]
            for h in self.hosts:
                h.iface = "lo"
        else:
            self.hosts = [Host(f"{tag}-{chr(97 + i)}", f"kvb-host-{chr(97 + i)}", f"{SUBNET}.{i + 1}") for i in range(n)]
        self.rate, self.mtu = rate, mtu
        self._made: list[str] = []

    def up(self) -> list[Host]:
        if self.pods:
            return self._pods_up()
        try:
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                self._made.append(h.netns)
            if self.switch:
                _ip("netns", "add", self.switch)
                self._made.append(self.switch)
                _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
                _ip("-n", self.switch, "link", "set", "br0", "up")
                for i, h in enumerate(self.hosts):
                    _ip("link", "add", "eth0", "netns", h.netns, "type", "veth", "peer", "name", f"p{i}",
                        "netns", self.switch)
                    _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            else:
                a, b = self.hosts
                _ip("link", "add", "eth0", "netns", a.netns, "type", "veth", "peer", "name", "eth0", "netns", b.netns)
            for h in self.hosts:
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                if self.mtu:
                    _ip("-n", h.netns, "link", "set", "eth0", "mtu", str(self.mtu))
                _ip("-n", h.netns, "link", "set", "lo", "up")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
                if self.rate:
                    h.set_rate(self.rate)
                h.boot()
        except BaseException:
            self.down()
            raise
        return self.hosts

    def _pods_up(self) -> list[Host]:
        node = self.hosts[0].netns
        try:
            _ip("netns", "add", node)
            self._made.append(node)
            _ip("-n", node, "link", "set", "lo", "up")
            for h in self.hosts:
                h.boot()
        except BaseException:
            self.down()
            raise
        return self.hosts

    def down(self) -> None:
        """Kill every host's processes and delete the namespaces (and with them the veths); idempotent."""
        for h in self.hosts:
            with contextlib.suppress(Exception):
                h.crash()
        for netns in reversed(self._made):
            _ip("netns", "del", netns, check=False)
        self._made.clear()

    def __enter__(self) -> list[Host]:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


@contextlib.contextmanager
def emulated_hosts(n: int = 2, *, rate: str | None = None, mtu: int | None = None,
                   pods: bool = False) -> Iterator[list[Host]]:
    """:class:`EmulatedHosts` as a generator context (for fixtures)."""
    with EmulatedHosts(n, rate=rate, mtu=mtu, pods=pods) as hosts:
        yield hosts


__all__ = ["EmulatedHosts", "Host", "emulated_hosts", "unavailable"]
