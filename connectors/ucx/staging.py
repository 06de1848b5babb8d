"""Staging buffers of the two-sided path: a producer gathers chunks into them, a consumer receives into
them (never into the KV) and scatters only complete chunks.

Kept for reuse (:class:`StagingPool`), viewed per chunk (:func:`chunk`), and kept alive after an abandoned
receive (:func:`bury`): UCX may still write a buffer whose receive was cancelled.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import torch

from kvbridge.layout import KVLayout

_GRAVEYARD_BYTES = 512 << 20  # staging buffers of abandoned receives kept alive (UCX may still write them)


def chunk(buf: torch.Tensor, layout: KVLayout, n: int) -> torch.Tensor:
    """The first ``n`` blocks' worth of a staging buffer, as a contiguous ``[layers, n, block_bytes]``."""
    return buf.view(-1)[: layout.num_layers * n * layout.block_bytes].view(layout.num_layers, n, layout.block_bytes)


class StagingPool:
    """Staging buffers kept for reuse. Fresh memory costs UCX a registration (and the kernel page faults) on
    every transfer, which costs more than the copy itself (bench case ucx `transfer`, lane two-sided)."""

    def __init__(self, layout: KVLayout, keep: int):
        self.layout, self.keep = layout, keep
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def take(self, blocks: int) -> torch.Tensor:
        with self._lock:
            free = self._free[blocks]
            if free:
                return free.pop()
        return self.layout.staging(blocks)

    def give(self, bufs: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for buf in bufs:
                free = self._free[int(buf.shape[1])]
                if len(free) < self.keep:
                    free.append(buf)


def sync(t: torch.Tensor) -> None:
    """Wait for a queued GPU gather/scatter into ``t``: UCX must see finished bytes."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


_GRAVEYARD: collections.deque[torch.Tensor] = collections.deque()
_GRAVEYARD_LOCK = threading.Lock()


def bury(buffers: Sequence[torch.Tensor]) -> None:
    """Keep the staging buffers of abandoned receives alive: a cancelled UCX receive should write
    nothing more, but freed memory that it did write would corrupt whatever is allocated there next."""
    with _GRAVEYARD_LOCK:
        _GRAVEYARD.extend(buffers)
        total = sum(b.numel() for b in _GRAVEYARD)
        while total > _GRAVEYARD_BYTES and len(_GRAVEYARD) > len(buffers):
            total -= _GRAVEYARD.popleft().numel()


__all__ = ["StagingPool", "bury", "chunk", "sync"]
