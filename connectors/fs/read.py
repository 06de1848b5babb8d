"""An ``fs`` load: the objects holding its keys opened and their headers checked, then its blocks moved
by the route its :class:`~.plan.ReadPlan` names, each block checked before it counts as loaded."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
from kvbridge.connectors.fs import files
from kvbridge.connectors.fs import native as fs_native
from kvbridge.connectors.fs.evict import Shelf
from kvbridge.connectors.fs.files import ALIGN, Threads, aligned, read_at
from kvbridge.connectors.fs.kv import Blocks
from kvbridge.connectors.fs.naming import FORMAT, Tree
from kvbridge.connectors.fs.objects import Located
from kvbridge.connectors.fs.plan import ReadPlan, Route

from kvbridge import codec
from kvbridge.contract import BlockLoad
from kvbridge.errors import Corrupted, LayoutMismatch
from kvbridge.layout import KVLayout, LayoutFingerprint, reslice, staged_addressing
from kvbridge.staging import StagingPool

log = logging.getLogger("kvbridge.connectors.fs")


def _runs(reads: Sequence[Located]) -> list[tuple[int, int, int]]:
    return [(r.fd, r.chunk.offset(r.first), r.count) for r in reads]


def _positions(reads: Sequence[Located]) -> list[tuple[Located, int]]:
    """Each located block, in load order: its object and its position there."""
    return [(r, r.first + t) for r in reads for t in range(r.count)]


def _leading(outcomes: Sequence[object], n: int) -> int:
    """How many of ``outcomes`` (a block each), from the first, are ``True``."""
    return next((i for i, ok in enumerate(outcomes) if ok is not True), n)


def _close(reads: Sequence[Located]) -> None:
    for r in reads:
        os.close(r.fd)


class Reader:
    """Loads of one engine's store (``tree``, rank ``rank``): ``direct`` is its ``O_DIRECT`` flag (0: the page
    cache); damaged objects go to ``shelf``."""

    def __init__(self, tree: Tree, rank: int, shelf: Shelf, threads: Threads, staging: StagingPool, direct: int):
        self.tree = tree
        self.rank = rank  # this engine's rank (of its tree.tp), whose heads a RESLICED load cuts out
        self.shelf = shelf
        self.threads = threads
        self.staging = staging
        self.direct = direct

    # -- one load ------------------------------------------------------------------------------------
    def load(self, op: BlockLoad, layout: KVLayout, plan: ReadPlan, mod: ModuleType | None, blocks: Blocks | None) -> int:
        """Load ``op`` by ``plan`` (``mod``: the native module, for its native routes; ``blocks``: the KV's
        views, for ``IN_PLACE``); how many of its blocks, from the first, arrived."""
        if plan.route is Route.RESLICED:
            return self.resliced(op, layout, plan.tp)
        reads = self.locate(op.keys, layout.fingerprint)
        try:
            covered = sum(r.count for r in reads)
            if not covered:
                return 0
            route = plan.route_for(r.chunk.kind for r in reads)
            if route is Route.NATIVE:
                assert mod is not None
                running = fs_native.start_move(mod, layout, op.block_ids[:covered], _runs(reads), write=False)
                return self.check(reads, covered, *running.checked())
            if route is Route.NATIVE_STAGED:
                assert mod is not None
                return self._native_staged(op, layout, reads, covered, mod)
            return self._python(op, layout, reads, covered, blocks, in_place=route is Route.IN_PLACE)
        finally:
            _close(reads)

    def start(self, op: BlockLoad, layout: KVLayout, plan: ReadPlan, mod: ModuleType) -> tuple[Any, Callable[[], int]] | None:
        """A ``NATIVE`` load started now: its objects opened and their headers checked here, the blocks read
        and checked on the native threads; the running read, and what gives how many blocks from the first
        arrived once it is over. ``None`` where nothing was found or an object needs the plan's fallback."""
        reads = self.locate(op.keys, layout.fingerprint)
        covered = sum(r.count for r in reads)
        if not covered or plan.route_for(r.chunk.kind for r in reads) is not Route.NATIVE:
            _close(reads)
            return None
        try:
            running = fs_native.start_move(mod, layout, op.block_ids[:covered], _runs(reads), write=False)
        except BaseException:
            _close(reads)
            raise

        def good() -> int:
            try:  # checked() does not wait: the poll saw the read over
                return self.check(reads, covered, *running.checked())
            finally:
                _close(reads)

        return running, good

    # -- objects -------------------------------------------------------------------------------------
    def open(self, path: str, fingerprint: LayoutFingerprint) -> tuple[int, codec.Chunk]:
        """Open the object at ``path`` and check its header; :class:`Corrupted` (fd closed) if it fails."""
        # O_NONBLOCK: something else than a file at a locator (a FIFO) must not hang the load
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | self.direct)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Corrupted("not a regular file", damaged=False)
            size = st.st_size
            buf = self.threads.buffer(ALIGN)
            got = read_at(fd, [buf[:ALIGN]], 0)
            length = FORMAT.header_bytes(buf[:got], size)
            if length > got:
                buf = aligned(length)
                got = read_at(fd, [buf[:length]], 0)
            return fd, FORMAT.parse(buf[:got], fingerprint=fingerprint, size=size)
        except Corrupted as bad:
            self.shelf.reject(path, fd, bad)
            os.close(fd)
            raise
        except BaseException:
            os.close(fd)
            raise

    def locate(self, keys: Sequence[bytes], fingerprint: LayoutFingerprint, folder: str | None = None) -> list[Located]:
        """The objects holding ``keys`` from the first on (open, headers checked against ``fingerprint``),
        up to the first missing; in this engine's shard or ``folder``."""
        reads: list[Located] = []
        i = 0
        try:
            while i < len(keys):
                path = self.tree.path_of(keys[i], folder)
                try:
                    fd, chunk = self.open(path, fingerprint)
                except (Corrupted, OSError):  # damaged (rejected), or missing: the engine recomputes from here
                    break
                try:
                    first = chunk.find(keys[i])
                except Corrupted as bad:
                    self.shelf.reject(path, fd, bad, whole=False)
                    os.close(fd)
                    break
                count = 1
                while first + count < len(chunk.keys) and i + count < len(keys) and chunk.keys[first + count] == keys[i + count]:
                    count += 1
                reads.append(Located(path, fd, chunk, first, count, i))
                if i and not self.direct and not files.cached(fd, chunk.offset(first + count) - 1):
                    # start the kernel's read-ahead of the objects after the first (whose read starts at
                    # once), so reads from the medium overlap. Not for an object in the page cache: there
                    # the advice only walks its pages, on the engine's thread
                    os.posix_fadvise(fd, chunk.offset(first), count * chunk.payload, os.POSIX_FADV_WILLNEED)
                i += count
        except BaseException:
            _close(reads)
            raise
        return reads

    # -- routes --------------------------------------------------------------------------------------
    def _native_staged(self, op: BlockLoad, layout: KVLayout, reads: list[Located], covered: int, mod: ModuleType) -> int:
        """Every located block read into pinned staging by address on the native threads and checked there,
        then copied up once and scattered on the device (only the blocks that passed)."""
        with self.staging.lend(layout, covered) as staging:
            running = fs_native.start_move(mod, layout, range(covered), _runs(reads), write=False,
                                           addressing=staged_addressing(staging))  # fmt: skip
            good = self.check(reads, covered, *running.checked())
            if good:
                layout.scatter(op.block_ids[:good], staging[:, :good].to(layout.device))
            return good

    def _python(self, op: BlockLoad, layout: KVLayout, reads: list[Located], covered: int, blocks: Blocks | None, *,
                in_place: bool) -> int:  # fmt: skip
        """Python threads read the located blocks: straight into the KV's views (``blocks``; ``IN_PLACE``),
        else each through a thread's buffer, then into the KV's views or, where it has none, into staging
        scattered once (``BUFFERED``); how many from the first arrived."""
        assert blocks is not None or not in_place
        where = _positions(reads)
        failed = [covered]  # a block that failed: those after it need not be read (a hint; see below)
        staging = None if blocks is not None else self.staging.take(layout, covered)
        try:
            dest = staging.numpy() if staging is not None else None

            def place(i: int) -> BaseException | bool:
                """True: block i is in the KV; False: not read (a block before it failed); else why it failed."""
                if i > failed[0]:
                    return False
                r, pos = where[i]
                try:
                    if in_place and blocks is not None:  # straight into its block, checked there
                        self._read_in_place(r.fd, r.chunk, pos, blocks.parts(op.block_ids[i]))
                        return True
                    data = self.read_block(r.fd, r.chunk, pos).reshape(layout.num_layers, layout.block_bytes)
                except (Corrupted, OSError) as exc:
                    failed[0] = i
                    return exc
                if dest is not None:
                    dest[:, i] = data
                elif blocks is not None:
                    blocks.put(op.block_ids[i], data)
                return True

            outcomes = self.threads.map(covered, place)
            good = _leading(outcomes, covered)
            if good < covered:
                r = where[good][0]
                bad = outcomes[good]
                if isinstance(bad, Corrupted):
                    self.shelf.reject(r.path, r.fd, bad)
                elif isinstance(bad, OSError):
                    log.warning("fs store: reading %s failed (%s)", r.path, bad)
            if staging is not None and good:  # one vectorized scatter of the blocks that passed, and only those
                layout.scatter(op.block_ids[:good], staging[:, :good].to(layout.device))
            return good
        finally:
            if staging is not None:
                self.staging.give(staging)

    def resliced(self, op: BlockLoad, layout: KVLayout, tp: int) -> int:
        """Cut this rank's heads out of the ``tp``-way shards that hold them (:func:`~kvbridge.layout.reslice`)
        into a staging buffer, then scatter what every one of those shards held; how many blocks, from
        the first, arrived."""
        try:
            theirs, cuts = reslice(layout.fingerprint, self.rank, self.tree.tp, tp)
        except LayoutMismatch as exc:
            log.warning("fs store: %s cannot be loaded from tp=%d: %s", op.request_id, tp, exc)
            return 0
        good = len(op.keys)
        with self.staging.lend(layout, good) as staging:
            dest = staging.numpy()
            for rank, cut in cuts.items():
                reads = self.locate(op.keys[:good], theirs, self.tree.shard_dir(tp, rank))
                try:
                    good = self._cut_blocks(reads, theirs, dest, cut, min(good, sum(r.count for r in reads)))
                finally:
                    _close(reads)
            if good:
                layout.scatter(op.block_ids[:good], staging[:, :good].to(layout.device))
        return good

    def _cut_blocks(self, reads: list[Located], theirs: LayoutFingerprint, dest: np.ndarray, cut: Any, n: int) -> int:
        """Read the first ``n`` located blocks (of layout ``theirs``), placing bytes ``cut`` of each in
        ``dest``; how many from the first passed their checks."""
        where = _positions(reads)[:n]

        def place(i: int) -> bool:
            r, pos = where[i]
            try:
                data = self.read_block(r.fd, r.chunk, pos).reshape(theirs.num_layers, theirs.block_bytes)
            except (Corrupted, OSError) as exc:
                log.warning("fs store: reading %s failed (%s)", r.path, exc)
                return False
            dest[:, i, cut.dst : cut.dst + cut.length] = data[:, cut.src : cut.src + cut.length]
            return True

        outcomes = self.threads.map(n, place)
        return _leading(outcomes, n)

    # -- blocks --------------------------------------------------------------------------------------
    def check(self, reads: list[Located], covered: int, sums: bytes, whole: int, err: int) -> int:
        """How many blocks from the first of a native read arrived whole with the sums their objects hold
        (``checked()``'s figures); the object of the first that did not is rejected or logged."""
        want = b"".join(r.chunk.packed_sums(r.first, r.count) for r in reads)
        good = codec.leading_matches(sums[: 4 * whole], want[: 4 * whole])
        if good < covered:
            r = next(r for r in reads if r.at <= good < r.at + r.count)
            pos = r.first + good - r.at
            if good < whole:  # a block arrived whole, and wrong
                self.shelf.reject(r.path, r.fd, r.chunk.mismatch(pos))
            elif err:
                log.warning("fs store: reading %s failed (%s)", r.path, os.strerror(err))
            else:
                self.shelf.reject(r.path, r.fd, Corrupted(f"block {pos} cut short", damaged=True))
        return good

    @staticmethod
    def _read_in_place(fd: int, chunk: codec.Chunk, pos: int, parts: list[np.ndarray]) -> None:
        """Block ``pos`` of an object read into its block of the KV (``parts``: one per layer) and checked
        there; :class:`Corrupted` if bad (the engine then recomputes that block, overwriting it)."""
        got = read_at(fd, parts, chunk.offset(pos))
        if got < chunk.payload:
            raise Corrupted(f"block {pos} cut short ({got} of {chunk.payload} bytes)", damaged=True)
        chunk.verify(pos, parts)

    def read_block(self, fd: int, chunk: codec.Chunk, pos: int) -> np.ndarray:
        """Block ``pos`` of an object, read into this thread's buffer and checked; :class:`Corrupted` if bad."""
        payload = chunk.payload
        off = chunk.offset(pos)
        if self.direct:  # aligned offset, length and buffer; the end of the file may cut the read short
            lo = off - off % ALIGN
            hi = -(-(off + payload) // ALIGN) * ALIGN
            buf = self.threads.buffer(hi - lo)
            got = read_at(fd, [buf[: hi - lo]], lo) - (off - lo)
            data = buf[off - lo : off - lo + payload]
        else:
            data = self.threads.buffer(payload)[:payload]
            got = read_at(fd, [data], off)
        if got < payload:
            raise Corrupted(f"block {pos} cut short ({max(got, 0)} of {payload} bytes)", damaged=True)
        chunk.verify(pos, [data])
        return data
