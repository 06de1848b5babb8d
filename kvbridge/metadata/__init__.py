"""The gRPC metadata plane: handshake, release, directory, health.

- :class:`MetadataServer` (:mod:`.server`) — embedded in an engine's connector, or standalone as
  ``kvbridge metadata-server``; :class:`MetadataClient` (:mod:`.client`) — plain values in and out,
  kvbridge exceptions only.
- :class:`Directory` (:mod:`.directory`) — which holder holds which block hashes, under leases.
- :mod:`.types` — the plain values (``PeerInfo``, ``DirectoryEntry``, ``PROTOCOL_VERSION``);
  :mod:`.wire` — limits, TLS settings (:class:`ServerTLS`, :class:`ClientTLS`), conversions, status codes.
- The protocol itself: ``proto/kvbridge/v1/metadata.proto``; its stubs are regenerated (or checked,
  ``--check``) by ``python -m kvbridge.metadata.codegen``.

Names resolve lazily: importing :mod:`kvbridge.metadata.types` does not import gRPC.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MetadataServer": "kvbridge.metadata.server",
    "MetadataClient": "kvbridge.metadata.client",
    "Directory": "kvbridge.metadata.directory",
    "ServerTLS": "kvbridge.metadata.wire",
    "ClientTLS": "kvbridge.metadata.wire",
    "PeerInfo": "kvbridge.metadata.types",
    "DirectoryEntry": "kvbridge.metadata.types",
    "PROTOCOL_VERSION": "kvbridge.metadata.types",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
