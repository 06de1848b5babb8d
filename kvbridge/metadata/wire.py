"""What the server and the client share: limits, TLS settings, message <-> value conversion, error codes.

Protobuf objects stop here: the server's callbacks and the client's callers see only the plain values
of :mod:`kvbridge.metadata.types`. Errors cross the wire as gRPC status codes (plus a trailing
``kvbridge-error`` key that says which kvbridge exception a FAILED_PRECONDITION stands for) and
become kvbridge exceptions again on the client side (:func:`error_from_rpc`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import grpc

from kvbridge.errors import (
    KVBridgeError,
    LayoutMismatch,
    PeerUnreachable,
    ProtocolError,
    StoreFull,
    TransferTimeout,
    Unauthorized,
)
from kvbridge.layout import LayoutFingerprint
from kvbridge.metadata.types import PROTOCOL_VERSION, PeerInfo
from kvbridge.v1 import metadata_pb2 as pb

SUPPORTED_VERSIONS = frozenset({PROTOCOL_VERSION})
AUTH_KEY = "authorization"  # metadata key of the shared token: "Bearer <token>"
ERROR_KEY = "kvbridge-error"  # trailing metadata: which kvbridge exception a status stands for
HEALTH_PREFIX = "/grpc.health.v1.Health/"  # open without a token: load balancers probe it

# Bounds on what one message may hold, so that no request makes the server allocate without limit.
MAX_MESSAGE_BYTES = 4 << 20
MAX_HASHES = 65536
MAX_HASH_BYTES = 64  # sha256 is 32; kvbridge's own keys are 16
MAX_ID_CHARS = 256
MAX_FINGERPRINT_CHARS = 4096
MAX_TRANSPORT_ENTRIES = 64
MAX_TTL_S = 24 * 3600.0

Pem = bytes | str | Path  # PEM bytes, or the path of a PEM file


def _pem(value: Pem | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


@dataclasses.dataclass(frozen=True)
class ServerTLS:
    """The server's certificate chain and key; with ``client_ca``, clients must present a certificate it signed."""

    cert: Pem
    key: Pem
    client_ca: Pem | None = None

    def credentials(self) -> grpc.ServerCredentials:
        ca = _pem(self.client_ca)
        pair = [(_pem(self.key), _pem(self.cert))]
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=ca is not None)


@dataclasses.dataclass(frozen=True)
class ClientTLS:
    """Roots that verify the server (``None``: the system's), an optional client certificate for mTLS, and
    ``server_name`` when the certificate names the server differently from the address dialled."""

    ca: Pem | None = None
    cert: Pem | None = None
    key: Pem | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(_pem(self.ca), _pem(self.key), _pem(self.cert))


class Invalid(ProtocolError):
    """A malformed request; the server answers INVALID_ARGUMENT."""


class Unimplemented(ProtocolError):
    """This server has nothing behind a service (no engine, no directory); it answers UNIMPLEMENTED."""


def check_id(value: str, what: str) -> str:
    if not value:
        raise Invalid(f"{what} is empty")
    if len(value) > MAX_ID_CHARS:
        raise Invalid(f"{what} is longer than {MAX_ID_CHARS} characters")
    return value


def check_hashes(hashes: list[bytes], max_hashes: int, *, allow_empty: bool = True) -> list[bytes]:
    if len(hashes) > max_hashes:
        raise Invalid(f"{len(hashes)} hashes in one message; at most {max_hashes}")
    if not hashes and not allow_empty:
        raise Invalid("no hashes")
    for h in hashes:
        if not 0 < len(h) <= MAX_HASH_BYTES:
            raise Invalid(f"a block hash of {len(h)} bytes; expected 1..{MAX_HASH_BYTES}")
    return hashes


def check_ttl(ttl_s: float) -> float:
    if not 0 < ttl_s <= MAX_TTL_S:  # also refuses NaN
        raise Invalid(f"ttl_s={ttl_s} outside (0, {MAX_TTL_S:g}]")
    return ttl_s


def peer_to_pb(info: PeerInfo) -> pb.PeerInfo:
    return pb.PeerInfo(
        engine_id=info.engine_id,
        rank=info.rank,
        protocol_version=info.protocol_version,
        layout_fingerprint=info.fingerprint.to_json(),
        transport=dict(info.transport),
    )


def peer_from_pb(msg: pb.PeerInfo) -> PeerInfo:
    """Validate and convert; :class:`Invalid` for anything malformed (never a version or layout judgement)."""
    check_id(msg.engine_id, "engine_id")
    if msg.rank < 0:
        raise Invalid(f"rank={msg.rank} is negative")
    if msg.protocol_version == 0:
        raise Invalid("protocol_version is unset")
    if not msg.layout_fingerprint or len(msg.layout_fingerprint) > MAX_FINGERPRINT_CHARS:
        raise Invalid(f"layout_fingerprint must be 1..{MAX_FINGERPRINT_CHARS} characters of JSON")
    if len(msg.transport) > MAX_TRANSPORT_ENTRIES:
        raise Invalid(f"{len(msg.transport)} transport entries; at most {MAX_TRANSPORT_ENTRIES}")
    try:
        fingerprint = LayoutFingerprint.from_json(msg.layout_fingerprint)
    except (ValueError, TypeError, RecursionError) as exc:  # LayoutMismatch is from_json's "unreadable"
        raise Invalid(f"layout_fingerprint: {exc}") from None
    return PeerInfo(
        engine_id=msg.engine_id,
        rank=msg.rank,
        fingerprint=fingerprint,
        transport={k: bytes(v) for k, v in msg.transport.items()},
        protocol_version=msg.protocol_version,
    )


def check_version(theirs: int, *, what: str = "peer") -> None:
    """:class:`ProtocolError` when we do not speak the peer's protocol version."""
    if theirs not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            f"protocol_version differs: ours={PROTOCOL_VERSION} {what}={theirs} "
            f"(supported: {sorted(SUPPORTED_VERSIONS)})"
        )


def check_compatible(ours: PeerInfo, theirs: PeerInfo, *, what: str = "peer") -> None:
    """Refuse a peer whose version or layout differs: :class:`ProtocolError` / :class:`LayoutMismatch`."""
    check_version(theirs.protocol_version, what=what)
    ours.fingerprint.check(theirs.fingerprint, what=what)


# ---- errors across the wire ------------------------------------------------------------------------

def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status (and ``kvbridge-error`` tag) a server answers for an exception from its own checks or callbacks."""
    if isinstance(exc, Invalid):
        return grpc.StatusCode.INVALID_ARGUMENT, "invalid"
    if isinstance(exc, Unimplemented):
        return grpc.StatusCode.UNIMPLEMENTED, "unimplemented"
    if isinstance(exc, StoreFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "full"
    if isinstance(exc, LayoutMismatch):
        return grpc.StatusCode.FAILED_PRECONDITION, "layout_mismatch"
    if isinstance(exc, Unauthorized):
        return grpc.StatusCode.PERMISSION_DENIED, "unauthorized"
    if isinstance(exc, ProtocolError):
        return grpc.StatusCode.FAILED_PRECONDITION, "protocol"
    if isinstance(exc, PeerUnreachable):  # a backing service (a Redis directory) is down: retryable
        return grpc.StatusCode.UNAVAILABLE, "unavailable"
    return grpc.StatusCode.INTERNAL, "internal"


_BY_CODE: Mapping[grpc.StatusCode, type[KVBridgeError]] = {
    grpc.StatusCode.UNAVAILABLE: PeerUnreachable,
    grpc.StatusCode.CANCELLED: PeerUnreachable,
    grpc.StatusCode.DEADLINE_EXCEEDED: TransferTimeout,
    grpc.StatusCode.UNAUTHENTICATED: Unauthorized,
    grpc.StatusCode.PERMISSION_DENIED: Unauthorized,
}
# a TLS failure surfaces as UNAVAILABLE; its details are the only way to tell it from a dead peer
_TLS_WORDS = ("ssl", "tls", "certificate", "handshake failed")


def error_from_rpc(err: grpc.RpcError, method: str) -> KVBridgeError:
    """The kvbridge exception for a failed call (everything not listed is a :class:`ProtocolError`)."""
    code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (err.details() if isinstance(err, grpc.Call) else None) or str(err)
    tag = ""
    if isinstance(err, grpc.Call):
        tag = next((str(v) for k, v in (err.trailing_metadata() or ()) if k == ERROR_KEY), "")
    message = f"{method}: {code.name}: {details}"
    if code == grpc.StatusCode.FAILED_PRECONDITION and tag == "layout_mismatch":
        return LayoutMismatch(message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and tag == "full":
        return StoreFull(message)
    if code == grpc.StatusCode.UNAVAILABLE and any(w in details.lower() for w in _TLS_WORDS):
        return Unauthorized(message)
    return _BY_CODE.get(code, ProtocolError)(message)


__all__ = [
    "ClientTLS",
    "Invalid",
    "Unimplemented",
    "ServerTLS",
    "check_compatible",
    "error_from_rpc",
    "peer_from_pb",
    "peer_to_pb",
    "status_of",
]
