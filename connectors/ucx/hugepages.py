"""Backing a CPU KV cache with huge pages, so a one-sided ``cma`` read walks 512 times fewer pages.

``process_vm_readv`` pins every page it touches on both sides. torch allocates a CPU KV cache in 4 KiB
pages (unless ``THP_MEM_ALLOC_ENABLE=1`` was set when the process started), numpy in 2 MiB ones, and the same scattered
read is markedly slower between torch tensors than with both KVs on huge pages (``kvbridge.bench.ucx_baselines``). So a ucx worker asks the kernel, once at registration, to back its KV
with transparent huge pages: ``MADV_HUGEPAGE`` (future faults) and ``MADV_COLLAPSE`` (Linux 6.1+: the pages
already there, copied once, now). The contents stay as they are. Where the kernel refuses (older
kernel, THP ``never``, not Linux) nothing changes and it is said once at info level. Option ``huge_pages``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

from kvbridge.layout import KVLayout

log = logging.getLogger(__name__)

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <asm-generic/mman-common.h>
HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size


def _madvise(libc: ctypes.CDLL, start: int, length: int, advice: int) -> int:
    """0, or the errno of ``madvise``."""
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0:
        return 0
    return ctypes.get_errno()


def back_with_huge_pages(layout: KVLayout) -> int:
    """Advise and collapse the 2 MiB-aligned part of each of ``layout``'s CPU regions; the bytes now
    backed by huge pages (0 when the kernel refused, or the KV is not in host memory)."""
    if layout.device_type != "cpu" or not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    done = 0
    for address, nbytes in layout.regions():
        start, end = -(-address // HUGE) * HUGE, (address + nbytes) // HUGE * HUGE  # whole huge pages inside
        if end <= start:
            continue
        for advice, name in ((MADV_HUGEPAGE, "MADV_HUGEPAGE"), (MADV_COLLAPSE, "MADV_COLLAPSE")):
            err = _madvise(libc, start, end - start, advice)
            if err:
                log.info("KV stays on small pages: %s refused (%s); cma reads walk 4 KiB pages", name, os.strerror(err))
                return done
        done += end - start
    return done


__all__ = ["back_with_huge_pages"]
