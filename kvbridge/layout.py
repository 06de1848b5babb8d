"""KV layout: how an engine's paged KV cache is addressed, and moving blocks in and out of it.

An engine registers one tensor per attention layer. kvbridge reads what it needs from the tensors
themselves (shape for the logical roles, strides, dtype and device for addressing) and builds a
:class:`KVLayout`. Three shapes are understood:

- ``blocks_first`` — ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM >= 0.26: K and V
  side by side on the last axis; every layer a view of one shared allocation; possibly
  non-contiguous on GPU);
- ``kv_first`` — ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (older vLLM);
- ``mla`` — ``[num_blocks, block_size, head_size]``: one latent vector per token (DeepSeek's
  multi-head latent attention, ``head_size`` = the latent rank plus the rotary part), no K/V split and
  no heads: every tensor-parallel rank holds the same bytes.

The tensor's dtype is what torch allocated, not always what the bytes mean: vLLM keeps an fp8 KV
cache (``fp8_e4m3``, ``fp8_e5m2``) in ``uint8`` tensors. The engine says what they mean
(``kv_dtype``), and the fingerprint names both, so an e4m3 cache never loads e5m2 bytes.

A *block* of a layer is treated as opaque bytes: ``block_bytes`` of them, in the order torch's
``index_select`` along the block axis yields. Moving blocks is always one vectorized torch op per
layer — ``index_select`` into, or ``index_copy_`` out of, a contiguous staging buffer shaped
``[num_layers, num_blocks_moved, block_bytes]`` (uint8; :class:`kvbridge.staging.StagingPool` keeps
such buffers between calls) — and never a Python loop over blocks. A single run of consecutive ids
is copied as one slice; where blocks are contiguous, they move as rows of machine words
(:func:`block_words`).

A :class:`LayoutFingerprint` names everything that must agree for bytes to be meaningful on the
other side; every stored object and every handshake carries it, and :meth:`LayoutFingerprint.check`
raises :class:`~kvbridge.errors.LayoutMismatch` on any difference.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvbridge.errors import LayoutError, LayoutMismatch

BLOCKS_FIRST = "blocks_first"
KV_FIRST = "kv_first"
MLA = "mla"


@dataclasses.dataclass(frozen=True)
class LayoutFingerprint:
    """What two sides must share for a block's bytes to mean the same thing on both."""

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    block_bytes: int
    kv_format: str

    def digest(self) -> str:
        """A short, stable hex digest (sha256 of the canonical JSON form), for paths and keys."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayoutFingerprint:
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        if set(data) != set(fields):
            raise LayoutMismatch(f"fingerprint fields {sorted(data)} != expected {sorted(fields)}")
        try:
            values: dict[str, Any] = {k: (str(v) if fields[k] == "str" else int(v)) for k, v in data.items()}
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise LayoutMismatch(f"malformed layout fingerprint: {exc}") from exc

    @classmethod
    def from_json(cls, text: str | bytes) -> LayoutFingerprint:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise LayoutMismatch(f"malformed layout fingerprint: {exc}") from exc
        if not isinstance(data, dict):
            raise LayoutMismatch("malformed layout fingerprint: not an object")
        return cls.from_dict(data)

    def check(self, other: LayoutFingerprint, *, what: str = "peer") -> None:
        """Raise :class:`LayoutMismatch` naming every field where ``other`` differs."""
        if other == self:
            return
        diffs = [
            f"{f.name}: ours={getattr(self, f.name)!r} {what}={getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        raise LayoutMismatch(f"KV layout of {what} differs: " + "; ".join(diffs))


@dataclasses.dataclass(frozen=True)
class Cut:
    """Bytes ``[src, src + length)`` of each block of one producer rank are bytes ``[dst, dst + length)``
    of the same block here (:func:`reslice`)."""

    src: int
    dst: int
    length: int


def reslice(ours: LayoutFingerprint, rank: int, tp: int, their_tp: int) -> tuple[LayoutFingerprint, dict[int, Cut]]:
    """How rank ``rank`` of a ``tp``-way engine cuts its blocks out of a ``their_tp``-way engine's ranks:
    the layout those ranks must have, and for each rank that holds some of our heads, which bytes go where.

    vLLM splits KV heads evenly over tensor-parallel ranks, in order. In a heads-major block
    (``blocks_first``: ``[heads, tokens, 2 * head]``) each head's K and V are one stretch of bytes, so a
    rank's heads are one byte range of the block: a consumer with fewer ranks takes whole blocks of
    several producer ranks side by side, one with more ranks takes a part of one producer rank's
    block. MLA blocks are the same on every rank: the whole block, from rank ``rank % their_tp``.

    Refused (:class:`LayoutMismatch`), so the engine recomputes: K/V-first blocks (a head is not one
    stretch there) and head counts that do not split evenly. Heads that vLLM replicates (``tp`` above
    the model's KV heads) give a layout no producer has, so the handshake refuses them.
    """
    if ours.kv_format == MLA or tp == their_tp:
        return ours, {rank % their_tp: Cut(0, 0, ours.block_bytes)}
    if ours.kv_format.partition("+")[0] != BLOCKS_FIRST:  # (+groups: every group's layers are cut alike)
        raise LayoutMismatch(f"KV in {ours.kv_format} blocks cannot be re-sliced from tp={their_tp} to tp={tp} "
                             f"(a head is one stretch of a block only in {BLOCKS_FIRST})")
    heads = ours.num_kv_heads * tp
    if heads % their_tp:
        raise LayoutMismatch(f"{heads} KV heads ({ours.num_kv_heads} per rank x tp={tp}) do not split over tp={their_tp}")
    per, head_bytes = heads // their_tp, ours.block_bytes // ours.num_kv_heads
    theirs = dataclasses.replace(ours, num_kv_heads=per, block_bytes=per * head_bytes)
    lo, hi = rank * ours.num_kv_heads, (rank + 1) * ours.num_kv_heads  # our heads, numbered over the model
    cuts = {}
    for q in range(lo // per, (hi - 1) // per + 1):
        a, b = max(lo, q * per), min(hi, (q + 1) * per)
        cuts[q] = Cut((a - q * per) * head_bytes, (a - lo) * head_bytes, (b - a) * head_bytes)
    return theirs, cuts


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


def _pieces(block: torch.Tensor) -> tuple[tuple[int, int], ...]:
    # Peel leading axes of one block until what is left is contiguous; each index over the peeled
    # axes is then one piece, in C order (the order index_select lays a block out in staging).
    for k in range(block.dim() + 1):
        rest = block[(0,) * k] if k else block
        if rest.is_contiguous():
            break
    size = block.element_size()
    grids = np.meshgrid(*[np.arange(n) * s for n, s in zip(block.shape[:k], block.stride()[:k])], indexing="ij")
    offsets = sum((g.reshape(-1) for g in grids), np.zeros(1, dtype=np.int64)) * size
    length = int(rest.numel()) * size
    return tuple((int(o), length) for o in np.atleast_1d(offsets))


def _layers_as_one(rows: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The layers' int64 rows (:func:`block_words`) as one ``[layers, blocks, words]`` view, where each layer
    starts a fixed step of whole words after the one before (one allocation) and no two share a word;
    else ``None``."""
    if len(rows) < 2 or any(r is None for r in rows):
        return None
    first = rows[0]
    assert first is not None
    size = first.element_size()
    starts = [r.data_ptr() for r in rows if r is not None]
    step = starts[1] - starts[0]
    if step <= 0 or step % size or any(b - a != step for a, b in zip(starts, starts[1:])):
        return None
    (blocks, words), (row_step, _) = first.shape, first.stride()
    view = first.as_strided((len(rows), blocks, words), (step // size, row_step, 1))
    # distinct words for every (layer, block, word): layers one after another, or interleaved per block
    layer = step // size
    after = layer >= (blocks - 1) * row_step + words
    between = layer >= words and row_step >= (len(rows) - 1) * layer + words
    return view if after or between else None


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(view: torch.Tensor) -> torch.Tensor:
    """``view`` reinterpreted as integers of its element's width (same shape and strides)."""
    bits = _BITS[view.element_size()]
    return view if view.dtype == bits else view.view(bits)


def block_words(blocks: torch.Tensor, word: torch.dtype = torch.int64) -> torch.Tensor | None:
    """``blocks`` — ``[n, ...]``, each of the ``n`` blocks (rows) one contiguous stretch of memory — as a
    view ``[n, words]`` of ``word`` (``torch.int64`` or ``torch.int32``); ``None`` where the block size,
    alignment or strides allow no such view (``kv_first``: K and V apart), and the caller keeps its
    typed tensors.

    Why: torch's copy kernels move rows of machine words faster than 4-D tensors of 2-byte elements
    (a plain ``copy_`` and ``index_select`` with int64; on the CPU, ``index_copy_`` into rows of int32
    runs faster than into a 4-D bf16 view). Rows may have gaps between them
    (a layer viewed inside a larger allocation); they may not overlap.
    """
    size = word.itemsize
    if blocks.dim() == 0 or blocks.shape[0] == 0:
        return None
    row = blocks[0].numel() * blocks.element_size()
    if row % size or blocks.data_ptr() % size or not blocks[0].is_contiguous():
        return None
    if blocks.stride(0) * blocks.element_size() < row:
        return None
    try:
        return blocks.view(torch.uint8).view(blocks.shape[0], row).view(word)
    except RuntimeError:  # strides that no view can express
        return None


class KVLayout:
    """The registered KV cache of one engine worker, addressable block by block.

    ``layers[i]`` is a view of layer ``i`` with the block axis moved first, so that ``layers[i][b]`` is
    block ``b`` whatever the underlying format and strides. Build one with :meth:`from_tensors`.
    """

    def __init__(self, names: Sequence[str], block_views: Sequence[torch.Tensor], fingerprint: LayoutFingerprint,
                 groups: Sequence[int] = ()):
        self.layer_names = tuple(names)
        # the layers of each KV-cache group, in order (one group of every layer unless told otherwise)
        counts = list(groups) or [len(block_views)]
        starts = np.cumsum([0, *counts]).tolist()
        self.groups = tuple(range(a, b) for a, b in zip(starts, starts[1:]))
        self.layers = tuple(block_views)
        self.fingerprint = fingerprint
        first = self.layers[0]
        self.num_blocks = int(first.shape[0])
        self.block_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.device = first.device
        # its kind as a plain str, asked by every load and save: `device.type` builds a new one in libtorch
        # each time, slow when cold after a forward pass (bench cases `load`, 8 MiB)
        self.device_type: str = first.device.type
        self.block_bytes = fingerprint.block_bytes
        self.num_layers = len(self.layers)
        self._index = {name: i for i, name in enumerate(self.layer_names)}
        self._addressing: BlockAddressing | None = None
        # Where a block is one contiguous stretch of memory, move it as a row of machine words: the
        # copy kernels then see [num_blocks, words] instead of a 4-D tensor of 2-byte elements.
        self._rows = tuple(block_words(v) for v in self.layers)
        # Elsewhere (K and V apart), blocks move as integers of the element's width: a copy of bits
        # whatever the dtype means, and no dtype without copy kernels (fp8 on some builds) is refused.
        self._typed = tuple(_as_bits(v) for v in self.layers)
        # On a GPU, every layer's rows as one [layers, num_blocks, words] view where the layers lie at equal
        # steps in one allocation (vLLM's one KV tensor): a gather or scatter of all layers is then one
        # kernel, not one per layer (a launch from Python costs more than a small layer's copy). On the CPU the
        # per-layer copies are the faster ones, so they stay (bench cases `load`/`save --device cuda` and cpu).
        self._all = _layers_as_one(self._rows) if self.device_type != "cpu" else None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
        *,
        block_size: int | None = None,
        kv_dtype: str | None = None,
        groups: Sequence[int] = (),
    ) -> KVLayout:
        """Build a layout from per-layer KV tensors (in layer order), refusing what cannot be addressed.

        ``block_size``, when given, is checked against the tensors (a mismatch means the shape was
        misread and is refused rather than guessed). ``kv_dtype`` is what the engine says the bytes
        are where the tensor's dtype does not say it (``"fp8_e4m3"`` in a ``uint8`` tensor); it joins
        the fingerprint's ``dtype`` as ``uint8:fp8_e4m3``. ``groups``: how many layers each KV-cache group
        has, the tensors given group by group (vLLM's hybrid manager lets one layer of each group share
        a tensor: their blocks are told apart by id); it joins the fingerprint's ``kv_format``.
        """
        if isinstance(tensors, Mapping):
            names, views = list(tensors.keys()), list(tensors.values())
        else:
            views = list(tensors)
            names = [str(i) for i in range(len(views))]
        if not views:
            raise LayoutError("no KV tensors registered")
        first = views[0]
        for name, t in zip(names, views):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"layer {name!r}: expected a torch.Tensor, got {type(t).__name__}")
            if (t.shape, t.dtype, t.device, t.stride()) != (first.shape, first.dtype, first.device, first.stride()):
                raise LayoutError(
                    f"layer {name!r} differs from layer {names[0]!r}: "
                    f"{tuple(t.shape)}/{t.dtype}/{t.device}/{t.stride()} vs "
                    f"{tuple(first.shape)}/{first.dtype}/{first.device}/{first.stride()}"
                )
        if first.is_floating_point() is False and first.dtype not in (torch.uint8, torch.int8):
            raise LayoutError(f"unsupported KV dtype {first.dtype}")
        if first.element_size() not in _BITS:
            raise LayoutError(f"unsupported KV element size {first.element_size()} ({first.dtype})")
        if first.numel() == 0:
            raise LayoutError(f"empty KV tensor of shape {tuple(first.shape)}")
        shape = tuple(first.shape)
        if len(shape) == 5 and shape[0] == 2:
            fmt, axis = KV_FIRST, 1
            _, _, n_tok, heads, head_size = shape
        elif len(shape) == 4:
            fmt, axis = BLOCKS_FIRST, 0
            _, heads, n_tok, two_d = shape
            if two_d % 2:
                raise LayoutError(f"last axis {two_d} of {shape} is not 2*head_size (K and V side by side)")
            head_size = two_d // 2
        elif len(shape) == 3:
            fmt, axis, heads = MLA, 0, 1
            _, n_tok, head_size = shape
        else:
            raise LayoutError(
                f"cannot address KV tensors of shape {shape}: expected [num_blocks, heads, block_size, 2*head], "
                "[2, num_blocks, block_size, heads, head] or (MLA) [num_blocks, block_size, latent]"
            )
        if block_size is not None and n_tok != block_size:
            raise LayoutError(f"tensor shape {shape} ({fmt}) has block_size {n_tok}, engine says {block_size}")
        block_views = [t.movedim(axis, 0) for t in views]
        block_bytes = int(np.prod(block_views[0].shape[1:])) * first.element_size()
        if groups and (sum(groups) != len(views) or min(groups) < 1):
            raise LayoutError(f"KV-cache groups of {list(groups)} layers for {len(views)} layers")
        group_of = np.repeat(np.arange(len(groups) or 1), list(groups) or [len(views)])
        seen: dict[tuple[int, int], str] = {}
        for name, t, g in zip(names, views, group_of.tolist()):
            if (g, t.data_ptr()) in seen:
                raise LayoutError(f"layers {seen[g, t.data_ptr()]!r} and {name!r} share memory")
            seen[g, t.data_ptr()] = name
        if len(groups) > 1:
            fmt = f"{fmt}+groups:{'-'.join(map(str, groups))}"
        dtype = str(first.dtype).removeprefix("torch.")
        if kv_dtype and kv_dtype not in ("auto", dtype):
            dtype = f"{dtype}:{kv_dtype}"
        fp = LayoutFingerprint(
            dtype=dtype,
            num_layers=len(views),
            num_kv_heads=int(heads),
            head_size=int(head_size),
            block_size=int(n_tok),
            block_bytes=block_bytes,
            kv_format=fmt,
        )
        return cls(names, block_views, fp, groups)

    # ---- addressing ----------------------------------------------------------------------------
    def layer_index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise LayoutError(f"unknown layer {name!r}") from None

    def check_ids(self, block_ids: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        """Block ids as an index tensor on the KV device; out-of-range ids raise :class:`LayoutError`."""
        return torch.as_tensor(self.check_range(block_ids), device=self.device)

    def check_range(self, block_ids: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        """Block ids as an int64 array, checked like :meth:`check_ids` (numpy: a few us; a tensor of ids on a
        device is copied to the host first, which waits for that device)."""
        if isinstance(block_ids, torch.Tensor):
            block_ids = block_ids.cpu()
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if len(ids):
            self._check_bounds(int(ids.min()), int(ids.max()))
        return ids

    def check_bounds(self, block_ids: Sequence[int]) -> None:
        """:meth:`check_range` for a caller that needs no array (a store that hands the ids on as they are):
        ``min`` and ``max`` of a list of ids, no numpy: cold, after a forward pass, an array and its two
        reductions are a visible share of a small load (bench case fs `load`, 8 MiB)."""
        if isinstance(block_ids, (list, tuple)):
            if block_ids:
                self._check_bounds(int(min(block_ids)), int(max(block_ids)))
        else:
            self.check_range(block_ids)

    def _check_bounds(self, lo: int, hi: int) -> None:
        if lo < 0 or hi >= self.num_blocks:
            raise LayoutError(f"block ids outside [0, {self.num_blocks}): min={lo} max={hi}")

    def staging(self, num_blocks: int, *, layers: int | None = None, pin: bool = False) -> torch.Tensor:
        """A contiguous uint8 buffer ``[layers, num_blocks, block_bytes]`` on the KV device (or pinned host)."""
        shape = (self.num_layers if layers is None else layers, num_blocks, self.block_bytes)
        if pin and torch.cuda.is_available():
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        return torch.empty(shape, dtype=torch.uint8, device=self.device)

    def _slab(self, layer: int, buf: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # (the layer's blocks, the staging slab) as tensors of matching shape and dtype
        if buf.dtype != torch.uint8 or not buf.is_contiguous() or buf.numel() != n * self.block_bytes:
            raise LayoutError(f"staging slab must be contiguous uint8 of {n}x{self.block_bytes} bytes")
        rows = self._rows[layer]
        if rows is not None:
            return rows, buf.view(torch.int64).view(n, -1)
        return self._typed[layer], buf.view(self._typed[layer].dtype).view(n, *self.block_shape)

    def gather_layer(self, layer: int, block_ids: torch.Tensor, out: torch.Tensor, runs: list[tuple[int, int]] | None = None) -> None:
        """Copy blocks ``block_ids`` of one layer into ``out`` (uint8 ``[n, block_bytes]``), one op."""
        n = int(block_ids.numel())
        src, dst = self._slab(layer, out, n)
        if runs is not None and len(runs) == 1:
            dst.copy_(src.narrow(0, runs[0][0], n))
        else:
            torch.index_select(src, 0, block_ids, out=dst)

    def scatter_layer(self, layer: int, block_ids: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int]] | None = None) -> None:
        """Copy ``src`` (uint8 ``[n, block_bytes]``) into blocks ``block_ids`` of one layer, one op."""
        n = int(block_ids.numel())
        dst, data = self._slab(layer, src, n)
        if runs is not None and len(runs) == 1:
            dst.narrow(0, runs[0][0], n).copy_(data)
        else:
            dst.index_copy_(0, block_ids, data)

    def gather(self, block_ids: Sequence[int] | np.ndarray | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """All layers of ``block_ids`` into one staging buffer ``[num_layers, n, block_bytes]``."""
        idx = self.check_ids(block_ids)
        n = int(idx.numel())
        if out is None:
            out = self.staging(n)
        self._check_staging(out, n)
        if self._all is not None and n and out.is_contiguous():
            torch.index_select(self._all, 1, idx, out=out.view(torch.int64).view(self.num_layers, n, -1))
            return out
        runs = coalesce(idx.cpu()) if n else []
        for layer in range(self.num_layers):
            self.gather_layer(layer, idx, out[layer], runs)
        return out

    def scatter(self, block_ids: Sequence[int] | np.ndarray | torch.Tensor, src: torch.Tensor) -> None:
        """Write a staging buffer ``[num_layers, n, block_bytes]`` into blocks ``block_ids`` of every layer."""
        idx = self.check_ids(block_ids)
        n = int(idx.numel())
        self._check_staging(src, n)
        if self._all is not None and n and src.is_contiguous() and src.device == self.device:
            self._all.index_copy_(1, idx, src.view(torch.int64).view(self.num_layers, n, -1))
            return
        runs = coalesce(idx.cpu()) if n else []
        for layer in range(self.num_layers):
            self.scatter_layer(layer, idx, src[layer], runs)

    def _check_staging(self, buf: torch.Tensor, n: int) -> None:
        want = (self.num_layers, n, self.block_bytes)
        if tuple(buf.shape) != want or buf.dtype != torch.uint8:
            raise LayoutError(f"staging buffer must be uint8 {want}, got {buf.dtype} {tuple(buf.shape)}")

    def block_region(self, layer: int, start: int, count: int) -> tuple[int, int]:
        """``(address, nbytes)`` of ``count`` consecutive blocks of a layer, for zero-copy transports.

        Only defined where those blocks are one contiguous stretch of memory; otherwise
        :class:`LayoutError` (the caller then gathers through a staging buffer instead).
        """
        view = self.layers[layer]
        if not view[0].is_contiguous() or view.stride(0) != view[0].numel():
            raise LayoutError("blocks of this layout are not contiguous in memory; gather them instead")
        if start < 0 or count < 0 or start + count > self.num_blocks:
            raise LayoutError(f"blocks [{start}, {start + count}) outside [0, {self.num_blocks})")
        return view.data_ptr() + start * self.block_bytes, count * self.block_bytes

    def addressing(self) -> BlockAddressing:
        """This layout's :class:`BlockAddressing` (one-sided transports read blocks by address), made once:
        the layers never move, and its arrays are then made once too (stores address blocks per load)."""
        if self._addressing is None:
            first = self.layers[0]
            self._addressing = BlockAddressing(tuple(v.data_ptr() for v in self.layers),
                                               first.stride(0) * first.element_size(), _pieces(first[0]))
        return self._addressing

    def regions(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each distinct allocation the layers live in (vLLM: often one for all
        layers), for registering the KV with a transport once."""
        seen: dict[int, int] = {}
        for v in self.layers:
            storage = v.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sorted(seen.items())

    def __repr__(self) -> str:
        fp = self.fingerprint
        return (
            f"KVLayout({fp.num_layers} layers x {self.num_blocks} blocks x {fp.block_bytes} B, "
            f"{fp.dtype}, {fp.kv_format}, {self.device})"
        )


__all__ = ["BLOCKS_FIRST", "KV_FIRST", "MLA", "BlockAddressing", "Cut", "KVLayout", "LayoutFingerprint", "block_words", "coalesce",
           "reslice", "staged_addressing"]
