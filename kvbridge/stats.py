"""Counters every backend keeps: what moved, how fast, what failed. Cheap to update, merged across ranks."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any


@dataclasses.dataclass
class TransferStats:
    """Monotonic counters (reset only by :meth:`take`). ``*_seconds`` sum the wall time of operations."""

    loads: int = 0
    load_blocks: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    load_failures: int = 0
    failed_blocks: int = 0
    saves: int = 0
    save_blocks: int = 0
    save_bytes: int = 0
    save_seconds: float = 0.0
    save_failures: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def take(self) -> dict[str, Any]:
        """The counters so far, and reset them (for per-interval reporting such as vLLM's)."""
        with self._lock:
            out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            for f in dataclasses.fields(self):
                setattr(self, f.name, type(out[f.name])())
            return out

    @staticmethod
    def merge(*parts: dict[str, Any]) -> dict[str, Any]:
        total: dict[str, Any] = {}
        for part in parts:
            for k, v in part.items():
                total[k] = total.get(k, 0) + v
        return total


__all__ = ["TransferStats"]
