"""Plain values of the metadata plane, shared by its server, its client and the backends that use them.

These are what the gRPC messages (``proto/kvbridge/v1``) carry, as Python dataclasses: backends
never touch protobuf objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kvbridge.layout import LayoutFingerprint

PROTOCOL_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PeerInfo:
    """Who an engine worker is and how to reach its KV: sent both ways in a handshake.

    ``transport`` holds transport addresses by name, e.g. ``{"ucx_worker_address": b"...",
    "ucx_listener": b"127.0.0.1:13337"}`` (opaque bytes; the backend that wrote them reads them).
    """

    engine_id: str
    rank: int
    fingerprint: LayoutFingerprint
    transport: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
    protocol_version: int = PROTOCOL_VERSION


@dataclasses.dataclass(frozen=True)
class DirectoryEntry:
    """Part of a directory answer: ``holder`` holds the first ``num_blocks`` of the asked hashes."""

    holder: str  # engine id or tier name
    num_blocks: int
    address: str = ""  # where to reach the holder (its metadata address), if it published one


__all__ = ["PROTOCOL_VERSION", "DirectoryEntry", "PeerInfo"]
