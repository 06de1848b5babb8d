"""The metadata client: one channel to one metadata server, plain values in and out.

    with MetadataClient("10.0.0.5:7070", token=token) as client:
        theirs = client.handshake(my_info)           # LayoutMismatch / ProtocolError if incompatible
        client.release("decode-0", "req-17")         # the producer may free req-17's blocks
        client.publish("prefill-0", hashes, ttl_s=30, address=my_address)
        best = client.lookup(prompt_hashes)          # [DirectoryEntry(holder, num_blocks, address), ...]

Every call has a deadline (``timeout`` seconds per attempt). Every call of the protocol is idempotent
by design (handshakes exchange state, releases are deduplicated by the server, publishing the same
hashes twice changes nothing), so each is retried ``retries`` times with jittered exponential backoff
— but only on UNAVAILABLE and DEADLINE_EXCEEDED, where the server may not have seen it. gRPC errors
never leave this module: they become kvbridge exceptions (:func:`kvbridge.metadata.wire.error_from_rpc`):
UNAVAILABLE -> :class:`PeerUnreachable`, DEADLINE_EXCEEDED -> :class:`TransferTimeout`, UNAUTHENTICATED,
PERMISSION_DENIED or a failed TLS handshake -> :class:`Unauthorized`, a refused layout ->
:class:`LayoutMismatch`, anything else (INVALID_ARGUMENT, FAILED_PRECONDITION, UNIMPLEMENTED, ...) ->
:class:`ProtocolError`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from kvbridge.errors import ClosedError, KVBridgeError, PeerUnreachable, ProtocolError, TransferTimeout
from kvbridge.metadata import wire
from kvbridge.metadata.types import DirectoryEntry, PeerInfo
from kvbridge.v1 import metadata_pb2 as pb
from kvbridge.v1 import metadata_pb2_grpc as pb_grpc

T = TypeVar("T")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class MetadataClient:
    """A client of one metadata server; thread-safe (one gRPC channel, shared)."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: wire.ClientTLS | None = None,
        timeout: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
    ):
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self._backoff = (backoff_s, max_backoff_s)
        self._metadata: tuple[tuple[str, str], ...] = ((wire.AUTH_KEY, f"Bearer {token}"),) if token else ()
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.enable_retries", 0),  # retries are ours, and only where they are safe
            # after a failed connect the channel fails calls fast until it redials: redial on our backoff's
            # scale, or every retry would land inside gRPC's default 1 s reconnect pause
            ("grpc.initial_reconnect_backoff_ms", max(1, int(backoff_s * 1000))),
            ("grpc.min_reconnect_backoff_ms", max(1, int(backoff_s * 1000))),
            ("grpc.max_reconnect_backoff_ms", max(1, int(max_backoff_s * 1000))),
        ]
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(address, tls.credentials(), options=options)
        self._peer = pb_grpc.PeerStub(self._channel)
        self._dir = pb_grpc.DirectoryStub(self._channel)
        self._closed = False

    # ---- the protocol ---------------------------------------------------------------------------
    def handshake(self, info: PeerInfo, until: float | None = None) -> PeerInfo:
        """Send our :class:`PeerInfo`, return the server's; refuse an incompatible answer ourselves too.
        ``until`` as for :meth:`release`."""
        reply = self._call("Handshake", self._peer.Handshake, pb.HandshakeRequest(peer=wire.peer_to_pb(info)),
                           until=until)
        try:
            theirs = wire.peer_from_pb(reply.peer)
        except wire.Invalid as exc:
            raise ProtocolError(f"{self.address} Handshake: malformed answer: {exc}") from None
        wire.check_compatible(info, theirs, what="server")
        return theirs

    def release(self, engine_id: str, request_id: str, *, aborted: bool = False, grant: bytes = b"",
                until: float | None = None) -> bool:
        """Tell the producer that ``engine_id`` received (or gave up, ``aborted``) the blocks of ``request_id``.

        Returns whether the producer held them from the hand-off until this call (``False`` for a
        repeat): a one-sided reader counts the bytes it read as loaded only when it did. ``until``
        (``time.monotonic()``): every try ends by then too (a load's own deadline)."""
        reply = self._call("Release", self._peer.Release,
                           pb.ReleaseRequest(engine_id=engine_id, request_id=request_id, aborted=aborted, grant=grant),
                           until=until)
        return bool(reply.held) and not reply.duplicate

    def confirm(self, engine_id: str, request_id: str, *, grant: bytes = b"", until: float | None = None) -> bool:
        """Ask whether the producer still holds the blocks of ``request_id`` (they stay held; the release
        comes later): a one-sided reader that may not release yet counts what it read only then.
        ``until`` as for :meth:`release`."""
        reply = self._call("Release", self._peer.Release,
                           pb.ReleaseRequest(engine_id=engine_id, request_id=request_id, grant=grant, keep=True),
                           until=until)
        return bool(reply.held)

    def publish(self, holder: str, hashes: Sequence[bytes], *, address: str = "", ttl_s: float) -> None:
        """Add ``hashes`` to what ``holder`` holds and (re)start its lease; ``address=""`` keeps the last one."""
        self._call("Publish", self._dir.Publish,
                   pb.PublishRequest(holder=holder, address=address, hashes=list(hashes), ttl_s=ttl_s))

    def heartbeat(self, holder: str, ttl_s: float) -> bool:
        """Renew ``holder``'s lease; ``False`` when the directory no longer knows it (publish again)."""
        reply = self._call("Heartbeat", self._dir.Heartbeat, pb.HeartbeatRequest(holder=holder, ttl_s=ttl_s))
        return bool(reply.known)

    def unpublish(self, holder: str, hashes: Sequence[bytes] | None = None) -> None:
        """Forget ``hashes`` of ``holder`` (all of them, and the holder, when ``None``)."""
        self._call("Unpublish", self._dir.Unpublish, pb.UnpublishRequest(holder=holder, hashes=list(hashes or ())))

    def lookup(self, hashes: Sequence[bytes]) -> list[DirectoryEntry]:
        """Who holds a leading run of ``hashes`` (consecutive blocks, first first), longest run first."""
        reply = self._call("Lookup", self._dir.Lookup, pb.LookupRequest(hashes=list(hashes)))
        return [DirectoryEntry(e.holder, e.num_blocks, e.address) for e in reply.entries]

    def health(self, service: str = "") -> bool:
        """``True`` when the server reports SERVING (for ``service``, or overall); ``False`` if not, or unreachable."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = self._call("Check", stub.Check, health_pb2.HealthCheckRequest(service=service), retries=0)
        except (PeerUnreachable, TransferTimeout):
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the channel is connected; :class:`PeerUnreachable` after ``timeout`` (default: ours)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.timeout if timeout is None else timeout)
        except grpc.FutureTimeoutError:
            raise PeerUnreachable(f"{self.address}: not reachable") from None

    # ---- plumbing --------------------------------------------------------------------------------
    def _call(self, method: str, fn: Callable[..., T], request: Any, *, retries: int | None = None,
              until: float | None = None) -> T:
        if self._closed:
            raise ClosedError(f"MetadataClient({self.address!r}) is closed")
        retries = self.retries if retries is None else retries
        attempt = 0
        while True:
            timeout = self.timeout if until is None else min(self.timeout, until - time.monotonic())
            if timeout <= 0:
                raise TransferTimeout(f"{self.address} {method}: no time left before the caller's deadline")
            try:
                return fn(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as err:
                exc: KVBridgeError = wire.error_from_rpc(err, f"{self.address} {method}")
                code = err.code() if isinstance(err, grpc.Call) else None
                if attempt >= retries or code not in _RETRYABLE or not isinstance(exc, (PeerUnreachable, TransferTimeout)):
                    raise exc from None  # the gRPC error's text is in the message; its traceback is noise
            base, cap = self._backoff
            time.sleep(min(cap, base * 2**attempt) * random.uniform(0.5, 1.0))  # jitter: retries do not align
            attempt += 1

    def close(self) -> None:
        """Close the channel; later calls raise :class:`ClosedError`. Idempotent."""
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> MetadataClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetadataClient({self.address!r}{', closed' if self._closed else ''})"


__all__ = ["MetadataClient"]
