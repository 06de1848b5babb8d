"""The block directory: which holder (an engine or a tier) holds which block hashes, under leases.

A holder publishes hashes as it computes or stores their blocks; each publish or heartbeat
(re)starts its lease of ``ttl_s`` seconds, and a holder whose lease runs out is forgotten with all
its hashes — so an engine that dies without unpublishing drops out of lookups within one TTL.
Leases run on a monotonic clock (injectable, so expiry is testable without sleeping).

A lookup takes the hashes of consecutive blocks of a prompt (prefix-chained keys, first block
first) and answers, for each holder, how many *leading* blocks it holds — the part of the prompt it
could serve — longest first. The cost is one dictionary probe per asked hash per surviving holder.

Memory is bounded: at most ``max_holders`` holders and ``max_hashes_per_holder`` hashes each (the
oldest published are forgotten first, as a cache would evict them).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvbridge.errors import StoreFull
from kvbridge.metadata.types import DirectoryEntry


@dataclasses.dataclass
class _Holder:
    address: str
    deadline: float
    hashes: dict[bytes, None]  # insertion-ordered: the first is the oldest published


class Directory:
    """Thread-safe in-memory directory. Every method expires lapsed leases before it answers."""

    def __init__(
        self,
        *,
        max_holders: int = 4096,
        max_hashes_per_holder: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_holders = max_holders
        self.max_hashes_per_holder = max_hashes_per_holder
        self._clock = clock
        self._lock = threading.Lock()
        self._holders: dict[str, _Holder] = {}
        self._index: dict[bytes, set[str]] = {}

    def publish(self, holder: str, hashes: Iterable[bytes], *, ttl_s: float, address: str = "") -> None:
        """Add ``hashes`` to what ``holder`` holds and (re)start its lease; ``address=""`` keeps the last one.

        :class:`StoreFull` when a new holder would exceed ``max_holders``.
        """
        with self._lock:
            now = self._expire()
            h = self._holders.get(holder)
            if h is None:
                if len(self._holders) >= self.max_holders:
                    raise StoreFull(f"directory holds {self.max_holders} holders already")
                h = self._holders[holder] = _Holder(address, 0.0, {})
            h.deadline = now + ttl_s
            if address:
                h.address = address
            for key in hashes:
                if key in h.hashes:
                    del h.hashes[key]  # re-published: moves to the newest end
                else:
                    self._index.setdefault(key, set()).add(holder)
                h.hashes[key] = None
            while len(h.hashes) > self.max_hashes_per_holder:
                self._drop(holder, next(iter(h.hashes)))

    def heartbeat(self, holder: str, *, ttl_s: float) -> bool:
        """Renew ``holder``'s lease; ``False`` when it is unknown (expired or never published): publish again."""
        with self._lock:
            now = self._expire()
            h = self._holders.get(holder)
            if h is None:
                return False
            h.deadline = now + ttl_s
            return True

    def unpublish(self, holder: str, hashes: Iterable[bytes] | None = None) -> None:
        """Forget ``hashes`` of ``holder``, or the holder altogether when ``hashes`` is ``None``. Idempotent."""
        with self._lock:
            self._expire()
            if holder not in self._holders:
                return
            if hashes is None:
                self._forget(holder)
                return
            for key in hashes:
                if key in self._holders[holder].hashes:
                    self._drop(holder, key)

    def lookup(self, hashes: Sequence[bytes]) -> list[DirectoryEntry]:
        """Holders of a leading run of ``hashes`` with its length, longest first (ties by holder name)."""
        with self._lock:
            self._expire()
            if not hashes:
                return []
            alive = set(self._index.get(hashes[0], ()))
            found: dict[str, int] = {}
            for i in range(1, len(hashes)):
                if not alive:
                    break
                have = self._index.get(hashes[i], set())
                for gone in alive - have:
                    found[gone] = i
                alive &= have
            found.update(dict.fromkeys(alive, len(hashes)))
            entries = [DirectoryEntry(name, n, self._holders[name].address) for name, n in found.items()]
        return sorted(entries, key=lambda e: (-e.num_blocks, e.holder))

    def holders(self) -> dict[str, int]:
        """Live holders and how many hashes each holds."""
        with self._lock:
            self._expire()
            return {name: len(h.hashes) for name, h in self._holders.items()}

    # ---- under the lock ---------------------------------------------------------------------------
    def _expire(self) -> float:
        now = self._clock()
        for name in [n for n, h in self._holders.items() if h.deadline <= now]:
            self._forget(name)
        return now

    def _forget(self, holder: str) -> None:
        for key in self._holders.pop(holder).hashes:
            self._unindex(holder, key)

    def _drop(self, holder: str, key: bytes) -> None:
        del self._holders[holder].hashes[key]
        self._unindex(holder, key)

    def _unindex(self, holder: str, key: bytes) -> None:
        owners = self._index[key]
        owners.discard(holder)
        if not owners:
            del self._index[key]


__all__ = ["Directory"]
