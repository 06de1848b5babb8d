"""Block objects: how a store that keeps one object per block lays that object out, and checks it.

``fs`` (a file per block) and ``lmcache`` (an LMCache value per block) write each block as one
*block object*: a fixed-size header, then the *payload* — the block's bytes in every layer, layer
after layer (``num_layers * block_bytes``). The two keep the formats they have always written
(objects already stored stay readable), so a :class:`BlockFormat` is parametrized; everything else
— the checksums, packing a header, the checks a reader makes and what a failure means — is here once.

**Formats** (version 1, little-endian, the rest of the header zero):

:data:`FS` — 4096-byte header (the payload starts page-aligned: room for ``O_DIRECT`` or ``mmap``;
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

**Checksums.** ``crc32`` (zlib: always there, ~3.7 GB/s here) or ``crc32c`` (``google-crc32c``,
hardware, ~22 GB/s; :func:`have_crc32c` probes for it once). A writer picks one; a reader verifies
whichever kind an object names.

**Checks** (:meth:`BlockFormat.check`), in this order; each failure raises
:class:`~kvbridge.errors.Corrupted`, whose ``damaged`` says what to do with the object
(``damaged``: delete it; *foreign*: leave it)::

    the object holds at least the header's fixed fields   damaged   truncated
    magic                                                 damaged   not a kvbridge object
    format version                                        foreign   another kvbridge's object
    key and fingerprint lengths fit the header (FS)       damaged   garbage
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
from types import ModuleType
from typing import Any, Literal

import numpy as np

from kvbridge.errors import Corrupted, MissingDependency
from kvbridge.layout import LayoutFingerprint

VERSION = 1
CHECKSUMS: dict[str, int] = {"crc32": 1, "crc32c": 2}  # option value -> the kind a header stores
CRC32, CRC32C = CHECKSUMS["crc32"], CHECKSUMS["crc32c"]


# -- checksums -------------------------------------------------------------------------------------
@functools.cache
def _google_crc32c() -> ModuleType | None:
    try:
        import google_crc32c
    except ImportError:
        return None
    return google_crc32c


def have_crc32c() -> bool:
    """Whether ``crc32c`` can be computed here (``pip install google-crc32c``); probed once."""
    return _google_crc32c() is not None


def default_checksum() -> Literal["crc32", "crc32c"]:
    """``crc32c`` where it is installed, else ``crc32``."""
    return "crc32c" if have_crc32c() else "crc32"


def require_checksum(name: str, what: str) -> None:
    """Raise :class:`MissingDependency` when option ``checksum=name`` of backend ``what`` cannot work here."""
    if name == "crc32c" and not have_crc32c():
        raise MissingDependency(f"{what} option checksum='crc32c' needs google-crc32c: pip install google-crc32c")


def checksum(kind: int, parts: Sequence[Any]) -> int:
    """The checksum of the concatenation of ``parts`` (buffers: memoryviews, numpy arrays), no copy."""
    crc = 0
    if kind == CRC32C:
        lib = _google_crc32c()
        if lib is None:
            raise MissingDependency("crc32c needs google-crc32c: pip install google-crc32c")
        for part in parts:
            crc = lib.extend(crc, np.asarray(part))  # it refuses memoryviews; a numpy view is no copy
        return int(crc)
    if kind != CRC32:
        raise ValueError(f"unknown checksum kind {kind}")
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


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


FS = BlockFormat(magic=b"KVBRFS\r\n", header_bytes=4096, inline=True)
LMCACHE = BlockFormat(magic=b"KVBRLM\r\n", header_bytes=64, inline=False)

__all__ = [
    "CHECKSUMS",
    "CRC32",
    "CRC32C",
    "FS",
    "LMCACHE",
    "VERSION",
    "BlockFormat",
    "checksum",
    "default_checksum",
    "have_crc32c",
    "key_digest",
    "require_checksum",
]
