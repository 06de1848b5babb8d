"""The ``tcp`` lane of the ``ucx`` backend: one-sided reads between hosts over kvbridge's own TCP streams.

The producer worker runs a :class:`kvbridge._core.TcpServer` over its registered KV (and its seal
table): C threads that write the requested byte ranges straight from the KV to sockets, never the
engine, never Python per block. Its port and a per-registration secret go into the handshake answer,
which only a consumer that passed the metadata plane's token and named a granted hand-off gets (like
UCX's worker address and rkeys). The consumer's :class:`kvbridge._core.TcpSource` reads a load's
descriptors over ``tcp_streams`` connections at once straight into its KV, then each stream's seal
word; the bytes count as the other one-sided lanes' do (:mod:`.onesided`: the seal, else the
confirming release).

Why: UCX over TCP has no one-sided GET; it emulates it with active messages on one connection, served
by a progress thread, and moves a fraction of what plain sockets move on the same link (bench case:
``kvbridge bench hosts``, rows ``kvbridge-ucp`` and ``tcp:N``). RDMA and CUDA memory stay ``ucp``'s.

**The local medium** (option ``tcp_local``, on by default): the producer also listens on an abstract Unix
socket whose name (random) crosses in the handshake answer. Such a socket exists only inside its network
namespace, so a consumer that can connect to it shares the producer's network namespace (two pods of a
node with one network, engines whose pid namespaces keep ``cma`` out): its streams then take the KV's pages
through pipes by reference, one copy instead of TCP's two (``kvbridge/csrc/tcp_local.c``; bench case:
``kvbridge bench hosts --pods``, rows ``kvbridge``, ``pipe:4`` and ``ctcp-sndbuf:4``). Anywhere else the
name is not found and the streams are TCP's.

**Trust.** The traffic is neither encrypted nor authenticated beyond the secret, which crosses the
metadata plane (TLS there when configured) and is then sent in clear on every connection: anyone who
can watch the link can read the KV it carries and learn the secret, and with it read any byte of the
producer's registered KV (never outside it: the server checks every range). Trusted networks only.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import secrets
import socket
import sys
from typing import Any

import numpy as np

from kvbridge import native, routable
from kvbridge.errors import PeerUnreachable

log = logging.getLogger(__name__)

ADDRESS, SECRET = "ucx1s_tcp", "ucx1s_tcp_secret"  # handshake transport keys: "host:port", the secret (hex)
LOCAL = "ucx1s_tcp_local"  # ... the abstract Unix socket's name (the local medium), where served
# A producer's send buffer per connection: small enough that the bytes in flight stay in the CPU's caches,
# large enough for a datacenter link's bytes in flight over 4 streams (the reason: tcp_serve.c's header;
# bench case: benches/tcp_lane_probe.py, rows scat:4 with @KVB... and `kvbridge bench hosts`)
SNDBUF = 512 << 10
IDLE_S = 300.0  # a producer closes a connection idle this long; consumers reuse theirs for less (tcp_read.c)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the lane takes from :class:`~.options.UcxOptions`."""

    host: str = "127.0.0.1"  # where the producer listens (its metadata server's host)
    advertise: str = "127.0.0.1"  # what consumers dial
    port: int = 0  # 0: a free port per worker
    streams: int = 4  # connections a consumer reads one load over
    # consumer: a read is over by its start + timeout_s, whole; producer: each request answered by its
    # arrival + timeout_s (and the hello by the accept's); bytes that keep trickling in do not extend either
    timeout_s: float = 10.0
    sndbuf: int = SNDBUF  # each served connection's SO_SNDBUF (0: the kernel's auto-tuned one)
    local: bool = True  # producer: serve the local medium too; consumer: use it where the producer's is reachable


def why_not() -> str:
    """Why the lane cannot run here ("" when it can): it needs :mod:`kvbridge._core` with the tcp lane."""
    mod, why = native.load_core()
    if mod is None:
        return why
    return "" if hasattr(mod, "TcpServer") else "kvbridge._core was built without the tcp lane"


def _numeric(host: str) -> str:
    """``host`` as a numeric address (the C side never resolves names: a lookup has no deadline there)."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        if not infos:
            raise PeerUnreachable(f"tcp lane: {host!r} resolves to no address") from None
        return str(infos[0][4][0])


def _listen_address(host: str) -> str:
    """Where a server for ``host`` binds: a wildcard stays one (``::`` takes IPv4 too where the system's
    ``bindv6only`` is off, as by default), anything else as a numeric address."""
    if routable.is_wildcard(host):
        return "::" if host.strip("[]") == "::" else "0.0.0.0"  # noqa: S104 - a wildcard asked for
    return _numeric(host)


class Server:
    """A producer worker's TCP server over its KV ``regions`` and seal table ``seals`` (address, bytes)."""

    def __init__(self, regions: list[tuple[int, int]], seals: tuple[int, int], settings: Settings):
        mod, _ = native.load_core()
        assert mod is not None
        self.secret = secrets.token_bytes(32)
        host = _listen_address(settings.host)
        # 128 random bits: no other process picks it by chance, and a consumer cannot mistake another's for it
        self.local = f"kvbridge-{secrets.token_hex(16)}" if settings.local and sys.platform.startswith("linux") else ""
        self._server: Any = mod.TcpServer(host, settings.port, regions, self.secret, seals=seals,
                                          timeout_s=settings.timeout_s, idle_s=IDLE_S, sndbuf=settings.sndbuf,
                                          local=self.local)
        self.address = f"{settings.advertise}:{self._server.port}"

    def transport(self) -> dict[str, bytes]:
        out = {ADDRESS: self.address.encode(), SECRET: self.secret.hex().encode()}
        if self.local:
            out[LOCAL] = self.local.encode()
        return out

    def stats(self) -> tuple[int, int, int, int]:
        """(connections, requests, bytes served, refused)."""
        return tuple(self._server.stats())  # type: ignore[return-value]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving; returns once no serving thread reads the KV any more (the caller frees it next)."""
        if not self._server.close(timeout_s):
            log.warning("tcp lane: serving threads still running after %.0fs at close", timeout_s)


def offered(transport: dict[str, bytes]) -> bool:
    return ADDRESS in transport and SECRET in transport


def reachable_locally(name: str) -> bool:
    """Whether the abstract Unix socket ``name`` listens in this process's network namespace (the connection
    made to find out is closed at once; the server drops it when no hello follows)."""
    if not sys.platform.startswith("linux"):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect("\0" + name)
        except OSError:  # ECONNREFUSED (no such name here), EAGAIN (its backlog is full: TCP then)
            return False
    return True


def connect(transport: dict[str, bytes], settings: Settings) -> Any:
    """A :class:`kvbridge._core.TcpSource` for the producer that answered ``transport`` (connections open
    on its first read): over the producer's local socket where this process reaches it (and
    ``settings.local``), else over TCP."""
    mod, why = native.load_core()
    if mod is None or not hasattr(mod, "TcpSource"):
        raise PeerUnreachable(f"lane 'tcp' needs kvbridge._core's tcp lane: {why or 'built without it'}")
    host, _, port = transport[ADDRESS].decode().rpartition(":")
    secret = bytes.fromhex(transport[SECRET].decode())
    local = transport.get(LOCAL, b"").decode()
    if settings.local and local and reachable_locally(local):
        log.info("tcp lane to %s: the producer shares this network namespace, KV through pipes", host)
        return mod.TcpSource("@" + local, 0, secret, streams=settings.streams, timeout_s=settings.timeout_s)
    return mod.TcpSource(_numeric(host), int(port), secret, streams=settings.streams, timeout_s=settings.timeout_s)


def is_local(source: Any) -> bool:
    """Whether ``source`` (from :func:`connect`) reads through pipes (the local medium)."""
    return bool(getattr(source, "local", False))


def seal_word(source: Any, address: int, timeout_s: float | None = None) -> int:
    """The word at ``address`` of the producer's seal table, read now over ``source`` (a request of no
    bytes) within ``timeout_s`` (default: the source's); 0 when it cannot be read (then the release must
    confirm)."""
    none = np.zeros(0, dtype=np.uint64)
    try:
        return int(source.start(none, none, none, address, timeout_s).result()[1])
    except OSError as exc:
        log.info("reading the seal over tcp failed (%s): the release confirms", exc)
        return 0


__all__ = ["ADDRESS", "LOCAL", "SECRET", "Server", "Settings", "connect", "is_local", "offered", "reachable_locally",
           "seal_word", "why_not"]
