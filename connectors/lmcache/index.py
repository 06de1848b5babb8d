"""The lmcache tier's scheduler side: which keys LMCache holds, from the first (the package docstring's lookup)."""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.connectors.fs import chunk_ends
from kvbridge.connectors.lmcache.manager import Manager
from kvbridge.connectors.lmcache.options import REMOTE, LMCacheOptions
from kvbridge.connectors.lmcache.side import Side

from kvbridge.contract import EngineInfo
from kvbridge.store import StoreIndex


class LMCacheIndex(Side, StoreIndex):
    """Scheduler side: which keys LMCache holds, from the first; one ``contains`` per chunk (module docstring)."""

    def __init__(self, engine: EngineInfo, options: LMCacheOptions):
        StoreIndex.__init__(self, engine)
        Side.__init__(self, engine, options)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        with self._session() as m:  # (LMCache answers a failed remote as a miss)
            n = 0
            for end in chunk_ends(keys, self.chunk):  # n is where this chunk starts
                if m.sm.contains(self.lmcache_key(keys[end])) is not None:  # the object ending the chunk is there
                    n = end + 1
                    continue
                if not self._stored(m, keys[n]):
                    return n
                if end == n:
                    n += 1
                    continue
                # the chunk's first block here is stored, its last is not: bisect. A block in an object proves the
                # blocks before it in its chunk (saved with it, or before it by the same prompt).
                lo, hi = n, end
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if self._stored(m, keys[mid]):
                        lo = mid
                    else:
                        hi = mid
                return lo + 1
            return n

    def _stored(self, m: Manager, key: bytes) -> bool:
        """Whether block ``key`` is in some object: one ending with it, or one a locator names."""
        if m.sm.contains(self.lmcache_key(key)) is not None:
            return True
        held = m.where.get(self.lmcache_key(key))
        if held is not None and m.sm.contains(held[0]) is not None:
            return True
        return self._remote_up(m) and m.sm.contains(self.locator_key(key), search_range=[REMOTE]) is not None
