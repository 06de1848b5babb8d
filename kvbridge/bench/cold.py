"""Every timed call of the bench starts with the CPU's caches cold, as a transfer in an engine does.

In a serving engine a forward pass runs between two transfers and streams far more than the
last-level cache through it, so a load or save never finds its bytes cached. A bench that repeats
the same copy back to back keeps them there: at 8 MiB a copy's source and destination both fit in a
server's last-level cache, a warm copy runs several times faster than one from memory, and the "raw
medium" that ratios were taken against would be the cache, not the memory a store moves through.

So every timed call of the bench, ours, the baselines' and the peers', is preceded by :func:`evict`.
It is untimed, and it reads and rewrites a buffer of twice the last-level cache. Only numpy is used
here, so that the peer bench's child processes (which do not import torch) evict the same way.
``kvbridge bench --warm`` sets :data:`WARM_ENV` (children inherit it) and nothing is evicted: the
bench's figures before 2026-12-04, timed back to back.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

WARM_ENV = "KVBRIDGE_BENCH_WARM"  # set (to 1): evict() does nothing
_FALLBACK_BYTES = 32 << 20  # a last-level cache when the machine does not say
_scratch: np.ndarray | None = None


def llc_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache this machine reports (Linux sysfs ``index*/size``: ``"32768K"``), else 32 MiB."""
    sizes = []
    for size in root.glob("index*/size"):
        text = size.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=_FALLBACK_BYTES)


def evicting() -> bool:
    """Whether :func:`evict` evicts in this process (not under ``--warm``): what a record's ``cold`` says."""
    return not os.environ.get(WARM_ENV)


def evict() -> None:
    """Push every line of the CPU's caches out to memory: read and rewrite a buffer of twice the largest cache
    (64 MiB to 1 GiB), allocated once. ``+=`` reads each line before writing it back, unlike ``fill``, whose
    large stores may bypass the cache and leave it as it was."""
    global _scratch
    if not evicting():
        return
    if _scratch is None:
        _scratch = np.zeros(min(max(2 * llc_bytes(), 64 << 20), 1 << 30), np.uint8)
    _scratch += 1
