"""kvbridge's exceptions: one root, a few families, each also a builtin where one fits.

Every error that leaves a backend is one of these; UCX, gRPC and OS errors are translated where they
cross the backend's boundary (gRPC: :func:`kvbridge.metadata.wire.error_from_rpc`), so callers never
need to know which transport sits underneath.

- :class:`ConfigError` (``ValueError``) — bad options, unknown backend names (:class:`UnknownBackend`).
- :class:`MissingDependency` (``ImportError``) — an optional extra is not installed; says what to install.
- :class:`LayoutError` (``ValueError``) — KV tensors kvbridge cannot address.
- :class:`LayoutMismatch` (``ValueError``) — two sides disagree on the KV layout fingerprint.
- :class:`Corrupted` — a stored object failed its header or checksum checks (:mod:`kvbridge.codec`);
  never loaded. ``damaged``: delete it; otherwise it is foreign (another version or layout): leave it.
- :class:`TransferError` — a transfer did not complete: :class:`TransferTimeout` (``TimeoutError``),
  :class:`PeerUnreachable` (``ConnectionError``).
- :class:`ProtocolError` — the metadata protocol was violated or refused (version mismatch,
  malformed message); :class:`Unauthorized` (``PermissionError``) for a wrong or missing token.
- :class:`StoreFull` (``OSError``) — a store had no room and could not evict.
- :class:`ClosedError` (``RuntimeError``) — use of an object after ``close()``.
"""

from __future__ import annotations


class KVBridgeError(Exception):
    """Root of every exception kvbridge raises on purpose."""


class ConfigError(KVBridgeError, ValueError):
    """Options that cannot work: a misspelt or missing option, a value out of range."""


class UnknownBackend(ConfigError, LookupError):
    """A backend name that is neither built in nor registered through an entry point."""


class MissingDependency(KVBridgeError, ImportError):
    """An optional dependency is absent; the message says which ``pip install`` line brings it."""


class LayoutError(KVBridgeError, ValueError):
    """KV tensors whose layout kvbridge cannot address (shape, strides, dtype or device)."""


class LayoutMismatch(KVBridgeError, ValueError):
    """Two sides (a stored object, a peer) carry different layout fingerprints."""


class Corrupted(KVBridgeError):
    """A stored object failed validation (magic, version, key, layout, size, checksum); it was not loaded.

    ``damaged`` says whether the object itself is bad (truncated, bit flips, another key's bytes: a
    store deletes it so the next producer writes it again) or merely *foreign* (another format
    version, layout or checksum kind: another engine's object, left alone).
    """

    def __init__(self, reason: str, *, damaged: bool = True):
        super().__init__(reason)
        self.damaged = damaged

    def __reduce__(self) -> tuple[object, ...]:  # keep ``damaged`` across pickling (keyword-only)
        return type(self), (str(self),), {"damaged": self.damaged}


class TransferError(KVBridgeError):
    """A transfer did not complete; the affected blocks were not (fully) written."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer or a call missed its deadline."""


class PeerUnreachable(TransferError, ConnectionError):
    """The peer is dead, refused the connection, or went away mid-transfer."""


class ProtocolError(KVBridgeError):
    """The metadata protocol was violated or a peer refused us (version, malformed message)."""


class Unauthorized(ProtocolError, PermissionError):
    """A call carried a missing or wrong shared token, or failed TLS verification."""


class StoreFull(KVBridgeError, OSError):
    """A store had no room for an object and could not evict enough to make some."""


class ClosedError(KVBridgeError, RuntimeError):
    """The object was used after ``close()``."""


__all__ = [
    "ClosedError",
    "ConfigError",
    "Corrupted",
    "KVBridgeError",
    "LayoutError",
    "LayoutMismatch",
    "MissingDependency",
    "PeerUnreachable",
    "ProtocolError",
    "StoreFull",
    "TransferError",
    "TransferTimeout",
    "Unauthorized",
    "UnknownBackend",
]
