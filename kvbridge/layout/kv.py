""":class:`KVLayout`: one engine worker's registered KV cache, built from its tensors, and moving blocks in
and out of it (see :mod:`kvbridge.layout` for the shapes it understands)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvbridge.errors import LayoutError
from kvbridge.layout.addressing import BlockAddressing, coalesce
from kvbridge.layout.fingerprint import BLOCKS_FIRST, KV_FIRST, MLA, LayoutFingerprint
from kvbridge.layout.words import BITS, as_bits, block_words, layers_as_one


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
        self._typed = tuple(as_bits(v) for v in self.layers)
        # On a GPU, every layer's rows as one [layers, num_blocks, words] view where the layers lie at equal
        # steps in one allocation (vLLM's one KV tensor): a gather or scatter of all layers is then one
        # kernel, not one per layer (a launch from Python costs more than a small layer's copy). On the CPU the
        # per-layer copies are the faster ones, so they stay (bench cases `load`/`save --device cuda` and cpu).
        self._all = layers_as_one(self._rows) if self.device_type != "cpu" else None

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
        if first.element_size() not in BITS:
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


__all__ = ["KVLayout"]
