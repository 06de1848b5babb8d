"""The cpu tier's options, stats, slot sizing, and the plan payload both sides share (:class:`CpuSlots`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from kvbridge.contract import EngineInfo
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.options import require
from kvbridge.stats import TransferStats


@dataclasses.dataclass(frozen=True)
class CpuOptions:
    """``capacity_bytes``: size of the host pool (required). ``block_bytes``: bytes of one block across
    all layers of a rank, for when the engine does not report it (0: take it from the engine)."""

    capacity_bytes: int
    block_bytes: int = 0
    eviction: Literal["lru", "fifo"] = "lru"
    layerwise: bool = False  # load inside the step, layer by layer, while the forward pass runs (see the module)

    def __post_init__(self) -> None:
        require(self.capacity_bytes > 0, f"cpu: capacity_bytes must be positive, got {self.capacity_bytes}")
        require(self.block_bytes >= 0, f"cpu: block_bytes must be >= 0, got {self.block_bytes}")


@dataclasses.dataclass
class CpuStats(TransferStats):
    """:class:`TransferStats` plus the saves skipped because every slot was pinned."""

    skipped_saves: int = 0


def declared_slot_bytes(engine: EngineInfo, options: CpuOptions) -> int:
    """The slot size both sides can know before any KV exists; 0 when nobody said."""
    from_engine = int(getattr(engine, "block_bytes", 0) or 0)  # optional EngineInfo field
    if from_engine and options.block_bytes and from_engine != options.block_bytes:
        raise ConfigError(f"cpu: option block_bytes={options.block_bytes} but the engine reports {from_engine}")
    return from_engine or options.block_bytes


def slot_count(capacity_bytes: int, slot_bytes: int) -> int:
    slots = capacity_bytes // slot_bytes
    require(slots > 0, f"cpu: capacity_bytes={capacity_bytes} holds no block of {slot_bytes} bytes")
    return slots


@dataclasses.dataclass(frozen=True)
class CpuSlots:
    """The cpu tier's plan payload (``BlockLoad.source`` / ``BlockSave.target``): a slot per block,
    -1 for a block gone from the index since lookup (the worker reports it failed)."""

    slots: tuple[int, ...]


def slots_of(payload: Any, n: int) -> list[int]:
    if not isinstance(payload, CpuSlots) or len(payload.slots) != n:
        raise KVBridgeError(f"cpu: the plan names no slot for each of its {n} blocks ({payload!r})")
    return list(payload.slots)

