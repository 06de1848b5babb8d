"""Staging buffers kept between transfers: :class:`StagingPool`.

A store that cannot move blocks straight between the KV cache and its medium goes through a staging
buffer ``[num_layers, n, block_bytes]`` (uint8, the layout of :meth:`KVLayout.gather`): ``fs`` reads
files into one, ``lmcache`` copies LMCache objects through one. A fresh buffer costs more than the
copy it serves — the kernel faults its pages in on first touch (and pinning, beside a GPU, costs a
``cudaHostAlloc``; a transport would also pay a memory registration) — so buffers are kept:

- :meth:`StagingPool.take` hands out a buffer no one else holds until :meth:`~StagingPool.give`
  returns it (or :meth:`~StagingPool.lend`, which does both); any thread may take and give. A buffer
  never given back (a transport that may still read it after a timeout) is simply not reused.
- Buffers are flat allocations, handed out as the contiguous first ``num_layers * n * block_bytes``
  bytes of one at least that large; a request larger than every free buffer replaces the largest
  of them with one of twice its size or the request's, whichever is larger (within the limit), so
  steady traffic settles on one buffer per concurrent user. Fresh buffers that may be kept are
  written once (zeroed), so their pages fault in now rather than inside a copy.
- At most ``limit_bytes`` are kept while free; a request larger than that is allocated for the call
  (the kept buffers stay), and a buffer that would push the pool over it is freed when given back.
- ``where="host"`` (the default): host memory, pinned when the KV lives on a GPU (so the copy to the
  device is a DMA); ``where="kv"``: on the KV's own device (a transport staging beside the KV).

``fs`` and ``lmcache`` each keep one host pool per store. The ucx backend still has its own pool
(KV-device buffers, a count kept per size); it can become ``StagingPool(where="kv", limit_bytes=...)``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Literal

import torch

from kvbridge.layout import KVLayout

STAGING_LIMIT = 512 << 20  # bytes kept while free, per pool


class StagingPool:
    """Staging buffers ``[num_layers, n, block_bytes]`` reused across calls. See the module docstring."""

    def __init__(self, *, where: Literal["host", "kv"] = "host", limit_bytes: int = STAGING_LIMIT):
        self.where = where
        self.limit_bytes = limit_bytes
        self._free: list[torch.Tensor] = []  # flat uint8 allocations, not handed out
        # data pointer -> allocation handed out; weak: a buffer never given back is freed with its last view
        self._out: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        """Bytes held in free buffers (at most ``limit_bytes``)."""
        with self._lock:
            return sum(b.numel() for b in self._free)

    def _placement(self, layout: KVLayout) -> tuple[torch.device, bool]:
        if self.where == "kv":
            return layout.device, False
        return torch.device("cpu"), layout.device_type == "cuda" and torch.cuda.is_available()

    def take(self, layout: KVLayout, n: int) -> torch.Tensor:
        """A contiguous uint8 ``[num_layers, n, block_bytes]`` buffer for ``layout``, yours until :meth:`give`."""
        need = layout.num_layers * n * layout.block_bytes
        device, pin = self._placement(layout)
        if not need:
            return torch.empty((layout.num_layers, n, layout.block_bytes), dtype=torch.uint8, device=device)
        grow = 0
        buf = None
        with self._lock:
            fits = [b for b in self._free if b.numel() >= need and b.device == device and b.is_pinned() == pin]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                self._free.remove(buf)
            elif self._free and need <= self.limit_bytes:  # too small: replace the largest with a larger one
                old = max(self._free, key=lambda b: b.numel())
                self._free.remove(old)
                grow = 2 * old.numel()
        if buf is None:
            size = max(need, grow) if max(need, grow) <= self.limit_bytes else need
            buf = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin)
            if size <= self.limit_bytes and not pin:
                buf.zero_()  # fault every page in now, once: a first touch during a copy costs more than the copy
        with self._lock:
            self._out[buf.data_ptr()] = buf
        return buf[:need].view(layout.num_layers, n, layout.block_bytes)

    def give(self, staging: torch.Tensor) -> None:
        """Return a buffer :meth:`take` handed out; it is kept while the pool stays under ``limit_bytes``."""
        with self._lock:
            buf = self._out.pop(staging.data_ptr(), None)
            if buf is None:
                return
            if buf.numel() + sum(b.numel() for b in self._free) <= self.limit_bytes:
                self._free.append(buf)

    @contextlib.contextmanager
    def lend(self, layout: KVLayout, n: int) -> Iterator[torch.Tensor]:
        """:meth:`take` for the duration of a ``with`` block, then :meth:`give`."""
        staging = self.take(layout, n)
        try:
            yield staging
        finally:
            self.give(staging)

    @contextlib.contextmanager
    def gathered(self, layout: KVLayout, block_ids: Sequence[int]) -> Iterator[torch.Tensor]:
        """:meth:`lend` a buffer holding blocks ``block_ids`` of every layer (:meth:`KVLayout.gather`):
        gathered straight into it where it lives beside the KV, else gathered on the KV's device and
        copied over once (into pinned memory, beside a GPU)."""
        with self.lend(layout, len(block_ids)) as staging:
            if staging.device == layout.device:
                layout.gather(block_ids, out=staging)
            else:
                staging.copy_(layout.gather(block_ids))
            yield staging

    def clear(self) -> None:
        """Free every kept buffer (those handed out are freed when given back)."""
        with self._lock:
            self._free.clear()
            self._out.clear()


__all__ = ["STAGING_LIMIT", "StagingPool"]
