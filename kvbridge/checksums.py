"""Checksums of stored blocks: ``crc32`` (zlib, always there) or ``crc32c`` (:mod:`kvbridge._core`'s own where
built, else ``google-crc32c``), named in a header by their kind (:data:`CHECKSUMS`). What an object's format
does with them is :mod:`kvbridge.codec`'s."""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Literal

import numpy as np

from kvbridge.errors import MissingDependency

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


@functools.cache
def native_crc32c() -> ModuleType | None:
    """:mod:`kvbridge._core` where it loaded and this CPU has its crc32c (SSE4.2), else ``None``; probed once."""
    from kvbridge import native  # here: checksums (and codec) are imported where the native module is not wanted

    return native.crc32c_module()


def have_crc32c() -> bool:
    """Whether ``crc32c`` can be computed here: :mod:`kvbridge._core`'s own, or ``google-crc32c``; probed once.
    (Either is enough: an environment without the ``fs`` extra, vLLM's, still writes and checks crc32c.)"""
    return native_crc32c() is not None or _google_crc32c() is not None


def default_checksum() -> Literal["crc32", "crc32c"]:
    """``crc32c`` where it can be computed, else ``crc32``."""
    return "crc32c" if have_crc32c() else "crc32"


_NO_CRC32C = "needs kvbridge's native module or google-crc32c: pip install google-crc32c"


def require_checksum(name: str, what: str) -> None:
    """Raise :class:`MissingDependency` when option ``checksum=name`` of backend ``what`` cannot work here."""
    if name == "crc32c" and not have_crc32c():
        raise MissingDependency(f"{what} option checksum='crc32c' {_NO_CRC32C}")


def _native_checksum(mod: ModuleType, parts: Sequence[Any]) -> int:
    """crc32c of the concatenation of ``parts`` in one native call (the GIL released); strided parts copied."""
    if not parts:
        return 0
    flat = [np.ascontiguousarray(np.frombuffer(p, np.uint8) if isinstance(p, (bytes, bytearray)) else np.asarray(p))
            for p in parts]  # fmt: skip
    addresses = np.array([a.ctypes.data for a in flat], np.uint64)
    lengths = np.array([a.nbytes for a in flat], np.uint64)
    return int.from_bytes(mod.crc32c(addresses, lengths, len(flat)), "little")


def checksum(kind: int, parts: Sequence[Any]) -> int:
    """The checksum of the concatenation of ``parts`` (buffers: memoryviews, numpy arrays), no copy of a
    contiguous part."""
    crc = 0
    if kind == CRC32C:
        mod = native_crc32c()
        if mod is not None:
            return _native_checksum(mod, parts)
        lib = _google_crc32c()
        if lib is None:
            raise MissingDependency(f"crc32c {_NO_CRC32C}")
        for part in parts:
            # it refuses memoryviews and strided arrays (a contiguous numpy view is no copy); it releases
            # the GIL only for bytes >= 1 MiB
            crc = lib.extend(crc, part if isinstance(part, bytes) else np.ascontiguousarray(part))
        return int(crc)
    if kind != CRC32:
        raise ValueError(f"unknown checksum kind {kind}")
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def block_checksums(kind: int, blocks: np.ndarray) -> np.ndarray:
    """The checksum of each row of ``blocks`` (contiguous uint8 ``[n, payload]``: an object's blocks, one
    after another), ``uint32 [n]``. crc32c goes through :mod:`kvbridge._core` in one call, the GIL released,
    where it is built; otherwise one :func:`checksum` per block."""
    if kind == CRC32C and blocks.size and blocks.flags.c_contiguous:
        mod = native_crc32c()
        if mod is not None:
            n, payload = blocks.shape
            addresses = np.uint64(blocks.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(payload)
            return np.frombuffer(mod.crc32c(addresses, payload, 1), "<u4").astype(np.uint32)
    return np.asarray([checksum(kind, [row]) for row in blocks], dtype=np.uint32)


def leading_matches(got: Any, want: Any) -> int:
    """How many of the checksums ``got`` equal ``want``'s, from the first: where a read's blocks stop counting.
    Both uint32 sequences, or both ``bytes`` of little-endian uint32s (a native read's ``checked()`` sums beside
    :meth:`Chunk.packed_sums`): a read that matched whole is then one comparison: no numpy call, whose dispatch is slow when cold after a forward pass."""
    if isinstance(got, bytes) and isinstance(want, bytes):
        if got == want:
            return len(got) // 4
        got, want = np.frombuffer(got, "<u4"), np.frombuffer(want, "<u4")
    bad = np.flatnonzero(np.asarray(got, np.uint32) != np.asarray(want, np.uint32))
    return int(bad[0]) if bad.size else len(got)


__all__ = ["CHECKSUMS", "CRC32", "CRC32C", "block_checksums", "checksum", "default_checksum", "have_crc32c",
           "leading_matches", "native_crc32c", "require_checksum"]
