"""The block directory in Redis (or Valkey): the same leases and answers as :class:`~kvbridge.metadata.directory.Directory`,
shared by every machine that reaches the server, and outliving any one of them.

Keys (``prefix`` defaults to ``kvb:``; every key of a holder carries the holder's lease as its TTL, so
Redis itself forgets a holder whose heartbeats stop — no sweeper, no home-made replication)::

    {prefix}h:{holder}   hash   {"address": ...}                 the holder and its lease
    {prefix}b:{holder}   zset   member = block hash, score = publish order (oldest first out)
    {prefix}holders      set    holder names (a name whose h: key expired is pruned at lookup)

A lookup reads the live holders, then asks each, in one pipeline, which of the prompt's hashes it has
(``ZMSCORE``): the leading run per holder, longest first — one round trip for the holders and one for
the scores, whatever the number of hashes. Needs Redis >= 6.2 (``ZMSCORE``).

Errors of the server (down, timing out, refusing) raise :class:`~kvbridge.errors.PeerUnreachable`:
callers that route on the directory treat that as "nothing known" and carry on.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Sequence
from typing import Any

from kvbridge.errors import ConfigError, MissingDependency, PeerUnreachable
from kvbridge.metadata.types import DirectoryEntry


def _redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise MissingDependency("a redis:// directory needs redis-py: pip install 'kvbridge[directory]'") from exc
    return redis


def check_url(url: str) -> str:
    """``redis://HOST:PORT/DB`` (or ``rediss://``, ``unix://``) checked at start-up; ``ConfigError`` otherwise."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"directory URL must be redis://HOST:PORT/DB (or rediss://, unix://), got {url!r}")
    if parts.scheme != "unix":
        try:
            port = parts.port
        except ValueError:
            raise ConfigError(f"directory URL {url!r} has a port out of range") from None
        if not parts.hostname or port is None:
            raise ConfigError(f"directory URL {url!r} must name HOST:PORT")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ConfigError(f"directory URL {url!r}: the database must be a number, got {db!r}")
    return url


class RedisDirectory:
    """A :class:`~kvbridge.metadata.directory.Directory` whose state lives in a Redis server at ``url``."""

    def __init__(self, url: str, *, prefix: str = "kvb:", max_hashes_per_holder: int = 1 << 20, timeout_s: float = 2.0):
        self.url = check_url(url)
        self.prefix = prefix
        self.max_hashes_per_holder = max_hashes_per_holder
        redis = _redis()
        self._errors = (redis.RedisError, OSError)
        self._r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                       health_check_interval=30)  # fmt: skip

    def _k(self, kind: str, holder: str) -> str:
        return f"{self.prefix}{kind}:{holder}"

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except self._errors as exc:
            raise PeerUnreachable(f"directory {self.url}: {what} failed: {type(exc).__name__}: {exc}") from exc

    # ---- the Directory interface -------------------------------------------------------------------
    def publish(self, holder: str, hashes: Iterable[bytes], *, ttl_s: float, address: str = "") -> None:
        hashes = list(hashes)
        ms = max(1, int(ttl_s * 1000))
        h, b = self._k("h", holder), self._k("b", holder)

        def run() -> None:
            pipe = self._r.pipeline(transaction=True)
            pipe.hsetnx(h, "address", address)
            if address:
                pipe.hset(h, "address", address)
            pipe.sadd(f"{self.prefix}holders", holder)
            if hashes:
                base = self._r.incrby(f"{self.prefix}seq", len(hashes))  # publish order, across holders
                pipe.zadd(b, {key: base - len(hashes) + i for i, key in enumerate(hashes)})
                pipe.zremrangebyrank(b, 0, -self.max_hashes_per_holder - 1)  # the oldest beyond the bound
            pipe.pexpire(h, ms)
            pipe.pexpire(b, ms)
            pipe.execute()

        self._call("publish", run)

    def heartbeat(self, holder: str, *, ttl_s: float) -> bool:
        ms = max(1, int(ttl_s * 1000))

        def run() -> bool:
            pipe = self._r.pipeline(transaction=True)
            pipe.pexpire(self._k("h", holder), ms)
            pipe.pexpire(self._k("b", holder), ms)
            alive, _ = pipe.execute()
            return bool(alive)

        return bool(self._call("heartbeat", run))

    def unpublish(self, holder: str, hashes: Iterable[bytes] | None = None) -> None:
        def run() -> None:
            if hashes is None:
                self._r.delete(self._k("h", holder), self._k("b", holder))
                self._r.srem(f"{self.prefix}holders", holder)
            else:
                keys = list(hashes)
                if keys:
                    self._r.zrem(self._k("b", holder), *keys)

        self._call("unpublish", run)

    def _live(self) -> list[tuple[str, str]]:
        """(holder, address) of every holder whose lease runs; prunes the names of lapsed ones."""
        names = sorted(n.decode() if isinstance(n, bytes) else n for n in self._r.smembers(f"{self.prefix}holders"))
        pipe = self._r.pipeline(transaction=False)
        for name in names:
            pipe.hget(self._k("h", name), "address")
        addresses = pipe.execute()
        gone = [n for n, a in zip(names, addresses) if a is None]
        if gone:
            self._r.srem(f"{self.prefix}holders", *gone)
        return [(n, a.decode() if isinstance(a, bytes) else a) for n, a in zip(names, addresses) if a is not None]

    def lookup(self, hashes: Sequence[bytes]) -> list[DirectoryEntry]:
        if not hashes:
            return []

        def run() -> list[DirectoryEntry]:
            live = self._live()
            pipe = self._r.pipeline(transaction=False)
            for name, _ in live:
                pipe.zmscore(self._k("b", name), list(hashes))
            entries = []
            for (name, address), scores in zip(live, pipe.execute()):
                run_length = next((i for i, s in enumerate(scores) if s is None), len(hashes))
                if run_length:
                    entries.append(DirectoryEntry(name, run_length, address))
            return sorted(entries, key=lambda e: (-e.num_blocks, e.holder))

        result: list[DirectoryEntry] = self._call("lookup", run)
        return result

    def holders(self) -> dict[str, int]:
        def run() -> dict[str, int]:
            live = self._live()
            pipe = self._r.pipeline(transaction=False)
            for name, _ in live:
                pipe.zcard(self._k("b", name))
            return {name: int(n) for (name, _), n in zip(live, pipe.execute())}

        result: dict[str, int] = self._call("holders", run)
        return result

    def close(self) -> None:
        self._r.close()


__all__ = ["RedisDirectory", "check_url"]
