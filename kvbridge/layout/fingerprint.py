"""What must agree for KV bytes to mean the same on both sides (:class:`LayoutFingerprint`), and how a rank
cuts its blocks out of another tensor-parallel size's (:func:`reslice`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvbridge.errors import LayoutMismatch

BLOCKS_FIRST = "blocks_first"
KV_FIRST = "kv_first"
MLA = "mla"


@dataclasses.dataclass(frozen=True)
class LayoutFingerprint:
    """What two sides must share for a block's bytes to mean the same thing on both."""

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    block_bytes: int
    kv_format: str

    def digest(self) -> str:
        """A short, stable hex digest (sha256 of the canonical JSON form), for paths and keys."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayoutFingerprint:
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        if set(data) != set(fields):
            raise LayoutMismatch(f"fingerprint fields {sorted(data)} != expected {sorted(fields)}")
        try:
            values: dict[str, Any] = {k: (str(v) if fields[k] == "str" else int(v)) for k, v in data.items()}
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise LayoutMismatch(f"malformed layout fingerprint: {exc}") from exc

    @classmethod
    def from_json(cls, text: str | bytes) -> LayoutFingerprint:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise LayoutMismatch(f"malformed layout fingerprint: {exc}") from exc
        if not isinstance(data, dict):
            raise LayoutMismatch("malformed layout fingerprint: not an object")
        return cls.from_dict(data)

    def check(self, other: LayoutFingerprint, *, what: str = "peer") -> None:
        """Raise :class:`LayoutMismatch` naming every field where ``other`` differs."""
        if other == self:
            return
        diffs = [
            f"{f.name}: ours={getattr(self, f.name)!r} {what}={getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        raise LayoutMismatch(f"KV layout of {what} differs: " + "; ".join(diffs))


@dataclasses.dataclass(frozen=True)
class Cut:
    """Bytes ``[src, src + length)`` of each block of one producer rank are bytes ``[dst, dst + length)``
    of the same block here (:func:`reslice`)."""

    src: int
    dst: int
    length: int


def reslice(ours: LayoutFingerprint, rank: int, tp: int, their_tp: int) -> tuple[LayoutFingerprint, dict[int, Cut]]:
    """How rank ``rank`` of a ``tp``-way engine cuts its blocks out of a ``their_tp``-way engine's ranks:
    the layout those ranks must have, and for each rank that holds some of our heads, which bytes go where.

    vLLM splits KV heads evenly over tensor-parallel ranks, in order. In a heads-major block
    (``blocks_first``: ``[heads, tokens, 2 * head]``) each head's K and V are one stretch of bytes, so a
    rank's heads are one byte range of the block: a consumer with fewer ranks takes whole blocks of
    several producer ranks side by side, one with more ranks takes a part of one producer rank's
    block. MLA blocks are the same on every rank: the whole block, from rank ``rank % their_tp``.

    Refused (:class:`LayoutMismatch`), so the engine recomputes: K/V-first blocks (a head is not one
    stretch there) and head counts that do not split evenly. Heads that vLLM replicates (``tp`` above
    the model's KV heads) give a layout no producer has, so the handshake refuses them.
    """
    if ours.kv_format == MLA or tp == their_tp:
        return ours, {rank % their_tp: Cut(0, 0, ours.block_bytes)}
    if ours.kv_format.partition("+")[0] != BLOCKS_FIRST:  # (+groups: every group's layers are cut alike)
        raise LayoutMismatch(f"KV in {ours.kv_format} blocks cannot be re-sliced from tp={their_tp} to tp={tp} "
                             f"(a head is one stretch of a block only in {BLOCKS_FIRST})")
    heads = ours.num_kv_heads * tp
    if heads % their_tp:
        raise LayoutMismatch(f"{heads} KV heads ({ours.num_kv_heads} per rank x tp={tp}) do not split over tp={their_tp}")
    per, head_bytes = heads // their_tp, ours.block_bytes // ours.num_kv_heads
    theirs = dataclasses.replace(ours, num_kv_heads=per, block_bytes=per * head_bytes)
    lo, hi = rank * ours.num_kv_heads, (rank + 1) * ours.num_kv_heads  # our heads, numbered over the model
    cuts = {}
    for q in range(lo // per, (hi - 1) // per + 1):
        a, b = max(lo, q * per), min(hi, (q + 1) * per)
        cuts[q] = Cut((a - q * per) * head_bytes, (a - lo) * head_bytes, (b - a) * head_bytes)
    return theirs, cuts


__all__ = ["BLOCKS_FIRST", "KV_FIRST", "MLA", "Cut", "LayoutFingerprint", "reslice"]
