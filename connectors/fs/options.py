"""What configures an ``fs`` store, and what its scheduler side tells its workers about a load or a save."""

from __future__ import annotations

import dataclasses
from typing import Literal

from kvbridge import codec
from kvbridge.options import require


@dataclasses.dataclass(frozen=True)
class FsOptions:
    """``path``: the shared directory (created if missing). ``capacity_bytes``: 0 = unbounded, else
    evict oldest objects to stay under it. ``fsync``: flush every object before the save returns.
    ``checksum``: ``crc32`` (zlib, always there) or ``crc32c`` (computed by the CPU's crc32c instruction,
    several times faster than zlib's crc32: kvbridge's native module where built, else ``google-crc32c``,
    in ``kvbridge[fs]``; the default where either is there);
    readers verify whichever kind an object names. ``chunk_tokens``: tokens per object on average (in
    whole blocks, at least one); engines sharing a directory find each other's objects only with the
    same number of blocks per chunk. ``io_threads``: threads moving one load's or save's blocks.
    ``o_direct``: bypass the page cache (``O_DIRECT``; refused where the filesystem cannot)."""

    path: str
    capacity_bytes: int = 0
    fsync: bool = False
    checksum: Literal["crc32", "crc32c"] = dataclasses.field(default_factory=codec.default_checksum)
    chunk_tokens: int = 256
    io_threads: int = 2
    o_direct: bool = False

    def __post_init__(self) -> None:
        require(bool(self.path), "fs option 'path' must name a directory")
        require(self.capacity_bytes >= 0, f"fs option 'capacity_bytes' must be >= 0, got {self.capacity_bytes}")
        require(self.chunk_tokens >= 1, f"fs option 'chunk_tokens' must be >= 1, got {self.chunk_tokens}")
        require(1 <= self.io_threads <= 64, f"fs option 'io_threads' must be in [1, 64], got {self.io_threads}")


@dataclasses.dataclass(frozen=True)
class FsSave:
    """``BlockSave.target`` of an ``fs`` save: the keys of the blocks before its first in the same chunk
    (``()``: it starts a chunk; ``None``: not known, so that chunk is not written)."""

    head: tuple[bytes, ...] | None = ()


@dataclasses.dataclass(frozen=True)
class FsLoad:
    """``BlockLoad.source`` of an ``fs`` load whose blocks another TP size saved: its ``tp``."""

    tp: int
