"""The metadata server: handshake and release for the engine that embeds it, the block directory, health.

Embedded, an engine's connector starts one in-process (its own thread pool; several per process
are fine) and answers handshakes and releases through two callbacks::

    server = MetadataServer("0.0.0.0:0", on_handshake=lambda peer: my_info, on_release=free_blocks)
    port = server.start()
    ...
    server.stop(grace=1.0)

Standalone (``kvbridge metadata-server --listen HOST:PORT``), it serves the directory, the standard
``grpc.health.v1`` service and server reflection; ``Peer`` calls answer UNIMPLEMENTED, there being
no engine to answer for.

Every call but health needs the shared token when one is set (``authorization: Bearer <token>``);
TLS, optionally mutual, protects it on the wire. Every request is validated before it is acted on:
a malformed one (empty ids, too many or oversized hashes, unset version, unreadable bytes) gets
INVALID_ARGUMENT, an incompatible peer FAILED_PRECONDITION naming what differs. Messages are capped
at ``max_message_bytes`` by gRPC itself, before they are parsed.
"""

from __future__ import annotations

import argparse
import collections
import hmac
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvbridge.addresses import HostPort, parse_host_port
from kvbridge.errors import ConfigError
from kvbridge.metadata import wire
from kvbridge.metadata.directory import Directory
from kvbridge.metadata.redis_directory import RedisDirectory
from kvbridge.metadata.types import PeerInfo
from kvbridge.v1 import metadata_pb2 as pb

log = logging.getLogger(__name__)

HandshakeCallback = Callable[[PeerInfo], PeerInfo]
ReleaseCallback = Callable[[str, str, bool, bytes], "bool | None"]
ConfirmCallback = Callable[[str, str, bytes], bool]

_PEER = pb.DESCRIPTOR.services_by_name["Peer"].full_name
_DIRECTORY = pb.DESCRIPTOR.services_by_name["Directory"].full_name
_MALFORMED = object()  # what a request deserializes to when its bytes do not parse


def _lenient(cls: Any) -> Callable[[bytes], Any]:
    # gRPC answers INTERNAL for a request it cannot parse; parse ourselves so that garbage is INVALID_ARGUMENT
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception:
            return _MALFORMED

    return parse


class _TokenCheck(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call but health whose ``authorization`` is not ``Bearer <token>``."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(wire.HEALTH_PREFIX):
            return handler
        got = next((v for k, v in details.invocation_metadata or () if k == wire.AUTH_KEY), "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else bytes(got), self._expected):
            return handler

        def refuse(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        # the refusal must have the same streaming shape as the method it stands in for
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return make(refuse, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


class MetadataServer:
    """A gRPC metadata server (see the module docstring). Not started until :meth:`start`.

    ``on_handshake(peer) -> ours`` answers a handshake with the embedder's own :class:`PeerInfo`; it may
    raise :class:`~kvbridge.errors.LayoutMismatch` / :class:`~kvbridge.errors.ProtocolError` to refuse,
    and the server itself refuses a peer whose protocol version it does not speak or whose layout
    differs from the answer. ``on_release(engine_id, request_id, aborted, grant) -> held`` is called once per
    ``(engine_id, request_id, grant)`` (``grant``: the opaque bytes the consumer got in the transfer params; the
    answer ``held``, true when the blocks stayed held until now, goes back to the consumer; ``None`` is
    false): repeats (a client's retries) answer ``duplicate`` (and not held) without calling it
    again — among the last ``release_memory`` releases; it should still tolerate an unknown request.
    A callback that raises fails the call (INTERNAL) and leaves it un-remembered, so a retry calls again.
    ``on_confirm(engine_id, request_id, grant) -> held`` answers a release that only asks (``keep``):
    whether the blocks are still held, changing nothing; it is called for every such ask.
    Callbacks run on the server's worker threads, possibly several at once: they must be thread-safe
    and quick (no transfers inside them).

    ``directory``: ``True`` serves a fresh :class:`Directory`, an instance serves (and may share) that
    one, ``False`` serves none.
    """

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        *,
        token: str | None = None,
        tls: wire.ServerTLS | None = None,
        on_handshake: HandshakeCallback | None = None,
        on_release: ReleaseCallback | None = None,
        on_confirm: ConfirmCallback | None = None,
        directory: Directory | RedisDirectory | bool = True,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
        max_hashes: int = wire.MAX_HASHES,
        max_workers: int = 8,
        release_memory: int = 65536,
    ):
        if token is not None and not token:
            raise ConfigError("token must be non-empty (or None for no token)")
        if max_hashes < 1 or max_message_bytes < 1024 or max_workers < 1:
            raise ConfigError("max_hashes, max_workers must be >= 1 and max_message_bytes >= 1024")
        self.listen = str(parse_host_port(listen, what="metadata server listen address", allow_zero=True))
        self.port: int | None = None
        self.directory: Directory | RedisDirectory | None = (Directory() if directory is True else directory) or None
        self._tls = tls
        self._on_handshake = on_handshake
        self._on_release = on_release
        self._on_confirm = on_confirm
        self._max_hashes = max_hashes
        self._released: collections.OrderedDict[tuple[str, str, bytes], None] = collections.OrderedDict()
        self._release_memory = release_memory
        self._release_lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="kvbridge-metadata")
        self._health = health.HealthServicer()
        self._server = grpc.server(
            self._pool,
            handlers=[self._peer_handlers(), self._directory_handlers()],
            interceptors=[_TokenCheck(token)] if token else [],
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),  # two servers must never share a port by accident
            ],
            maximum_concurrent_rpcs=max_workers * 16,  # beyond that: RESOURCE_EXHAUSTED, not a queue without end
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (_PEER, _DIRECTORY, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._server,
        )
        self._stopped = False

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> int:
        """Bind and serve; returns the port (the one picked when ``listen`` ends in ``:0``)."""
        try:
            if self._tls is None:
                port = self._server.add_insecure_port(self.listen)
            else:
                port = self._server.add_secure_port(self.listen, self._tls.credentials())
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {self.listen!r}: {exc}") from exc
        if not port:
            raise ConfigError(f"cannot listen on {self.listen!r}")
        self.port = port
        self._server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        self._health.set("", serving)
        self._health.set(_PEER, serving if self._on_handshake or self._on_release else not_serving)
        self._health.set(_DIRECTORY, serving if self.directory else not_serving)
        return port

    @property
    def address(self) -> str:
        """``host:port`` as listened on, with the actual port (valid after :meth:`start`)."""
        if self.port is None:
            raise ConfigError("server not started")
        return str(HostPort(parse_host_port(self.listen, allow_zero=True).host, self.port))

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop taking calls, let running ones finish for up to ``grace`` seconds, release the threads. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        self._pool.shutdown(wait=False)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or ``timeout``); ``True`` once stopped."""
        return bool(self._server.wait_for_termination(timeout))

    def __enter__(self) -> MetadataServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- handlers --------------------------------------------------------------------------------
    @staticmethod
    def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> NoReturn:
        code, tag = wire.status_of(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("metadata %s failed", method, exc_info=exc)
        context.set_trailing_metadata(((wire.ERROR_KEY, tag),))
        context.abort(code, str(exc) or type(exc).__name__)
        raise AssertionError("context.abort returned")  # it raises; this tells the type checker

    def _unary(self, method: str, fn: Callable[[Any], Any], request_cls: Any, response_cls: Any) -> Any:
        def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
            if request is _MALFORMED:
                self._abort(context, wire.Invalid(f"undecodable {request_cls.__name__}"), method)
            try:
                return fn(request)
            except Exception as exc:
                self._abort(context, exc, method)

        return grpc.unary_unary_rpc_method_handler(
            behaviour, request_deserializer=_lenient(request_cls), response_serializer=response_cls.SerializeToString
        )

    def _peer_handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(_PEER, {
            "Handshake": self._unary("Handshake", self._handshake, pb.HandshakeRequest, pb.HandshakeResponse),
            "Release": self._unary("Release", self._release, pb.ReleaseRequest, pb.ReleaseResponse),
        })

    def _directory_handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(_DIRECTORY, {
            "Publish": self._unary("Publish", self._publish, pb.PublishRequest, pb.PublishResponse),
            "Heartbeat": self._unary("Heartbeat", self._heartbeat, pb.HeartbeatRequest, pb.HeartbeatResponse),
            "Unpublish": self._unary("Unpublish", self._unpublish, pb.UnpublishRequest, pb.UnpublishResponse),
            "Lookup": self._unary("Lookup", self._lookup, pb.LookupRequest, pb.LookupResponse),
        })

    def _handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeResponse:
        peer = wire.peer_from_pb(request.peer)
        wire.check_version(peer.protocol_version)
        if self._on_handshake is None:
            raise wire.Unimplemented("no engine behind this metadata server answers handshakes")
        ours = self._on_handshake(peer)
        wire.check_compatible(ours, peer)  # even if the embedder did not look
        return pb.HandshakeResponse(peer=wire.peer_to_pb(ours))

    def _release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        # the grant is part of who releases what: a stale grant (a producer restarted on this address)
        # must not make the real hand-off of a reused request id look like a repeat
        key = (wire.check_id(request.engine_id, "engine_id"), wire.check_id(request.request_id, "request_id"),
               bytes(request.grant))
        if request.keep:
            if self._on_confirm is None:
                raise wire.Unimplemented("no engine behind this metadata server confirms holds")
            return pb.ReleaseResponse(held=bool(self._on_confirm(key[0], key[1], key[2])))
        if self._on_release is None:
            raise wire.Unimplemented("no engine behind this metadata server takes releases")
        with self._release_lock:
            if key in self._released:
                return pb.ReleaseResponse(duplicate=True)
            # remembered before the callback runs, so a concurrent retry does not call it twice
            self._released[key] = None
            while len(self._released) > self._release_memory:
                self._released.popitem(last=False)
        try:
            held = self._on_release(key[0], key[1], request.aborted, key[2])
        except BaseException:
            with self._release_lock:
                self._released.pop(key, None)
            raise
        return pb.ReleaseResponse(duplicate=False, held=bool(held))

    def _dir(self) -> Directory | RedisDirectory:
        if self.directory is None:
            raise wire.Unimplemented("this metadata server keeps no directory")
        return self.directory

    def _publish(self, request: pb.PublishRequest) -> pb.PublishResponse:
        holder = wire.check_id(request.holder, "holder")
        if len(request.address) > wire.MAX_ID_CHARS:
            raise wire.Invalid(f"address is longer than {wire.MAX_ID_CHARS} characters")
        hashes = wire.check_hashes(list(request.hashes), self._max_hashes)
        self._dir().publish(holder, hashes, ttl_s=wire.check_ttl(request.ttl_s), address=request.address)
        return pb.PublishResponse()

    def _heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        holder = wire.check_id(request.holder, "holder")
        return pb.HeartbeatResponse(known=self._dir().heartbeat(holder, ttl_s=wire.check_ttl(request.ttl_s)))

    def _unpublish(self, request: pb.UnpublishRequest) -> pb.UnpublishResponse:
        holder = wire.check_id(request.holder, "holder")
        hashes = wire.check_hashes(list(request.hashes), self._max_hashes)
        self._dir().unpublish(holder, hashes or None)
        return pb.UnpublishResponse()

    def _lookup(self, request: pb.LookupRequest) -> pb.LookupResponse:
        hashes = wire.check_hashes(list(request.hashes), self._max_hashes)
        return pb.LookupResponse(entries=[
            pb.DirectoryEntry(holder=e.holder, num_blocks=e.num_blocks, address=e.address)
            for e in self._dir().lookup(hashes)
        ])


# ---- `kvbridge metadata-server` ---------------------------------------------------------------------

TOKEN_ENV = "KVBRIDGE_METADATA_TOKEN"


def _host_port(text: str) -> str:
    try:
        parse_host_port(text, what="HOST:PORT", allow_zero=True)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT; port 0 picks a free one (default %(default)s)",
                        type=_host_port)
    parser.add_argument("--directory", default="", metavar="URL",
                        help="keep the block directory in Redis/Valkey (redis://HOST:PORT/DB), shared by every "
                             "server that names it; default: in this process")
    parser.add_argument("--token-file", help=f"file holding the shared token (default: ${TOKEN_ENV}, else no token)")
    parser.add_argument("--tls-cert", help="server certificate chain (PEM); with --tls-key enables TLS")
    parser.add_argument("--tls-key", help="server private key (PEM)")
    parser.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")
    parser.add_argument("--max-hashes", type=int, default=wire.MAX_HASHES, help="most hashes in one request")
    parser.add_argument("--max-message-bytes", type=int, default=wire.MAX_MESSAGE_BYTES)
    parser.add_argument("--grace", type=float, default=5.0, help="seconds running calls get at shutdown")


def _standalone(args: argparse.Namespace) -> MetadataServer:
    # the token comes from a file or the environment, never the command line (which `ps` shows to everyone)
    token = os.environ.get(TOKEN_ENV) or None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        tls = wire.ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)
    elif args.tls_client_ca:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    directory: Any = True
    if args.directory:
        directory = RedisDirectory(args.directory)  # the URL is checked here; the server may come later
    return MetadataServer(args.listen, token=token, tls=tls, max_hashes=args.max_hashes,
                          max_message_bytes=args.max_message_bytes, directory=directory)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; prints ``listening on HOST:PORT`` first (flushed), ``stopped`` last."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = _standalone(args)
        server.start()
    except (ConfigError, OSError) as exc:
        print(f"kvbridge metadata-server: error: {exc}", file=sys.stderr)
        return 2
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"listening on {server.address}", flush=True)
    while not done.wait(0.5):  # a bounded wait keeps the main thread responsive to signals
        pass
    server.stop(args.grace)
    print("stopped", flush=True)
    sys.stdout.flush()
    return 0


__all__ = ["MetadataServer", "configure", "run"]
