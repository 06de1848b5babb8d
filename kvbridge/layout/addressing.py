"""Where blocks live in memory (:class:`BlockAddressing`), for transports that read another process's KV
straight into their own, and runs of block ids (:func:`coalesce`)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

import numpy as np
import torch

from kvbridge.errors import LayoutError, LayoutMismatch


def packed_offsets(lengths: np.ndarray) -> np.ndarray:
    """Where each piece starts (``uint64``) in a copy that holds ``lengths`` back to back: a stored copy of
    :meth:`BlockAddressing.by_block`'s pieces (an object's body, a file's run of blocks)."""
    out = np.zeros(len(lengths), dtype=np.uint64)
    np.cumsum(lengths[:-1], out=out[1:])
    return out


def coalesce(block_ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[tuple[int, int]]:
    """Runs of consecutive ids as ``(start, count)`` pairs, in order: ``[3,4,5,9]`` -> ``[(3,3),(9,1)]``."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.concatenate(([0], breaks))]
    counts = np.diff(np.concatenate(([0], breaks, [ids.size])))
    return list(zip(starts.tolist(), counts.tolist()))


@dataclasses.dataclass(frozen=True)
class BlockAddressing:
    """Where each block of each layer lives in memory: what a one-sided transport needs to read blocks
    of another process's KV straight into its own, with no staging copy on either side.

    Block ``b`` of layer ``l`` is the pieces ``bases[l] + b * block_stride + offset`` for each
    ``(offset, length)`` in ``pieces``, in the order :meth:`KVLayout.gather` yields its bytes (one
    piece where a block is contiguous; K and V apart in ``kv_first``). Two sides whose fingerprints
    agree have the same piece lengths; offsets and strides may differ (other ``num_blocks``).
    """

    bases: tuple[int, ...]
    block_stride: int
    pieces: tuple[tuple[int, int], ...]

    def addresses(self, block_ids: np.ndarray) -> np.ndarray:
        """Addresses of every piece of ``block_ids`` in every layer, ``uint64 [layers * n * pieces]``,
        layer-major; one vectorized expression (no loop over blocks)."""
        ids = np.asarray(block_ids, dtype=np.uint64).reshape(1, -1, 1)
        return (self._bases + ids * self._stride + self._offsets).reshape(-1)

    def lengths(self, num_blocks: int) -> np.ndarray:
        """Lengths matching :meth:`addresses` of ``num_blocks`` blocks, ``uint64``, read-only: the front of
        one array kept for the most blocks asked so far (a ``tile`` per load was ~6 numpy calls)."""
        per_block = len(self.bases) * len(self.pieces)
        kept = self._kept[0]
        if len(kept) < per_block * num_blocks:  # grown by doubling; a racing thread's copy is as good as ours
            blocks = max(num_blocks, 2 * len(kept) // per_block)
            kept = np.tile(self._lengths, len(self.bases) * blocks)
            kept.flags.writeable = False
            self._kept[0] = kept
        return kept[: per_block * num_blocks]

    def by_block(self, block_ids: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Addresses and lengths (``uint64``) of every piece of ``block_ids``, block-major: each block's
        bytes in the order a stored copy holds them (every layer's pieces, layer after layer)."""
        ids = np.asarray(block_ids, dtype=np.uint64).reshape(-1, 1, 1)  # [block, layer, piece]: no transposed copy
        return (ids * self._stride + self._starts).reshape(-1), self.lengths(len(ids))

    def first_block(self) -> tuple[np.ndarray, np.ndarray]:
        """Addresses and lengths (``uint64``, read-only) of block 0's pieces in :meth:`by_block`'s order:
        block ``b``'s are its addresses plus ``b * block_stride``, its lengths the same. What a native call
        takes instead of every block's (``kvbridge._core.file_start(block_ids=)``): no array per transfer."""
        return self._first

    @functools.cached_property
    def _first(self) -> tuple[np.ndarray, np.ndarray]:
        starts = self._starts.reshape(-1)
        starts.flags.writeable = False
        return starts, self.lengths(1)

    # the tuples as arrays, made once (a load's addressing runs on the engine's thread)
    @functools.cached_property
    def _bases(self) -> np.ndarray:
        return np.asarray(self.bases, dtype=np.uint64).reshape(-1, 1, 1)

    @functools.cached_property
    def _stride(self) -> np.uint64:
        return np.uint64(self.block_stride)

    @functools.cached_property
    def _starts(self) -> np.ndarray:
        """Where each layer's pieces of block 0 start, ``[1, layer, piece]`` (:meth:`by_block`'s order)."""
        return self._bases.reshape(1, -1, 1) + self._offsets

    @functools.cached_property
    def _offsets(self) -> np.ndarray:
        return np.asarray([o for o, _ in self.pieces], dtype=np.uint64).reshape(1, 1, -1)

    @functools.cached_property
    def _kept(self) -> list[np.ndarray]:
        return [np.empty(0, np.uint64)]

    @functools.cached_property
    def _lengths(self) -> np.ndarray:
        return np.asarray([n for _, n in self.pieces], dtype=np.uint64)

    def to_json(self) -> str:
        return json.dumps({"bases": list(self.bases), "block_stride": self.block_stride,
                           "pieces": [list(p) for p in self.pieces]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> BlockAddressing:
        """Parse a peer's addressing; anything malformed is a :class:`LayoutMismatch`."""
        try:
            data = json.loads(text)
            out = cls(tuple(int(b) for b in data["bases"]), int(data["block_stride"]),
                      tuple((int(o), int(n)) for o, n in data["pieces"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise LayoutMismatch(f"malformed block addressing: {exc}") from exc
        values = (*out.bases, out.block_stride, *(v for p in out.pieces for v in p))
        if not out.bases or not out.pieces or any(not 0 <= v < 2**64 for v in values):
            raise LayoutMismatch("malformed block addressing: empty or out of range")
        return out

    def select(self, layers: range) -> BlockAddressing:
        """The same blocks in ``layers`` only (one KV-cache group's, :attr:`KVLayout.groups`)."""
        return BlockAddressing(self.bases[layers.start : layers.stop], self.block_stride, self.pieces)

    def narrowed(self, offset: int, length: int) -> BlockAddressing:
        """The same blocks cut down to bytes ``[offset, offset + length)`` of each (a :class:`Cut`'s side);
        only where a block is one piece (:class:`LayoutMismatch` otherwise)."""
        if len(self.pieces) != 1 or not (0 <= offset and length > 0 and offset + length <= self.pieces[0][1]):
            raise LayoutMismatch(f"blocks in pieces {self.pieces} cannot be cut to [{offset}, {offset + length})")
        return BlockAddressing(self.bases, self.block_stride, ((self.pieces[0][0] + offset, length),))

    def check_compatible(self, other: BlockAddressing) -> None:
        """Raise :class:`LayoutMismatch` unless ``other`` cuts blocks into the same pieces, layer for layer."""
        if len(other.bases) != len(self.bases) or [n for _, n in other.pieces] != [n for _, n in self.pieces]:
            raise LayoutMismatch(f"blocks are cut differently: {len(other.bases)} layers x {other.pieces} vs "
                                 f"{len(self.bases)} x {self.pieces}")


def staged_addressing(staging: torch.Tensor) -> BlockAddressing:
    """A staging buffer ``[num_layers, n, block_bytes]`` (host memory, contiguous) addressed as a KV of ``n``
    blocks, block ``i`` being ``staging[:, i]``: one piece per layer, so its bytes come in the order a
    stored copy holds them (:meth:`KVLayout.gather`'s), whatever the pieces of the KV it was gathered from."""
    if staging.device.type != "cpu" or not staging.is_contiguous() or staging.dim() != 3:
        raise LayoutError(f"staging must be a contiguous host [layers, n, block_bytes] buffer, got {tuple(staging.shape)}")
    layers, _, block_bytes = staging.shape
    return BlockAddressing(tuple(int(staging[i].data_ptr()) for i in range(layers)), block_bytes, ((0, block_bytes),))


__all__ = ["BlockAddressing", "coalesce", "packed_offsets", "staged_addressing"]
