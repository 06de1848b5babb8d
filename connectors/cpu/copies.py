"""The cpu tier's torch copies between the KV and the slot pool: a KV on a GPU (a DMA per run of slots) or no
native module (``index_select``/``index_copy_``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvbridge.errors import LayoutError
from kvbridge.layout import BlockAddressing, KVLayout, block_words, coalesce


def slot_major(pool: torch.Tensor) -> torch.Tensor:
    """The pool's storage, ``[slots, layers, block_bytes]`` (contiguous: a run of slots is one stretch)."""
    return pool.permute(1, 0, 2)


def slot_addressing(pool: torch.Tensor, kv: BlockAddressing) -> BlockAddressing:
    """Where each slot of ``pool`` (``[layers, slots, block_bytes]``) keeps a block: per layer, the KV
    block's pieces one after another, in the order :meth:`KVLayout.gather` yields them."""
    lengths = [n for _, n in kv.pieces]
    offsets = np.cumsum([0, *lengths[:-1]]).tolist()
    return BlockAddressing(tuple(int(pool[i].data_ptr()) for i in range(pool.shape[0])), pool.stride(1),
                           tuple(zip(offsets, lengths)))


def int32_rows(blocks: torch.Tensor) -> torch.Tensor:
    # a freshly selected or gathered (contiguous) [n, ...] stretch of blocks, as the int32 rows of _words
    rows = block_words(blocks, torch.int32)
    if rows is None:
        raise LayoutError(f"cpu: blocks {tuple(blocks.shape)} of {blocks.dtype} are not rows of int32 words")
    return rows


def dma(pool: torch.Tensor, slot_runs: list[tuple[int, int]]) -> bool:
    """Whether slots move by a DMA per run: a pinned pool (the KV is on a GPU), not too fragmented."""
    return pool.is_pinned() and len(slot_runs) <= MAX_RUNS


def runs_down(rows: torch.Tensor, storage: torch.Tensor, slot_runs: list[tuple[int, int]]) -> None:
    """``rows`` (``[n, layers, block_bytes]`` on the device, in slot order) into the pinned storage's slot runs:
    a DMA per run, on the current stream (:func:`runs_up`'s other way)."""
    at = 0
    for start, n in slot_runs:
        storage[start : start + n].copy_(rows[at : at + n], non_blocking=True)
        at += n


def runs_up(storage: torch.Tensor, slot_runs: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Slots (runs of the pinned ``[slots, layers, block_bytes]`` storage) on the device, in slot order: a
    DMA per run, on the current stream."""
    out = torch.empty((sum(n for _, n in slot_runs), *storage.shape[1:]), dtype=torch.uint8, device=device)
    at = 0
    for start, n in slot_runs:
        out[at : at + n].copy_(storage[start : start + n], non_blocking=True)
        at += n
    return out


def copy_in(pool: torch.Tensor, slots: list[int], block_ids: Sequence[int], layout: KVLayout) -> None:
    ids = layout.check_ids(block_ids)
    slot_runs = coalesce(slots)
    if dma(pool, slot_runs):
        up = runs_up(slot_major(pool), slot_runs, layout.device)  # up run by run, then scattered on the device
        layout.scatter(block_ids, up.transpose(0, 1).contiguous())
        sync(layout)
        return
    if len(slot_runs) == 1:  # consecutive slots: each layer's source is one contiguous slice
        src = pool[:, slot_runs[0][0] : slot_runs[0][0] + len(slots)]
    else:
        src = pool.index_select(1, torch.as_tensor(slots))
    if layout.device_type != "cpu":
        src = src.to(layout.device, non_blocking=pool.is_pinned())
    runs = coalesce(block_ids)
    for layer in range(layout.num_layers):  # (a slot run's rows of a layer lie a slot apart: made one stretch)
        layout.scatter_layer(layer, ids, src[layer].contiguous(), runs)
    sync(layout)


# From here a load's copy into the KV uses streaming stores too: a copy this large cannot stay in a server CPU's
# last-level cache anyway, so skipping the read-for-ownership only gains (``kvbridge bench --backends cpu --ops
# load``, its 32 MiB rows and up).
STREAM_LOAD_BYTES = 32 << 20

# A KV on a GPU: a request whose slots fall in more runs than this goes through the host (index_select or
# index_copy_, then one copy), not a DMA per run (each is a Python call to issue; a request of
# 1024 tokens has 64 blocks, so it always takes the DMAs).
MAX_RUNS = 64


def sync(layout: KVLayout) -> None:
    # loads must be in the KV before they are reported, saves out of it before finish_step returns
    if layout.device_type == "cuda":
        torch.cuda.current_stream(layout.device).synchronize()  # inside a load: the load stream

