"""Numpy views of the blocks of a KV cache the host can address block by block."""

from __future__ import annotations

import numpy as np
import torch

from kvbridge.layout import KVLayout, block_words


class Blocks:
    """Numpy byte views of a CPU KV cache whose blocks are each one contiguous stretch per layer: block
    ``b`` of layer ``l`` is ``rows[l][b]``; where the layers are evenly spaced in memory (one allocation,
    as vLLM's), ``slab[:, b]`` is block ``b`` of every layer, so a block lands in one copy. (numpy, not
    torch: torch's copy may fan out to its own threads, which on a loaded machine costs more than it
    brings; numpy's releases the GIL and stays on the calling thread.)"""

    def __init__(self, rows: list[np.ndarray]):
        self.rows = rows
        self.slab: np.ndarray | None = None
        ptrs = [r.__array_interface__["data"][0] for r in rows]
        step = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
        if step and all(p == ptrs[0] + i * step for i, p in enumerate(ptrs)):
            shape = (len(rows), rows[0].shape[0], rows[0].shape[1])
            self.slab = np.lib.stride_tricks.as_strided(rows[0], shape, (step, *rows[0].strides), writeable=True)

    @classmethod
    def of(cls, layout: KVLayout) -> Blocks | None:
        """The views of ``layout``, or ``None`` where it must go through staging (a GPU, ``kv_first``)."""
        if layout.device_type != "cpu":
            return None
        rows = [block_words(v, torch.uint8) for v in layout.layers]
        if any(r is None for r in rows):
            return None
        return cls([r.numpy() for r in rows if r is not None])

    def parts(self, block: int) -> list[np.ndarray]:
        return [r[block] for r in self.rows]

    def put(self, block: int, data: np.ndarray) -> None:
        """Write ``data`` (``[num_layers, block_bytes]``) into block ``block`` of every layer."""
        if self.slab is not None:
            self.slab[:, block] = data
        else:
            for layer, row in enumerate(self.rows):
                row[block] = data[layer]
