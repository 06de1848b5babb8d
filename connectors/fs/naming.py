"""Where an ``fs`` object lives: its file name from its key, the chunks a prompt's keys are cut into, and
the directory of an engine's shard (see the package docstring for the tree)."""

from __future__ import annotations

import hashlib
import os
import re
import zlib
from collections.abc import Sequence

import numpy as np
from kvbridge.connectors.fs.options import FsOptions

from kvbridge import codec
from kvbridge.contract import EngineInfo

FORMAT = codec.FS
MAGIC = FORMAT.magic
VERSION = FORMAT.version
HEADER_BYTES = FORMAT.align  # a header's usual length: block 0 starts here unless the keys need more
_FIXED = FORMAT.fixed  # the header's fixed fields (tests forge objects with it)
_MAX_HEX_KEY = 64  # longer keys are hashed into the file name (NAME_MAX is 255); the header keeps the key
SHARD = re.compile(r"tp(\d+)\.(\d+)")  # a shard's directory: tp<T>.<rank>


def object_name(key: bytes) -> str:
    """The file name of ``key``: its hex digits, or ``h`` + a blake2b hex digest for empty or long keys."""
    if 0 < len(key) <= _MAX_HEX_KEY // 2:
        return key.hex()
    return "h" + hashlib.blake2b(key, digest_size=32).hexdigest()


def chunk_blocks(block_size: int, chunk_tokens: int) -> int:
    """Blocks per chunk (on average): ``chunk_tokens`` rounded down to whole blocks, at least one."""
    return max(1, chunk_tokens // max(1, block_size))


def ends_chunk(key: bytes, chunk: int) -> bool:
    """Whether the block of ``key`` is the last of its chunk (of ``chunk`` blocks on average)."""
    return chunk == 1 or zlib.crc32(key) % chunk == 0


def chunk_end(keys: Sequence[bytes], i: int, chunk: int) -> int:
    """The index of the last block of the chunk holding ``keys[i]`` (the last key if its chunk goes on)."""
    last = len(keys) - 1
    if chunk == 1:
        return min(i, last)
    crc = zlib.crc32  # (inline: this runs once per key of every lookup)
    while i < last and crc(keys[i]) % chunk:
        i += 1
    return i


def chunk_ends(keys: Sequence[bytes], chunk: int) -> list[int]:
    """The index of the last block of every chunk ``keys`` are cut into, in order (the last key ends one):
    :func:`chunk_end` for all of them at once, the crc32s in one C-level pass (no Python loop per key)."""
    n = len(keys)
    if chunk == 1 or n == 0:
        return list(range(n))
    crcs = np.fromiter(map(zlib.crc32, keys), dtype=np.uint32, count=n)
    ends = np.flatnonzero(crcs % np.uint32(chunk) == 0).tolist()
    return ends if ends and ends[-1] == n - 1 else [*ends, n - 1]


def chunk_lengths(keys: Sequence[bytes], chunk: int) -> list[int]:
    """How many blocks each chunk ``keys`` are cut into holds, in order."""
    return np.diff([-1, *chunk_ends(keys, chunk)]).tolist()


class Tree:
    """Where one engine's objects live under the shared root: its namespace, shard and chunk size."""

    def __init__(self, engine: EngineInfo, options: FsOptions):
        self.options = options
        self.root = os.path.abspath(options.path)
        self.chunk = chunk_blocks(engine.block_size, options.chunk_tokens)
        self.ns_dir = os.path.join(self.root, hashlib.sha256(engine.namespace.encode()).hexdigest()[:16])
        self.tp = engine.kv_world_size
        self.dir = self.shard_dir(self.tp, engine.kv_rank)

    def shard_dir(self, tp: int, rank: int) -> str:
        """The directory of rank ``rank``'s objects in a ``tp``-way engine of this namespace."""
        return os.path.join(self.ns_dir, f"tp{tp}.{rank}", f"v{VERSION}-{self.chunk}")

    def path_of(self, key: bytes, folder: str | None = None) -> str:
        """The locator of ``key`` (in this engine's shard, or ``folder``): its chunk's object (the chunk's
        last block), or a link to it."""
        name = key.hex() if 0 < len(key) <= _MAX_HEX_KEY // 2 else object_name(key)
        return f"{folder or self.dir}{os.sep}{name[:2]}{os.sep}{name}"
