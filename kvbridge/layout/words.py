"""Blocks as rows of machine words (:func:`block_words`): what torch's copy kernels move fastest, whatever
the KV's dtype means."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def layers_as_one(rows: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
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


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(view: torch.Tensor) -> torch.Tensor:
    """``view`` reinterpreted as integers of its element's width (same shape and strides)."""
    bits = BITS[view.element_size()]
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


__all__ = ["BITS", "as_bits", "block_words", "layers_as_one"]
