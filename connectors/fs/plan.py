"""Which way an ``fs`` load's (or save's) blocks move, decided once per operation, before any file is
opened, from the KV's layout, what the scheduler side said about the load (``BlockLoad.source``) and
what this store has (its :class:`Medium`).

A load takes one of five routes:

- ``NATIVE``: a KV the host addresses: each block read by address straight into its block of the KV, its
  crc32c taken as it lands, every block of the load in one call on the native threads (no Python object
  per block);
- ``NATIVE_STAGED``: a KV the host cannot address (a GPU's): the same into pinned staging, then copied up
  once and scattered on the device;
- ``IN_PLACE``: Python threads ``preadv`` each block straight into its block of the KV (a view per
  layer) and check it there (no native module, or objects it cannot check);
- ``BUFFERED``: each block read into a thread's buffer and checked there, then put into the KV, or into
  staging scattered once (``O_DIRECT``'s aligned buffers; a KV without a view per block and no native
  module);
- ``RESLICED``: objects another TP size saved: this rank's heads cut out of each shard that holds some
  into staging, then scattered.

The native routes check crc32c only; a load that meets an object of another checksum kind (written by
an engine configured ``checksum="crc32"``) takes the plan's ``fallback`` route instead. A save takes
one of the first four (``BUFFERED`` being: gathered into staging, written from there).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, NamedTuple

from kvbridge.connectors.fs.options import FsLoad

from kvbridge import codec
from kvbridge.layout import KVLayout


class Route(enum.Enum):
    NATIVE = "native"
    NATIVE_STAGED = "native-staged"
    IN_PLACE = "in-place"
    BUFFERED = "buffered"
    RESLICED = "resliced"


class Medium(NamedTuple):
    """What a store moves blocks with: the native module (``file_start`` and crc32c) or not, ``O_DIRECT``
    or the page cache, and the checksum kind it writes."""

    native: bool
    direct: bool
    kind: int


class ReadPlan(NamedTuple):
    """How one load moves its blocks: ``route``, or ``fallback`` for objects the native routes cannot
    check; ``tp``: the TP size whose shards a ``RESLICED`` load reads (else this engine's)."""

    route: Route
    fallback: Route
    tp: int

    def route_for(self, kinds: Iterable[int]) -> Route:
        """The route for objects of checksum ``kinds`` (those a load located)."""
        if self.route in (Route.NATIVE, Route.NATIVE_STAGED) and any(k != codec.CRC32C for k in kinds):
            return self.fallback
        return self.route


def host_addressable(layout: KVLayout) -> bool:
    """Whether the native routes reach ``layout``'s blocks by address (a KV in host memory), rather than
    through pinned staging (a GPU's)."""
    return layout.device_type == "cpu"


def _native(layout: KVLayout, medium: Medium) -> Route | None:
    if medium.native and not medium.direct and medium.kind == codec.CRC32C and layout.device_type in ("cpu", "cuda"):
        return Route.NATIVE if host_addressable(layout) else Route.NATIVE_STAGED
    return None


def choose_save(layout: KVLayout, medium: Medium, *, views: bool) -> Route:
    """The route of a save from ``layout`` (``views``: it has a view per block, :class:`~.kv.Blocks`):
    native where it can, else straight from the KV's views (through an aligned buffer per block under
    ``O_DIRECT``), else gathered into staging (``BUFFERED``)."""
    native = _native(layout, medium)
    if native is not None:
        return native
    return Route.IN_PLACE if views else Route.BUFFERED


def choose_read(layout: KVLayout, source: Any, medium: Medium, *, tp: int, views: bool) -> ReadPlan:
    """The plan of a load into ``layout`` whose ``BlockLoad.source`` is ``source``, by a store of this
    engine's ``tp`` (``views``: the KV has a view per block, :class:`~.kv.Blocks`)."""
    python = Route.IN_PLACE if views and not medium.direct else Route.BUFFERED
    if isinstance(source, FsLoad) and source.tp != tp:
        return ReadPlan(Route.RESLICED, Route.RESLICED, source.tp)
    return ReadPlan(_native(layout, medium) or python, python, tp)
