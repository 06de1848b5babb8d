"""What one engine holds, kept published in a block directory so that a router can find it.

An engine (its vLLM connector's scheduler side) tells :class:`Holdings` which route keys
(:func:`kvbridge.keys.route_keys`) it now holds and which it gave up; a background thread keeps the
directory in step, under the engine's lease:

- adds and drops are batched, sent at most every ``flush_s``, never on the caller's thread (the
  scheduler's step must not wait on a directory);
- when nothing changed for ``ttl_s / 3`` it sends a heartbeat, so the lease outlives quiet periods and
  an engine that dies drops out of lookups within one ``ttl_s``;
- what it holds is bounded (``capacity`` keys, least recently held first out, each one dropped from the
  directory too): where nothing reports evictions the bound stands in for the engine's own cache size;
- **a directory that is down or restarted loses nothing for long**: an error is logged once per outage,
  the thread retries every ``flush_s`` (at most every second), and once the directory answers again — or
  a heartbeat says it forgot this holder (a Redis that restarted empty) — everything held is published
  again. The caller never sees a directory error.

:func:`open_directory` turns a URL into a directory client: ``redis://HOST:PORT/DB`` (or ``rediss://``,
``unix://``) a :class:`~kvbridge.metadata.redis_directory.RedisDirectory`, ``grpc://HOST:PORT`` the
directory of a ``kvbridge metadata-server``. Both answer the same calls.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvbridge.addresses import parse_host_port
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.metadata.types import DirectoryEntry

log = logging.getLogger(__name__)

_BATCH = 4096  # hashes per publish call: a republish of a big holding goes in pieces


class DirectoryClient(Protocol):
    """The calls :class:`Holdings` and a router make; every directory kvbridge has answers them."""

    def publish(self, holder: str, hashes: Sequence[bytes], *, address: str = "", ttl_s: float) -> None: ...
    def heartbeat(self, holder: str, *, ttl_s: float) -> bool: ...
    def unpublish(self, holder: str, hashes: Sequence[bytes] | None = None) -> None: ...
    def lookup(self, hashes: Sequence[bytes]) -> list[DirectoryEntry]: ...
    def close(self) -> None: ...


def check_directory_url(url: str) -> str:
    """A directory URL checked at start-up (:class:`ConfigError` naming it otherwise)."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"directory must be redis://HOST:PORT/DB or grpc://HOST:PORT, got {url!r}")
    scheme, _, rest = url.partition("://")
    if scheme == "grpc":
        parse_host_port(rest.rstrip("/"), what=f"directory {url!r}")
        return url
    from kvbridge.metadata.redis_directory import check_url

    return check_url(url)


def open_directory(url: str, *, timeout_s: float = 2.0) -> DirectoryClient:
    """A client of the directory at ``url`` (checked first; nothing is contacted yet)."""
    check_directory_url(url)
    if url.startswith("grpc://"):
        from kvbridge.metadata.client import MetadataClient

        client: Any = MetadataClient(url.removeprefix("grpc://").rstrip("/"), timeout=timeout_s, retries=1)
        return _GrpcDirectory(client)
    from kvbridge.metadata.redis_directory import RedisDirectory

    return RedisDirectory(url, timeout_s=timeout_s)


class _GrpcDirectory:
    """A metadata server's directory behind the :class:`DirectoryClient` calls (its heartbeat's ttl is
    positional, the rest are the same)."""

    def __init__(self, client: Any):
        self._c = client

    def publish(self, holder: str, hashes: Sequence[bytes], *, address: str = "", ttl_s: float) -> None:
        self._c.publish(holder, hashes, address=address, ttl_s=ttl_s)

    def heartbeat(self, holder: str, *, ttl_s: float) -> bool:
        return bool(self._c.heartbeat(holder, ttl_s))

    def unpublish(self, holder: str, hashes: Sequence[bytes] | None = None) -> None:
        self._c.unpublish(holder, hashes)

    def lookup(self, hashes: Sequence[bytes]) -> list[DirectoryEntry]:
        return list(self._c.lookup(hashes))

    def close(self) -> None:
        self._c.close()


class Holdings:
    """One holder's keys, mirrored into ``directory`` by a daemon thread (see the module docstring)."""

    def __init__(self, directory: DirectoryClient, holder: str, *, address: str = "", ttl_s: float = 30.0,
                 capacity: int = 1 << 20, flush_s: float = 0.05):  # fmt: skip
        if not ttl_s > 0 or capacity <= 0 or not flush_s > 0:
            raise ConfigError(f"holdings: ttl_s, capacity and flush_s must be positive, got {ttl_s}, {capacity}, {flush_s}")
        self.directory, self.holder, self.address = directory, holder, address
        self.ttl_s, self.capacity, self.flush_s = ttl_s, capacity, flush_s
        self._held: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._adds: dict[bytes, None] = {}  # held since the last flush (insertion-ordered)
        self._drops: set[bytes] = set()  # given up since the last flush
        self._stale = True  # the directory may lack what is held: publish all of it (also at the start)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._down = False  # in an outage (logged once)
        self.published = 0  # keys sent, counting republishes (for tests and stats)
        self._thread = threading.Thread(target=self._run, name=f"kvbridge-holdings-{holder}", daemon=True)
        self._thread.start()

    # ---- the caller's side: never blocks on the directory ----------------------------------------
    def hold(self, keys: Iterable[bytes]) -> None:
        """These keys are held now (again: they become the most recently held)."""
        with self._lock:
            for key in keys:
                if key in self._held:
                    self._held.move_to_end(key)
                else:
                    self._held[key] = None
                    self._adds[key] = None
                    self._drops.discard(key)
            while len(self._held) > self.capacity:
                self._give_up(next(iter(self._held)))
        self._wake.set()

    def drop(self, keys: Iterable[bytes]) -> None:
        """These keys are no longer held (unknown ones are ignored)."""
        with self._lock:
            for key in keys:
                if key in self._held:
                    self._give_up(key)
        self._wake.set()

    def clear(self) -> None:
        """Nothing is held any more (an engine that reset its cache)."""
        with self._lock:
            for key in list(self._held):
                self._give_up(key)
        self._wake.set()

    def held(self) -> list[bytes]:
        with self._lock:
            return list(self._held)

    def close(self) -> None:
        """Stop, and take this holder out of the directory (best effort: its lease ends it anyway)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=5)
        try:
            self.directory.unpublish(self.holder)
        except KVBridgeError as exc:
            log.info("directory: could not unpublish %s at close (%s); its lease will end it", self.holder, exc)
        self.directory.close()

    def _give_up(self, key: bytes) -> None:  # under the lock
        del self._held[key]
        if key in self._adds:  # never sent: nothing to take back
            del self._adds[key]
        else:
            self._drops.add(key)

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        quiet = self.ttl_s / 3
        while not self._closed.is_set():
            woke = self._wake.wait(quiet)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self._sync(heartbeat=not woke)
            except KVBridgeError as exc:
                self._outage(exc)
                self._closed.wait(min(1.0, max(self.flush_s, quiet / 10)))
                self._wake.set()  # retry soon
                continue
            if self._down:
                log.warning("directory: reachable again; %s republished %d keys", self.holder, len(self._held))
                self._down = False
            self._closed.wait(self.flush_s)  # batch what arrives meanwhile

    def _sync(self, heartbeat: bool) -> None:
        with self._lock:
            stale = self._stale
            adds = list(self._held) if stale else list(self._adds)
            drops = [] if stale else list(self._drops)
            self._adds, self._drops, self._stale = {}, set(), False
        try:
            if heartbeat and not adds and not drops and not stale:
                if not self.directory.heartbeat(self.holder, ttl_s=self.ttl_s):
                    with self._lock:
                        self._stale = True  # the directory forgot us (restarted, or a lapsed lease)
                    self._wake.set()
                return
            if stale:  # a fresh start: no leftovers from an earlier life of this holder
                self.directory.unpublish(self.holder)
            if drops:
                self.directory.unpublish(self.holder, drops)
            for i in range(0, max(len(adds), 1), _BATCH):  # one call even when empty: it renews the lease
                self.directory.publish(self.holder, adds[i : i + _BATCH], address=self.address, ttl_s=self.ttl_s)
            self.published += len(adds)
        except BaseException:
            with self._lock:
                self._stale = True  # what reached the directory is unknown: send everything next time
            raise

    def _outage(self, exc: Exception) -> None:
        if not self._down:
            log.warning("directory: %s cannot publish (%s); routing may miss this engine until it is back", self.holder, exc)
            self._down = True


__all__ = ["DirectoryClient", "Holdings", "check_directory_url", "open_directory"]
