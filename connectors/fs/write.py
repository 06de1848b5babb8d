"""An ``fs`` save: the chunks its blocks fall in, each written whole into a private temporary file (its
first blocks read back from the chunk's earlier object where the save starts inside one), a window of
objects at a time, then published (:class:`~.evict.Shelf`)."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
from kvbridge.connectors.fs import native as fs_native
from kvbridge.connectors.fs.evict import Shelf
from kvbridge.connectors.fs.files import ALIGN, ENOSPC, Threads, write_at
from kvbridge.connectors.fs.kv import Blocks
from kvbridge.connectors.fs.naming import FORMAT, Tree, chunk_ends
from kvbridge.connectors.fs.objects import Located, Written
from kvbridge.connectors.fs.options import FsSave
from kvbridge.connectors.fs.plan import Route
from kvbridge.connectors.fs.read import Reader

from kvbridge import codec
from kvbridge.contract import BlockSave
from kvbridge.errors import Corrupted
from kvbridge.layout import BlockAddressing, KVLayout, staged_addressing
from kvbridge.staging import StagingPool

log = logging.getLogger("kvbridge.connectors.fs")

# a block of a save (its index in the op) -> views of its bytes; None where the native module moves the
# blocks by address (Writer._write_native); the addressing of a staging buffer holding the op's blocks in
# order (a KV on a GPU, gathered into pinned memory) where the native module moves them from there
_Parts = Callable[[int], list[Any]] | BlockAddressing | None


class Writer:
    """Saves of one engine's store (``tree``), in checksum ``kind``; ``direct`` is its ``O_DIRECT`` flag."""

    def __init__(self, tree: Tree, shelf: Shelf, reader: Reader, threads: Threads, staging: StagingPool, *,
                 kind: int, direct: int):  # fmt: skip
        self.tree = tree
        self.shelf = shelf
        self.reader = reader
        self.threads = threads
        self.staging = staging
        self.kind = kind
        self.direct = direct

    def save(self, op: BlockSave, layout: KVLayout, route: Route, mod: ModuleType | None, blocks: Blocks | None) -> None:
        """Write ``op``'s chunks by ``route`` (:func:`~.plan.choose_save`; ``mod``: the native module for its
        native routes, ``blocks``: the KV's views for ``IN_PLACE``), but those already stored."""
        if not self.shelf.folders:
            self.shelf.make_folders()
        target = op.target if isinstance(op.target, FsSave) else FsSave()
        objects = [o for o in self._objects(op, target) if not self.shelf.refresh(o.path)]
        if not objects:
            return
        payload = layout.num_layers * layout.block_bytes
        if self.tree.options.capacity_bytes:
            self.shelf.make_room(sum(FORMAT.header_length(o.keys, layout.fingerprint) + len(o.keys) * payload for o in objects))
        if route is Route.NATIVE:  # blocks move by address, not by view
            self._save_objects(op, layout, objects, None, mod)
        elif route is Route.NATIVE_STAGED:
            with self.staging.gathered(layout, op.block_ids) as staging:  # from pinned staging, by address
                self._save_objects(op, layout, objects, staged_addressing(staging), mod)
        elif route is Route.IN_PLACE:
            assert blocks is not None
            self._save_objects(op, layout, objects, lambda i: blocks.parts(op.block_ids[i]), None)
        else:
            with self.staging.gathered(layout, op.block_ids) as staging:
                arr = staging.numpy()
                self._save_objects(op, layout, objects, lambda i: [arr[layer, i] for layer in range(layout.num_layers)], None)

    def _objects(self, op: BlockSave, target: FsSave) -> list[Written]:
        """The chunks ``op`` writes: one per chunk its blocks fall in (the first completed from ``target.head``)."""
        out = []
        i = 0
        head: tuple[bytes, ...] | None = target.head
        for end in (last + 1 for last in chunk_ends(op.keys, self.tree.chunk)):
            if head is None:  # inside a chunk whose first blocks are unknown: not saved
                log.debug("fs store: %s: the first blocks of the chunk of block %d are unknown; not saved", op.request_id, i)
            else:
                keys = (*head, *op.keys[i:end])
                out.append(Written(keys, len(head), i, end, self.tree.path_of(keys[-1])))
            head = ()
            i = end
        return out

    def _save_objects(self, op: BlockSave, layout: KVLayout, objects: list[Written], parts: _Parts,
                      mod: ModuleType | None) -> None:  # fmt: skip
        # a window of objects at a time (one per thread), published before the next is written: a full disk
        # keeps every chunk of the save but those of the window it stopped in
        step = self.threads.count
        for w in range(0, len(objects), step):
            window = objects[w : w + step]
            try:
                self._write_window(op, layout, window, parts, mod)
            finally:
                for o in window:
                    self.shelf.discard(o)

    def _write_window(self, op: BlockSave, layout: KVLayout, objects: list[Written], parts: _Parts,
                      mod: ModuleType | None) -> None:  # fmt: skip
        payload = layout.num_layers * layout.block_bytes
        direct = self.direct if payload % ALIGN == 0 else 0
        ready = []
        for o in objects:
            if o.head and not self._open_head(o, layout):
                continue
            o.header = FORMAT.header_length(o.keys, layout.fingerprint)
            o.sums = [0] * len(o.keys)
            self.shelf.create(o, direct)
            ready.append(o)
        live = [o for o in ready if o.error is None]
        if parts is None or isinstance(parts, BlockAddressing):  # the op's blocks in one native call; the
            assert mod is not None  # chunks' first blocks below, read back
            self._write_native(op, layout, live, mod, parts)
            work = [(o, j) for o in live for j in range(o.head)]
        else:  # block j of every object, then block j+1: threads taking the next one write different files
            # (writes to one file take its lock in turn)
            work = [(o, j) for j in range(max((len(o.keys) for o in live), default=0)) for o in live if j < len(o.keys)]
        full: list[OSError] = []  # a write found the disk full: the others stop

        def write(i: int) -> None:
            o, j = work[i]
            if o.error is not None:
                return
            if full:
                o.error = full[0]
                return
            try:
                off = o.header + j * payload
                if j < o.head:  # read back from the chunk's earlier object, checked, written as it was
                    assert o.source is not None
                    data = self.reader.read_block(o.source.fd, o.source.chunk, j)
                    o.sums[j] = o.source.chunk.checksums[j] if o.source.chunk.kind == self.kind else codec.checksum(self.kind, [data])
                    write_at(o.fd, [data], off)
                    return
                assert callable(parts)  # the native path wrote the op's own blocks
                src = parts(o.lo + j - o.head)
                if direct:  # O_DIRECT writes from an aligned buffer
                    buf = self.threads.buffer(payload)[:payload]
                    np.concatenate(src, out=buf)
                    o.sums[j] = codec.checksum(self.kind, [buf])
                    write_at(o.fd, [buf], off)
                else:  # straight from the KV: checksum its pieces, write them where the block goes
                    o.sums[j] = codec.checksum(self.kind, src)
                    write_at(o.fd, src, off)
            except OSError as exc:
                o.error = exc
                if exc.errno in ENOSPC:
                    full.append(exc)
            except Corrupted as exc:
                o.error = exc

        self.threads.map(len(work), write)
        for o in ready:  # published in order: a save cut short by a full disk keeps the chunks before
            if o.error is not None:
                if isinstance(o.error, Corrupted):
                    log.warning("fs store: %s: the chunk's first blocks failed (%s); not saved", o.path, o.error)
                    continue
                self.shelf.failed_write(o, o.error)
            self.shelf.publish(o, layout, direct)

    def _write_native(self, op: BlockSave, layout: KVLayout, objects: list[Written], mod: ModuleType,
                      staged: BlockAddressing | None = None) -> None:  # fmt: skip
        """The op's blocks of ``objects`` written where each goes in its object's file, in one call on the
        native threads (``file_start``: each block's crc32c taken as it is written, the blocks cut between
        the threads); an object whose blocks did not all land takes the error (a full disk: ``ENOSPC``).
        From the KV, or from ``staged`` (a buffer holding the op's blocks in order)."""
        todo = [o for o in objects if o.hi > o.lo]
        if not todo:
            return
        payload = layout.num_layers * layout.block_bytes
        source = np.arange(len(op.block_ids)) if staged is not None else np.asarray(op.block_ids)
        ids = np.concatenate([source[o.lo : o.hi] for o in todo])
        runs = [(o.fd, o.header + o.head * payload, o.hi - o.lo) for o in todo]
        sums, whole, err = fs_native.move(mod, layout, ids, runs, write=True, addressing=staged)
        got = sums.tolist()
        at = 0
        for o in todo:
            n = o.hi - o.lo
            if at + n <= whole:
                o.sums[o.head :] = got[at : at + n]
            else:  # this object, and those after (a thread may have written some: not published, all the same)
                o.error = OSError(err or errno.EIO, os.strerror(err or errno.EIO))
            at += n

    def _open_head(self, o: Written, layout: KVLayout) -> bool:
        """Open the object holding the first ``o.head`` blocks of ``o``'s chunk; ``False`` if it cannot serve."""
        path = self.tree.path_of(o.keys[o.head - 1])
        try:
            fd, chunk = self.reader.open(path, layout.fingerprint)
        except (OSError, Corrupted) as exc:
            log.debug("fs store: the first blocks of %s are gone (%s); not saved", o.path, exc)
            return False
        if chunk.keys[: o.head] != o.keys[: o.head]:  # it must start where the chunk does
            os.close(fd)
            return False
        o.source = Located(path, fd, chunk, 0, o.head, 0)
        return True
