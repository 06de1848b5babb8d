"""The lmcache tier's options, and the constants of its keys, objects and locators."""

from __future__ import annotations

import dataclasses
import re
import struct
from typing import Literal

from kvbridge import codec
from kvbridge.options import require

HINT = "pip install 'kvbridge[lmcache]'"
FORMAT = codec.LMCACHE_CHUNK
MAGIC = FORMAT.magic
VERSION = FORMAT.version
HEADER_BYTES = FORMAT.align  # the unit of a header's length (a chunk object's header is a multiple of it)
KEY_LIMIT = 150  # LMCache asserts on longer key strings
MAX_HASH = 32  # longer block keys are hashed to this many bytes (the header keeps the full key)
MAX_BLOCKS = 0xFFFF  # blocks per object the header can count
MODEL_NAME = re.compile(r"[A-Za-z0-9._-]{1,40}")
REMOTE = "RemoteBackend"
DELETABLE = ("LocalCPUBackend", "LocalDiskBackend")
MIN_LOCATORS, MAX_LOCATORS = 1 << 14, 1 << 20  # block -> object entries a manager keeps (as its tiers hold blocks)
# a locator object in the remote: magic, version, blocks in the object, the block's position in it, length of the
# object's chunk hash, a digest of the block key, the object's chunk hash (zero-padded)
LOCATOR = struct.Struct("<8sHHHH16s32s")
LOCATOR_MAGIC = b"KVBRLL\r\n"


@dataclasses.dataclass(frozen=True)
class LMCacheOptions:
    """Which LMCache tiers hold the blocks, and how long to wait for them.

    ``remote_url``: an LMCache remote (``lm://host:port``, ``redis://host:port``, …); the only tier
    shared across processes. ``local_cpu_bytes``: LMCache's CPU arena, allocated up front; every
    object passes through it, so it must hold two of the largest (``2 * chunk_tokens`` tokens of KV
    each). ``cpu_cache``: also keep saved and loaded objects in that arena (a hot tier, LRU-evicted);
    off, it is only a staging buffer. ``local_disk`` + ``local_disk_bytes``: a disk tier in that
    directory (private to the process). ``model_name``: a readable label in every LMCache key (the
    namespace digest follows it). ``timeout_s``: the longest a save waits for its writes, and a remote
    call for its reply. ``reconnect_s``: how often to retry a remote that went away. ``checksum``:
    ``crc32`` or ``crc32c`` (hardware: the native module or ``google-crc32c``; the default where either is);
    readers verify whichever kind an object names. ``chunk_tokens``: tokens per object on average (in
    whole blocks, at least one); engines find each other's objects only with the same number of blocks
    per chunk.
    """

    remote_url: str = ""
    local_cpu_bytes: int = 1 << 30
    cpu_cache: bool = True
    local_disk: str = ""
    local_disk_bytes: int = 0
    model_name: str = "kvbridge"
    timeout_s: float = 30.0
    reconnect_s: float = 10.0
    checksum: Literal["crc32", "crc32c"] = dataclasses.field(default_factory=codec.default_checksum)
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        require(
            not self.remote_url or re.match(r"[a-z][a-z0-9+.-]*://", self.remote_url) is not None,
            f"lmcache option 'remote_url' must look like lm://host:port, got {self.remote_url!r}",
        )
        require(self.local_cpu_bytes >= 1 << 20, f"lmcache option 'local_cpu_bytes' must be >= 1 MiB, got {self.local_cpu_bytes}")
        require(
            "," not in self.local_disk,  # LMCache reads the path as a comma-separated list
            f"lmcache option 'local_disk' must be one directory, got {self.local_disk!r}",
        )
        require(
            (self.local_disk_bytes > 0) == bool(self.local_disk),
            "lmcache options 'local_disk' and 'local_disk_bytes' (> 0) go together",
        )
        require(
            MODEL_NAME.fullmatch(self.model_name) is not None,
            f"lmcache option 'model_name' must be 1-40 of [A-Za-z0-9._-], got {self.model_name!r}",
        )
        require(self.timeout_s > 0, f"lmcache option 'timeout_s' must be > 0, got {self.timeout_s}")
        require(self.reconnect_s >= 0, f"lmcache option 'reconnect_s' must be >= 0, got {self.reconnect_s}")
        require(
            isinstance(self.chunk_tokens, int) and 1 <= self.chunk_tokens <= 1 << 15,
            f"lmcache option 'chunk_tokens' must be in [1, 32768], got {self.chunk_tokens!r}",
        )
