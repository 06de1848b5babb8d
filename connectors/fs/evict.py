"""An ``fs`` store's objects on disk once written: their folders, publishing a written object and its
links, rejecting a damaged one, and evicting the oldest under a capacity."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Iterator

import numpy as np
from kvbridge.connectors.fs.files import ENOSPC, aligned, write_at
from kvbridge.connectors.fs.naming import FORMAT, Tree
from kvbridge.connectors.fs.objects import Written

from kvbridge.errors import Corrupted, StoreFull
from kvbridge.layout import KVLayout
from kvbridge.stats import TransferStats

log = logging.getLogger("kvbridge.connectors.fs")

_LOW_WATER = 0.9  # evict down to this fraction of capacity_bytes
_STALE_TMP_S = 3600.0  # temp files this old belong to a writer that died; eviction scans remove them


class Shelf:
    """The objects of one engine's shard (``tree``) under the shared root: where they are published,
    linked, rejected and evicted. Counts rejections and evictions in ``stats``."""

    def __init__(self, tree: Tree, stats: TransferStats, kind: int):
        self.tree = tree
        self.options = tree.options
        self.root = tree.root
        self.stats = stats
        self.kind = kind
        self.made: set[str] = set()  # subdirectories known to exist (re-made if someone removes them)
        self.folders = False  # the shard's 256 folders made (by the first save)
        self.usage: int | None = None  # estimate of bytes under root, when capacity_bytes is set

    # -- folders -------------------------------------------------------------------------------------
    def make_folders(self) -> None:
        """The 256 folders of this engine's shard, made by its first save: otherwise a save into a new
        folder pays its mkdir, and each link into one a failed symlink, a mkdir and the symlink again, on
        the save's path (bench: ``fs save 8b 64tok``, whose saves meet new folders). One that cannot be
        made is made (or fails) when a save needs it."""
        self.folders = True
        for i in range(256):
            try:
                self.mkdir(os.path.join(self.tree.dir, f"{i:02x}"))
            except OSError as exc:  # the save says why, when it needs the folder
                log.debug("fs store: cannot make the folders of %s yet (%s)", self.tree.dir, exc)
                return

    def mkdir(self, folder: str) -> None:
        if folder not in self.made:
            os.makedirs(folder, exist_ok=True)
            self.made.add(folder)

    # -- writing and publishing ----------------------------------------------------------------------
    def create(self, o: Written, direct: int) -> None:
        """Open a private temporary file for ``o`` beside where it goes (``o.error`` if it cannot)."""
        folder = os.path.dirname(o.path)
        self.mkdir(folder)
        # a private name in the same directory: os.replace is atomic only within one filesystem
        o.tmp = os.path.join(folder, f".{os.path.basename(o.path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct
        try:
            try:
                o.fd = os.open(o.tmp, flags, 0o644)
            except FileNotFoundError:  # the directory was removed under us: make it again, once
                self.made.discard(folder)
                self.mkdir(folder)
                o.fd = os.open(o.tmp, flags, 0o644)
        except OSError as exc:
            o.error = exc

    def publish(self, o: Written, layout: KVLayout, direct: int) -> None:
        """Write ``o``'s header, rename it into place and link its chunk's other blocks to it."""
        header = FORMAT.pack(o.keys, layout.fingerprint, o.sums, self.kind)
        try:
            if direct:
                buf = aligned(len(header))
                buf[: len(header)] = np.frombuffer(header, dtype=np.uint8)
                write_at(o.fd, [buf[: len(header)]], 0)
            else:
                write_at(o.fd, [header], 0)
            if self.options.fsync:
                os.fsync(o.fd)
            os.close(o.fd)
            o.fd = -1
            os.replace(o.tmp, o.path)
            o.tmp = ""
        except OSError as exc:
            self.failed_write(o, exc)
        if self.usage is not None:
            self.usage += len(header) + len(o.keys) * layout.num_layers * layout.block_bytes
        folder = os.path.dirname(o.path)
        if self.options.fsync:  # make the rename itself durable
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        name = os.path.basename(o.path)
        target = os.path.join("..", name[:2], name)
        for key in o.keys[:-1]:
            self.link(self.tree.path_of(key), target)

    def link(self, path: str, target: str) -> None:
        """Make ``path`` a link to ``target`` (atomically replacing what is there: a shorter object of the
        same chunk, or a link to another object holding the block)."""
        try:
            if self._new_link(path, target):
                return
            with contextlib.suppress(OSError):
                if os.readlink(path) == target:
                    return
            tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            os.symlink(target, tmp)
            try:
                os.replace(tmp, path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            if exc.errno in ENOSPC:
                raise StoreFull(f"fs store {self.root}: no space for the link {path} ({exc.strerror})") from exc
            raise

    def _new_link(self, path: str, target: str) -> bool:
        """Make ``path`` a link to ``target`` if nothing is there (its folder made again if it went);
        ``False`` if something is, another writer's link included, made in the meantime."""
        try:
            os.symlink(target, path)
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:
            self.made.discard(os.path.dirname(path))
            self.mkdir(os.path.dirname(path))
        try:  # once more, in the folder made again; another writer may have linked it first
            os.symlink(target, path)
            return True
        except FileExistsError:
            return False

    def discard(self, o: Written) -> None:
        """Close and remove what a save of ``o`` left behind (nothing, once it is published)."""
        if o.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(o.fd)
            o.fd = -1
        if o.tmp:
            with contextlib.suppress(OSError):
                os.unlink(o.tmp)
            o.tmp = ""
        if o.source is not None:
            with contextlib.suppress(OSError):
                os.close(o.source.fd)
            o.source = None

    def failed_write(self, o: Written, exc: BaseException) -> None:
        self.discard(o)
        if isinstance(exc, OSError) and exc.errno in ENOSPC:
            raise StoreFull(f"fs store {self.root}: no space for {o.path} ({exc.strerror})") from exc
        raise exc

    # -- bad objects ---------------------------------------------------------------------------------
    def reject(self, path: str, fd: int, bad: Corrupted, *, whole: bool = True) -> None:
        """Count and log a failed object; delete it if damaged (``whole=False``: only the link that led to it,
        which named a key the object does not hold)."""
        self.stats.add(corrupt=1)
        log.warning("fs store: %s is not loadable (%s)%s", path, bad, "; deleting it" if bad.damaged else "")
        if not bad.damaged:
            return
        with contextlib.suppress(OSError):
            link = os.path.islink(path)
            real = os.path.realpath(path)
            ours = os.path.commonpath([real, os.path.realpath(self.root)]) == os.path.realpath(self.root)
            # delete only the file we read (not one a writer has just put in its place), and only in the store:
            # a link planted to a file elsewhere costs that link, never that file
            if whole and ours and os.path.samestat(os.fstat(fd), os.stat(real)):
                os.unlink(real)
            if link:
                os.unlink(path)

    # -- capacity ------------------------------------------------------------------------------------
    def refresh(self, path: str) -> bool:
        """Whether ``path`` exists; under a capacity, also make its object young again (it is still wanted)."""
        try:
            if self.options.capacity_bytes:
                os.utime(path)
            else:
                os.stat(path)
        except OSError:
            return False
        return True

    def make_room(self, need: int) -> None:
        """Evict the oldest objects until ``need`` more bytes fit under ``capacity_bytes`` (down to its low
        water mark, so scans stay rare); :class:`StoreFull` if ``need`` alone exceeds it."""
        cap = self.options.capacity_bytes
        if need > cap:
            raise StoreFull(f"fs store {self.root}: {need} bytes to save exceed capacity_bytes={cap}")
        if self.usage is not None and self.usage + need <= cap:
            return
        objects = sorted(self.scan())
        total = sum(size for _, size, _ in objects)
        evicted = 0
        if total + need > cap:
            target = int(cap * _LOW_WATER) - need
            for _, size, path in objects:
                if total <= target:
                    break
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    evicted += 1
                total -= size  # gone either way: unlinked by us, or by another process
        if evicted:
            self.stats.add(evictions=evicted)
        self.usage = total

    def scan(self) -> Iterator[tuple[float, int, str]]:
        """(mtime, size, path) of every object under the root (v1 objects too); removes stale temporary
        files and links whose object is gone."""
        now = time.time()
        stack = [self.root]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except OSError:
                continue
            for entry in entries:
                try:
                    if entry.is_symlink():  # a locator: gone with its object, or a writer's that died
                        old = entry.name.startswith(".") and now - entry.stat(follow_symlinks=False).st_mtime > _STALE_TMP_S
                        if old or not os.path.exists(entry.path):
                            os.unlink(entry.path)
                        continue
                    if entry.is_dir():
                        stack.append(entry.path)
                        continue
                    st = entry.stat()
                except OSError:
                    continue
                if entry.name.startswith("."):
                    if entry.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    continue
                yield st.st_mtime, st.st_size, entry.path
