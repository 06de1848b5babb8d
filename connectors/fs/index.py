"""The scheduler side of an ``fs`` store: how far a prompt's blocks are stored (a stat per chunk), which
TP size's shards hold them, and where each save of a request starts in its chunk."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Sequence
from typing import Any

from kvbridge.connectors.fs.naming import SHARD, Tree, chunk_ends, ends_chunk
from kvbridge.connectors.fs.options import FsLoad, FsOptions, FsSave

from kvbridge.contract import EngineInfo
from kvbridge.store import StoreIndex

_REMEMBERED = 4096  # requests (and looked-up prompts) whose save positions the scheduler side keeps
_FOUND_S = 1.0  # how long what a lookup found answers a chain's members() without a stat


def _remember(book: collections.OrderedDict[Any, Any], key: Any, value: Any) -> None:
    book[key] = value
    book.move_to_end(key)
    while len(book) > _REMEMBERED:
        book.popitem(last=False)


class FsIndex(Tree, StoreIndex):
    """Scheduler side: one stat per chunk (see the module docstring), and where each save starts."""

    def __init__(self, engine: EngineInfo, options: FsOptions):
        StoreIndex.__init__(self, engine)
        Tree.__init__(self, engine, options)
        # key where a lookup's hit ended -> the keys before it in its chunk: where the request's saves will
        # start (the store holds everything before)
        self._hits: collections.OrderedDict[bytes, tuple[bytes, ...]] = collections.OrderedDict()
        # request -> the keys of the chunk its next save goes on with (None: not known)
        self._saving: collections.OrderedDict[str, tuple[bytes, ...] | None] = collections.OrderedDict()
        # last key of a hit another TP size held -> that TP size (its load cuts heads out of that split)
        self._split_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._splits_seen: tuple[float, list[int]] = (-1e9, [])
        # keys the lookups of the last _FOUND_S seconds found, and since when: a chain asks which blocks
        # its tiers hold (members) right after its lookup asked how far they go, and need not stat again
        self._found: tuple[float, set[bytes]] = (-1e9, set())

    def reserve_load(self, request_id: str, keys: Sequence[bytes]) -> FsLoad | None:
        tp = self._split_of.get(keys[-1]) if keys else None
        return FsLoad(tp) if tp is not None else None

    def _present(self, key: bytes, folder: str | None = None) -> bool:
        try:
            os.stat(self.path_of(key, folder))  # follows a link: a link whose object is gone is a miss
        except OSError:  # missing, or the directory itself is gone: a miss either way
            return False
        return True

    def _other_splits(self) -> list[int]:
        """The TP sizes other than ours whose rank 0 stored objects of this namespace (listed at most once
        a second)."""
        now = time.monotonic()
        if now - self._splits_seen[0] > 1.0:
            try:
                names = os.listdir(self.ns_dir)
            except OSError:
                names = []
            found = {int(m.group(1)) for m in map(SHARD.fullmatch, names) if m and m.group(2) == "0"}
            self._splits_seen = (now, sorted(found - {self.tp}))
        return self._splits_seen[1]

    def members(self, keys: Sequence[bytes]) -> list[int]:
        """Every one of ``keys`` if a lookup found them all just before (a chain's reservation after its
        lookup); else looked up again. One found then evicted since fails its load, which recomputes it,
        as one evicted after this answer would."""
        since, found = self._found
        if time.monotonic() - since < _FOUND_S and found.issuperset(keys):
            return list(range(len(keys)))
        return super().members(keys)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        n = self._stat_prefix(keys)
        if n:
            since, found = self._found
            if time.monotonic() - since > _FOUND_S or len(found) > _REMEMBERED * 16:
                self._found = since, found = time.monotonic(), set()
            found.update(keys[:n])
        return n

    def _stat_prefix(self, keys: Sequence[bytes]) -> int:
        n = self._prefix(keys)
        if n < len(keys):
            for tp in self._other_splits():  # another TP size may hold more: its ranks are re-sliced
                m = self._prefix(keys, self.shard_dir(tp, 0))
                if m > n:
                    n = m
                    _remember(self._split_of, keys[m - 1], tp)
        if n < len(keys) and self.engine.role == "both":  # its saves start at n (a producer's at the prompt's start)
            b = n - 1
            while b >= 0 and not ends_chunk(keys[b], self.chunk):
                b -= 1
            _remember(self._hits, keys[n], tuple(keys[b + 1 : n]))
        return n

    def _prefix(self, keys: Sequence[bytes], folder: str | None = None) -> int:
        n = 0
        for end in chunk_ends(keys, self.chunk):  # n is where this chunk starts
            if self._present(keys[end], folder):  # the chunk is stored whole (as far as these keys go)
                n = end + 1
                continue
            if end == n or not self._present(keys[n], folder):
                return n
            # the chunk's first block here is there, its last is not: bisect. A locator found names an object
            # holding every block of its chunk up to it, so any block found proves the ones before it.
            lo, hi = n, end
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self._present(keys[mid], folder):
                    lo = mid
                else:
                    hi = mid
            return lo + 1
        return n

    def reserve_save(self, request_id: str, keys: Sequence[bytes]) -> tuple[Sequence[int], Any]:
        if request_id in self._saving:  # the request's next save: after its previous one
            head = self._saving.pop(request_id)
        else:  # its first: where its lookup's hit ended, or its prompt's start
            head = self._hits.get(keys[0], ()) if keys else ()
        run = (*head, *keys) if head is not None else tuple(keys)
        b = len(run) - 1
        while b >= 0 and not ends_chunk(run[b], self.chunk):
            b -= 1
        # the keys of the chunk the next save goes on with (unknown if its start is not among them)
        tail = run[b + 1 :] if b >= 0 or head is not None else None
        _remember(self._saving, request_id, tail)
        return range(len(keys)), FsSave(head)

    def release(self, request_id: str, failed: Sequence[bytes] = ()) -> None:
        # a load's release comes before the request computes (and saves) anything; its end's after its last save
        self._saving.pop(request_id, None)
