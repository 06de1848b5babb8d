"""What a load or a save holds of one object while it works on it."""

from __future__ import annotations

import dataclasses

from kvbridge import codec


@dataclasses.dataclass
class Located:
    """Blocks ``first .. first+count-1`` of an open object, for blocks ``at ..`` of a load."""

    path: str
    fd: int
    chunk: codec.Chunk
    first: int
    count: int
    at: int


@dataclasses.dataclass
class Written:
    """An object a save writes: its chunk's keys (``head`` of them read back from ``source``), its blocks
    from the op (``lo .. hi-1``), and its temporary file."""

    keys: tuple[bytes, ...]
    head: int
    lo: int
    hi: int
    path: str
    source: Located | None = None
    tmp: str = ""
    fd: int = -1
    header: int = 0
    sums: list[int] = dataclasses.field(default_factory=list)
    error: BaseException | None = None
