"""The native module's part in ``fs``: blocks moved between the KV (or a staging buffer) and files by
address on its threads, each block's crc32c taken as it moves (``file_start``).

:func:`module` is the one place ``fs`` obtains that module; everything else takes it from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from kvbridge import checksums
from kvbridge.layout import BlockAddressing, KVLayout


def module() -> ModuleType | None:
    """The native module with ``file_start`` and crc32c, or ``None`` where it is not built or not here."""
    return checksums.native_crc32c()


def start_move(mod: ModuleType, layout: KVLayout, block_ids: Sequence[int], runs: Sequence[tuple[int, int, int]], *,
               write: bool, addressing: BlockAddressing | None = None) -> Any:  # fmt: skip
    """``block_ids`` of the KV read from (or written to) ``runs`` of consecutive blocks in files, each
    ``(fd, offset of its first block, blocks)``, started in one ``file_start`` on the native threads
    (its ``checked()`` waits and gives each block's crc32c, how many moved whole, and an errno). A run
    holds its blocks' pieces back to back, in :meth:`~kvbridge.layout.BlockAddressing.by_block`'s order:
    ``file_start`` places each piece in its file from that. ``addressing``: where the blocks are, when
    not in the KV (a staging buffer: :func:`~kvbridge.layout.staged_addressing`)."""
    where = addressing or layout.addressing()
    starts, lengths = where.first_block()  # file_start makes every block's pieces from block 0's (no numpy here)
    payload = layout.num_layers * layout.block_bytes
    return mod.file_start(runs, starts, lengths, len(lengths), write=write, cut_bytes=2 * payload,
                          block_ids=block_ids, block_stride=where.block_stride)  # fmt: skip


def move(mod: ModuleType, layout: KVLayout, block_ids: Sequence[int], runs: Sequence[tuple[int, int, int]], *,
         write: bool, addressing: BlockAddressing | None = None) -> tuple[np.ndarray, int, int]:  # fmt: skip
    """:func:`start_move`, waited for: each block's crc32c (``uint32``), how many from the first moved
    whole, and the errno of a failure."""
    sums, whole, err = start_move(mod, layout, block_ids, runs, write=write, addressing=addressing).checked()
    return np.frombuffer(sums, "<u4"), whole, err
