"""Stored objects: how a store lays out the objects it keeps, and the checks a reader makes on them.

Two families, one set of checksums and one meaning of failure (:class:`~kvbridge.errors.Corrupted`):

- a **chunk object** (:class:`ChunkFormat`, version 2): a run of consecutive blocks of one prompt —
  what ``fs`` writes (:data:`FS`, one file per chunk) and what ``lmcache`` writes
  (:data:`LMCACHE_CHUNK`, one LMCache value per chunk) — with a checksum per block, so a reader takes
  the blocks it needs, block by block, and a damaged block fails only from itself on;
- a **block object** (:class:`BlockFormat`, version 1): one block — what ``lmcache`` wrote before
  version 2 (:data:`LMCACHE`, an LMCache value per block) and what ``fs`` wrote before version 2
  (:data:`FS_V1`); both kept documented, read by no one: a v1 object is a miss for today's stores.

A block's *payload* is its bytes in every layer, layer after layer (``num_layers * block_bytes``).

**Chunk format** :data:`FS` (version 2, little-endian). A header of ``header_bytes`` — a multiple
of :data:`ALIGN` (4096: blocks start page-aligned, as ``O_DIRECT`` needs; 4096 unless the keys need
more), the rest zero — then the blocks' payloads, block after block::

    offset  bytes  field
         0      8  magic b"KVBRFS\\r\\n" (\\r\\n: a text-mode copy that mangles line ends fails it)
         8      2  format version (2)
        10      2  checksum kind of the blocks (1 crc32, 2 crc32c)
        12      4  header_bytes: where block 0 starts (a multiple of 4096)
        16      2  count n: blocks in the object
        18      2  fingerprint length F
        20      8  payload length of one block (num_layers * block_bytes)
        28      4  zero (reserved)
        32      4  header checksum: zlib crc32 of the header_bytes with this field zero
        36      4  zero
        40      F  the layout fingerprint, canonical JSON (:meth:`LayoutFingerprint.to_json`)
      40+F         n entries, one per block in order: checksum (4), key length K (2), the key (K)

Block ``i`` is the ``payload`` bytes at ``header_bytes + i * payload``; the object is exactly
``header_bytes + n * payload`` long.

:data:`LMCACHE_CHUNK` (version 2) is the same layout with magic ``b"KVBRLM\\r\\n"`` and headers a multiple
of 64 bytes instead of 4096 (an LMCache value is a buffer in LMCache's CPU arena, never read with
``O_DIRECT``; 64 keeps every block 8-byte aligned for word copies, and a small block's object small).

**Checks of a chunk object** (:meth:`ChunkFormat.parse`, then :meth:`Chunk.verify` per block),
in this order::

    at least the fixed fields                            damaged   truncated
    magic                                                damaged   not a kvbridge object
    format version                                       foreign   a v1 object, or a later format
    header length: aligned, within the object            damaged   garbage, truncated
    header checksum                                      damaged   a flipped key, length or checksum
    checksum kind known and verifiable here              foreign   e.g. crc32c, not installed here
    layout fingerprint                                   foreign   another layout's object
    payload length = the layout's                        damaged
    n >= 1, the entries fit the header                   damaged
    size = header + n * payload                          damaged   truncated or extended
    the key wanted is one of the entries (the store)     damaged   another key's object
    block i's checksum (Chunk.verify)                    damaged   bit rot, a torn copy: blocks
                                                                   before i are good, i is not

**Block formats** (version 1, little-endian, the rest of the header zero):

:data:`FS_V1` — 4096-byte header (the payload starts page-aligned: room for ``O_DIRECT`` or ``mmap``;
0.2% of a 2 MiB Llama-3-8B block); key and fingerprint in full, so an object says what it holds::

    offset  bytes  field
         0      8  magic b"KVBRFS\\r\\n" (\\r\\n: a text-mode copy that mangles line ends fails it)
         8      2  format version
        10      2  checksum kind (1 crc32, 2 crc32c)
        12      2  key length K
        14      2  fingerprint length F
        16      8  payload length
        24      4  payload checksum
        28      K  the block key
      28+K      F  the layout fingerprint, canonical JSON (:meth:`LayoutFingerprint.to_json`)

:data:`LMCACHE` — 64-byte header (the payload stays 8-byte aligned); digests instead of the key and
fingerprint, so the header has a fixed size::

    offset  bytes  field
         0      8  magic b"KVBRLM\\r\\n"
         8      2  format version
        10      2  checksum kind (1 crc32, 2 crc32c)
        12      4  payload checksum
        16      8  payload length
        24     16  the layout fingerprint's digest (:meth:`LayoutFingerprint.digest`, ASCII hex)
        40     16  blake2b-128 of the block key

**Checksums.** ``crc32`` (zlib: always there, but several times slower) or ``crc32c`` (:mod:`kvbridge._core`'s
own where built, folded with carry-less multiplies on a CPU with VPCLMULQDQ, else ``google-crc32c``;
:func:`have_crc32c` probes for either once; ``kvbridge bench`` fs rows show what a checked read costs). A writer picks one; a reader verifies whichever kind an object names.

**Checks of a block object** (:meth:`BlockFormat.check`), in this order; each failure raises
:class:`~kvbridge.errors.Corrupted`, whose ``damaged`` says what to do with the object
(``damaged``: delete it; *foreign*: leave it)::

    the object holds at least the header's fixed fields   damaged   truncated
    magic                                                 damaged   not a kvbridge object
    format version                                        foreign   another kvbridge's object
    key and fingerprint lengths fit the header (FS_V1)    damaged   garbage
    key (or its digest)                                   damaged   another key's bytes
    layout fingerprint (or its digest)                    foreign   another layout's object
    payload length = the layout's; size = header+payload  damaged   truncated or extended
    checksum kind known and verifiable here               foreign   e.g. crc32c, not installed here
    checksum                                              damaged   bit rot, a torn copy

A damaged object should be deleted (the next producer writes it again); a foreign one belongs to
another engine and is left alone. Either way it is a failed block, never loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge.checksums import (
    CHECKSUMS,
    CRC32,
    CRC32C,
    block_checksums,
    checksum,
    default_checksum,
    have_crc32c,
    leading_matches,
    require_checksum,
)
from kvbridge.errors import Corrupted
from kvbridge.layout import LayoutFingerprint

VERSION = 1  # of the block formats (LMCACHE, FS_V1)
FS_VERSION = 2  # of the chunk format FS
LMCACHE_VERSION = 2  # of the chunk format LMCACHE_CHUNK
ALIGN = 4096  # a chunk object's header is a multiple of it: blocks start aligned (O_DIRECT, mmap)
MAX_HEADER = 1 << 20  # a chunk header longer than this is garbage


def key_digest(key: bytes) -> bytes:
    """The 16 bytes that stand for ``key`` in a header without room for it."""
    return hashlib.blake2b(key, digest_size=16).digest()


@functools.lru_cache(maxsize=32)
def _fingerprint_field(fingerprint: LayoutFingerprint, digest: bool) -> bytes:
    return (fingerprint.digest() if digest else fingerprint.to_json()).encode()


# -- formats ---------------------------------------------------------------------------------------
_INLINE = struct.Struct("<8sHHHHQI")  # magic, version, kind, key len, fingerprint len, payload len, checksum
_DIGESTS = struct.Struct("<8sHHIQ16s16s")  # magic, version, kind, checksum, payload len, fingerprint, key digest
_PREFIX = struct.Struct("<8sH")  # magic, version: where every format starts


@dataclasses.dataclass(frozen=True)
class _Fields:
    kind: int
    checksum: int
    payload: int
    key: bytes  # the key, or its digest
    fingerprint: bytes  # canonical JSON, or the digest


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """One block-object format: its magic, its header size, and whether the header holds the key and
    fingerprint in full (``inline``) or their 16-byte digests. See the module docstring."""

    magic: bytes
    header_bytes: int
    inline: bool

    @property
    def fixed(self) -> struct.Struct:
        """The header's fixed fields (the rest is the inline key and fingerprint, then zeros)."""
        return _INLINE if self.inline else _DIGESTS

    def pack(self, key: bytes, fingerprint: LayoutFingerprint, parts: Sequence[Any], kind: int) -> bytes:
        """The header (``header_bytes`` long) of an object holding ``parts`` (the payload, in order)."""
        payload = sum(memoryview(p).nbytes for p in parts)
        crc = checksum(kind, parts)
        fp = _fingerprint_field(fingerprint, not self.inline)
        if self.inline:
            header = _INLINE.pack(self.magic, VERSION, kind, len(key), len(fp), payload, crc) + key + fp
        else:
            header = _DIGESTS.pack(self.magic, VERSION, kind, crc, payload, fp, key_digest(key))
        if len(header) > self.header_bytes:
            raise ValueError(f"key ({len(key)} B) and fingerprint ({len(fp)} B) do not fit a {self.header_bytes} B header")
        return header.ljust(self.header_bytes, b"\0")

    def check(self, header: Any, *, key: bytes, fingerprint: LayoutFingerprint, parts: Sequence[Any], size: int) -> None:
        """Raise :class:`Corrupted` unless ``header`` + ``parts`` are the object of ``key`` in ``fingerprint``'s
        layout. ``size`` is the object's whole length on its medium (more than ``header_bytes`` +
        payload when it is longer than it should be); ``parts`` are its payload, in order."""
        fields = self._unpack(header, size)
        if fields.key != (key if self.inline else key_digest(key)):
            raise Corrupted("object holds another key", damaged=True)
        ours = _fingerprint_field(fingerprint, not self.inline)
        if fields.fingerprint != ours:
            raise Corrupted(f"layout {fields.fingerprint.decode(errors='replace')} != ours {ours.decode()}", damaged=False)
        want = fingerprint.num_layers * fingerprint.block_bytes
        if fields.payload != want:
            raise Corrupted(f"payload length {fields.payload} != {want}", damaged=True)
        if size != self.header_bytes + want:
            raise Corrupted(f"object of {size} bytes, the header promises {self.header_bytes + want}", damaged=True)
        if fields.kind not in CHECKSUMS.values() or (fields.kind == CRC32C and not have_crc32c()):
            raise Corrupted(f"checksum kind {fields.kind} cannot be verified here", damaged=False)
        if checksum(fields.kind, parts) != fields.checksum:
            raise Corrupted("checksum mismatch", damaged=True)

    def _unpack(self, header: Any, size: int) -> _Fields:
        fixed = self.fixed
        if size < fixed.size or len(header) < fixed.size:
            raise Corrupted(f"truncated to {size} bytes", damaged=True)
        magic, version = _PREFIX.unpack_from(header)
        if magic != self.magic:
            raise Corrupted("bad magic", damaged=True)
        if version != VERSION:
            raise Corrupted(f"format version {version}, this reader knows {VERSION}", damaged=False)
        if not self.inline:
            _, _, kind, crc, payload, fp, digest = _DIGESTS.unpack_from(header)
            return _Fields(kind, crc, payload, digest, fp)
        _, _, kind, key_len, fp_len, payload, crc = _INLINE.unpack_from(header)
        end = _INLINE.size + key_len + fp_len
        if end > self.header_bytes or end > len(header):
            raise Corrupted("header lengths out of range", damaged=True)
        view = memoryview(header)
        key = bytes(view[_INLINE.size : _INLINE.size + key_len])
        return _Fields(kind, crc, payload, key, bytes(view[_INLINE.size + key_len : end]))


# -- chunk objects ---------------------------------------------------------------------------------
_CHUNK = struct.Struct("<8sHHIHHQIII")  # magic, version, kind, header len, count, fp len, payload, 0, header crc, 0
_ENTRY = struct.Struct("<IH")  # a block's checksum, its key's length (the key follows)
_HEADER_CRC = slice(32, 36)  # where the header checksum lives (zero while it is computed)


def _header_crc(header: Any) -> int:
    view = memoryview(header)
    crc = zlib.crc32(view[: _HEADER_CRC.start])
    crc = zlib.crc32(b"\0\0\0\0", crc)
    return zlib.crc32(view[_HEADER_CRC.stop :], crc)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A chunk object's header, checked (:meth:`ChunkFormat.parse`): which blocks it holds, and where."""

    kind: int  # checksum kind of the blocks
    header_bytes: int  # where block 0 starts
    payload: int  # bytes of one block (every layer)
    keys: tuple[bytes, ...]
    checksums: tuple[int, ...]

    @property
    def size(self) -> int:
        """The object's length: header and every block."""
        return self.header_bytes + len(self.keys) * self.payload

    def offset(self, i: int) -> int:
        """Where block ``i`` starts in the object."""
        return self.header_bytes + i * self.payload

    def find(self, key: bytes) -> int:
        """The position of ``key`` among the object's blocks; :class:`Corrupted` (damaged) if absent."""
        try:
            return self.keys.index(key)
        except ValueError:
            raise Corrupted("object holds another key", damaged=True) from None

    def verify(self, i: int, parts: Sequence[Any]) -> None:
        """Raise :class:`Corrupted` (damaged) unless ``parts`` (block ``i``'s payload, in order) match its checksum."""
        if checksum(self.kind, parts) != self.checksums[i]:
            raise self.mismatch(i)

    def mismatch(self, i: int) -> Corrupted:
        """The error of block ``i`` whose bytes do not match its checksum (every reader says it this way)."""
        return Corrupted(f"checksum mismatch in block {i} of {len(self.keys)}", damaged=True)

    def packed_sums(self, i: int, n: int) -> bytes:
        """The checksums of blocks ``i .. i+n-1`` as little-endian uint32s, as a native read gives them
        (``checked()``): one bytes comparison tells whether a whole read matched."""
        return struct.pack(f"<{n}I", *self.checksums[i : i + n])

    def matching(self, i: int, sums: Any) -> int:
        """How many of ``sums`` (the checksums of blocks ``i, i+1, ...`` as read, uint32) equal the object's, from
        the first (``len(sums)``: all of them)."""
        return leading_matches(sums, self.checksums[i : i + len(sums)])

    def first_bad(self, i: int, blocks: np.ndarray) -> int:
        """How many of ``blocks`` (contiguous ``[n, payload]``: blocks ``i..i+n-1`` of this object) match
        their checksums, from the first (``n``: all of them)."""
        return self.matching(i, block_checksums(self.kind, blocks))


@dataclasses.dataclass(frozen=True)
class ChunkFormat:
    """The chunk-object format: a header naming every block (key and checksum), then the blocks. See the
    module docstring for the byte layout and the checks."""

    magic: bytes
    version: int
    align: int = ALIGN

    @property
    def fixed(self) -> struct.Struct:
        """The header's fixed fields."""
        return _CHUNK

    def header_length(self, keys: Sequence[bytes], fingerprint: LayoutFingerprint) -> int:
        """``header_bytes`` of an object holding blocks ``keys`` in ``fingerprint``'s layout."""
        used = _CHUNK.size + len(_fingerprint_field(fingerprint, False)) + sum(_ENTRY.size + len(k) for k in keys)
        return -(-used // self.align) * self.align

    def pack(self, keys: Sequence[bytes], fingerprint: LayoutFingerprint, checksums: Sequence[int], kind: int) -> bytes:
        """The header of an object holding blocks ``keys``, in order, whose payloads have ``checksums`` (of ``kind``)."""
        if not keys or len(keys) != len(checksums):
            raise ValueError(f"{len(keys)} keys and {len(checksums)} checksums: one of each per block, at least one")
        if len(keys) > 0xFFFF or any(len(k) > 0xFFFF for k in keys):
            raise ValueError("at most 65535 blocks per object, keys of at most 65535 bytes")
        fp = _fingerprint_field(fingerprint, False)
        size = self.header_length(keys, fingerprint)
        if size > MAX_HEADER:
            raise ValueError(f"a header of {size} bytes exceeds {MAX_HEADER}: fewer or shorter keys per object")
        payload = fingerprint.num_layers * fingerprint.block_bytes
        table = b"".join(_ENTRY.pack(c, len(k)) + k for k, c in zip(keys, checksums))
        fixed = _CHUNK.pack(self.magic, self.version, kind, size, len(keys), len(fp), payload, 0, 0, 0)
        header = bytearray((fixed + fp + table).ljust(size, b"\0"))
        struct.pack_into("<I", header, _HEADER_CRC.start, _header_crc(header))
        return bytes(header)

    def header_bytes(self, head: Any, size: int) -> int:
        """How long the header is, from the object's first bytes ``head`` (at least :attr:`align` of them,
        or the whole object if shorter) and its length ``size``; :class:`Corrupted` when those bytes
        cannot start an object of this format (the first four checks of the table)."""
        if size < _CHUNK.size or len(head) < _CHUNK.size:
            raise Corrupted(f"truncated to {size} bytes", damaged=True)
        magic, version = _PREFIX.unpack_from(head)
        if magic != self.magic:
            raise Corrupted("bad magic", damaged=True)
        if version != self.version:
            raise Corrupted(f"format version {version}, this reader knows {self.version}", damaged=False)
        length = _CHUNK.unpack_from(head)[3]
        if length < _CHUNK.size or length % self.align or length > MAX_HEADER:
            raise Corrupted(f"header length {length} out of range", damaged=True)
        if length > size:
            raise Corrupted(f"truncated to {size} bytes, the header alone is {length}", damaged=True)
        return int(length)

    def parse(self, header: Any, *, fingerprint: LayoutFingerprint, size: int) -> Chunk:
        """The checked header of an object of ``size`` bytes in ``fingerprint``'s layout; ``header`` is its
        first :meth:`header_bytes` bytes. Raises :class:`Corrupted` (the module docstring's table)."""
        length = self.header_bytes(header, size)
        if len(header) < length:
            raise Corrupted(f"header of {len(header)} bytes, it says {length}", damaged=True)
        view = memoryview(header)[:length]
        _, _, kind, _, count, fp_len, payload, _, crc, _ = _CHUNK.unpack_from(view)
        if _header_crc(view) != crc:
            raise Corrupted("header checksum mismatch", damaged=True)
        if kind not in CHECKSUMS.values() or (kind == CRC32C and not have_crc32c()):
            raise Corrupted(f"checksum kind {kind} cannot be verified here", damaged=False)
        at = _CHUNK.size + fp_len
        if at > length:
            raise Corrupted("header lengths out of range", damaged=True)
        ours = _fingerprint_field(fingerprint, False)
        theirs = bytes(view[_CHUNK.size : at])
        if theirs != ours:
            raise Corrupted(f"layout {theirs.decode(errors='replace')} != ours {ours.decode()}", damaged=False)
        want = fingerprint.num_layers * fingerprint.block_bytes
        if payload != want:
            raise Corrupted(f"payload length {payload} != {want}", damaged=True)
        if count < 1:
            raise Corrupted("an object of no blocks", damaged=True)
        keys, sums = [], []
        for _ in range(count):
            if at + _ENTRY.size > length:
                raise Corrupted("header lengths out of range", damaged=True)
            crc_i, key_len = _ENTRY.unpack_from(view, at)
            at += _ENTRY.size
            if at + key_len > length:
                raise Corrupted("header lengths out of range", damaged=True)
            keys.append(bytes(view[at : at + key_len]))
            sums.append(crc_i)
            at += key_len
        chunk = Chunk(kind, length, payload, tuple(keys), tuple(sums))
        if size != chunk.size:
            raise Corrupted(f"object of {size} bytes, the header promises {chunk.size}", damaged=True)
        return chunk


FS = ChunkFormat(magic=b"KVBRFS\r\n", version=FS_VERSION)
FS_V1 = BlockFormat(magic=b"KVBRFS\r\n", header_bytes=4096, inline=True)
LMCACHE = BlockFormat(magic=b"KVBRLM\r\n", header_bytes=64, inline=False)  # version 1: written before LMCACHE_CHUNK
LMCACHE_CHUNK = ChunkFormat(magic=b"KVBRLM\r\n", version=LMCACHE_VERSION, align=64)

__all__ = [
    "ALIGN",
    "CHECKSUMS",
    "CRC32",
    "CRC32C",
    "FS",
    "FS_V1",
    "FS_VERSION",
    "LMCACHE",
    "LMCACHE_CHUNK",
    "LMCACHE_VERSION",
    "MAX_HEADER",
    "VERSION",
    "BlockFormat",
    "Chunk",
    "ChunkFormat",
    "checksum",
    "default_checksum",
    "have_crc32c",
    "key_digest",
    "leading_matches",
    "require_checksum",
]
