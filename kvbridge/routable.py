"""Which address of this host other hosts can dial, and whether a loopback address means the same machine.

A producer names an address in the transfer params it hands out; a consumer on another host dials it. A
loopback address there is a silent miss on every load (the consumer dials its own loopback), so a producer
whose user set no address derives one (:func:`routable_host`): the source address of the default route;
without a default route, the host's only non-loopback IPv4 address; with several and no route to choose by,
a :class:`~kvbridge.errors.ConfigError` naming the option to set. A host with no address but loopback keeps
``127.0.0.1`` (no other host can reach it anyway), and the params then carry :func:`net_identity`, which a
consumer compares with its own: loopback is the same socket space only in the same network namespace of
the same boot (:func:`loopback_reaches`).
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import logging
import os
import socket

from kvbridge.errors import ConfigError

log = logging.getLogger(__name__)

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_PROBE = "192.0.2.1"  # TEST-NET-1: a UDP connect only picks the route's source address, nothing is sent


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback."""
    host = host.strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """``0.0.0.0`` / ``::``: a listener's "every interface", never an address to dial."""
    return host.strip("[]") in ("0.0.0.0", "::", "")


def default_route_source() -> str | None:
    """The address this host sends from on its default route, or ``None`` where it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((_PROBE, 9))
        except OSError:  # ENETUNREACH: no default route
            return None
        address = str(s.getsockname()[0])
    return None if is_loopback(address) or is_wildcard(address) else address


def host_addresses() -> list[str]:
    """This network namespace's local IPv4 addresses but loopback, secondary ones too (``/proc/net/fib_trie``)."""
    try:
        with open("/proc/net/fib_trie") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found: list[str] = []
    for before, line in zip(lines, lines[1:]):
        if line.strip() == "/32 host LOCAL":
            address = before.split()[-1]
            if not is_loopback(address) and address not in found:
                found.append(address)
    return found


def routable_host(option: str = "advertise_host") -> str:
    """An address of this host that other hosts can dial; ``ConfigError`` naming ``option`` if it is not clear which."""
    source = default_route_source()
    if source:
        return source
    found = host_addresses()
    if len(found) == 1:
        return found[0]
    if found:
        raise ConfigError(f"{option}: this host has several addresses ({', '.join(found)}) and no default route to "
                          f"choose by; set {option} to the one the consumers on other hosts dial")
    log.info("this host has no address but loopback: only consumers on this host can reach it (%s=127.0.0.1)", option)
    return "127.0.0.1"


@functools.lru_cache(maxsize=1)
def net_identity() -> str:
    """Same value in two processes iff they share a loopback: this boot and this network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.readlink("/proc/self/ns/net")
    except OSError:  # not Linux: the host name is the best there is
        boot, netns = socket.gethostname(), ""
    return hashlib.sha256(f"{boot}/{netns}".encode()).hexdigest()[:16]


def loopback_reaches(host: str, identity: object) -> bool:
    """Whether a consumer here can dial ``host`` advertised by a producer of network ``identity``: any
    non-loopback host, or loopback from the same network namespace (an unknown ``identity`` is trusted)."""
    return not is_loopback(host) or identity is None or identity == net_identity()


__all__ = ["default_route_source", "host_addresses", "is_loopback", "is_wildcard", "loopback_reaches", "net_identity",
           "routable_host"]
