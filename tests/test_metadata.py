"""The gRPC metadata protocol, end to end: real servers on 127.0.0.1, clients in other processes.

Three child processes serve the whole module (each pays one import of torch, so they start together):
a standalone ``kvbridge metadata-server`` (directory, health, reflection), a second one that the
SIGTERM test stops, and a *peer* (tests/helpers/metakit.py): a Python process that runs
:class:`MetadataClient` calls sent to it as JSON lines and answers with results or kvbridge exception
names. Embedded servers (the ``serve`` fixture) run in this process, so their callbacks can be observed;
the security tests (token, TLS) share the peer process. What needs no child process is in
tests/test_metadata_client.py.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from metakit import CONSUMER, FP, MAX_HASHES, PEER_SCRIPT, PRODUCER, Peer, hashes_of, listening, server_cmd, spawn

from kvbridge import errors
from kvbridge.metadata import wire
from kvbridge.metadata.client import MetadataClient
from kvbridge.metadata.directory import Directory
from kvbridge.metadata.server import MetadataServer
from kvbridge.metadata.types import PROTOCOL_VERSION, DirectoryEntry, PeerInfo
from kvbridge.v1 import metadata_pb2 as pb


@pytest.fixture(scope="module")
def children() -> Iterator[dict[str, Any]]:
    procs = {"standalone": spawn(*server_cmd()), "doomed": spawn(*server_cmd(), KVBRIDGE_METADATA_TOKEN="env-token"), "peer": spawn("-c", PEER_SCRIPT)}
    try:
        yield {"standalone": listening(procs["standalone"]), "doomed": (procs["doomed"], listening(procs["doomed"])),
               "peer": Peer(procs["peer"])}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)


@pytest.fixture(scope="module")
def standalone(children: dict[str, Any]) -> str:
    return str(children["standalone"])


@pytest.fixture(scope="module")
def peer(children: dict[str, Any]) -> Peer:
    return children["peer"]  # type: ignore[no-any-return]



# ---- handshake --------------------------------------------------------------------------------------

def test_handshake_exchanges_peer_info_across_processes(serve: Callable[..., MetadataServer], peer: Peer) -> None:
    seen: list[PeerInfo] = []
    server = serve(on_handshake=lambda p: seen.append(p) or PRODUCER)
    assert peer.call(server.address, "handshake", CONSUMER) == PRODUCER
    assert seen == [CONSUMER]  # transport bytes, rank and fingerprint arrive intact


def test_handshake_layout_mismatch_is_refused_naming_the_fields(serve: Callable[..., MetadataServer], peer: Peer) -> None:
    server = serve(on_handshake=lambda p: PRODUCER)
    other = dataclasses.replace(CONSUMER, fingerprint=dataclasses.replace(FP, block_size=32, dtype="bfloat16"))
    with pytest.raises(errors.LayoutMismatch, match="FAILED_PRECONDITION") as info:
        peer.call(server.address, "handshake", other)
    assert "block_size: ours=16 peer=32" in str(info.value) and "dtype" in str(info.value)


def test_handshake_version_mismatch_is_refused(serve: Callable[..., MetadataServer], peer: Peer) -> None:
    called: list[PeerInfo] = []
    server = serve(on_handshake=lambda p: called.append(p) or PRODUCER)
    with pytest.raises(errors.ProtocolError, match="FAILED_PRECONDITION.*protocol_version differs: ours=1 peer=2"):
        peer.call(server.address, "handshake", dataclasses.replace(CONSUMER, protocol_version=PROTOCOL_VERSION + 1))
    assert not called  # refused before the embedder is asked


def test_handshake_embedder_refusals_map_to_kvbridge_errors(serve: Callable[..., MetadataServer]) -> None:
    def refuse(p: PeerInfo) -> PeerInfo:
        raise (errors.LayoutMismatch if p.rank == 0 else errors.ProtocolError)(f"no thanks, rank {p.rank}")

    server = serve(on_handshake=refuse)
    with MetadataClient(server.address, retries=0) as client:
        with pytest.raises(errors.LayoutMismatch, match="no thanks, rank 0"):
            client.handshake(dataclasses.replace(CONSUMER, rank=0))
        with pytest.raises(errors.ProtocolError, match="FAILED_PRECONDITION: no thanks, rank 1") as info:
            client.handshake(CONSUMER)
        assert not isinstance(info.value, errors.LayoutMismatch)


def test_standalone_server_has_no_engine_to_answer_for(standalone: str, peer: Peer) -> None:
    with pytest.raises(errors.ProtocolError, match="UNIMPLEMENTED"):
        peer.call(standalone, "handshake", CONSUMER)
    with pytest.raises(errors.ProtocolError, match="UNIMPLEMENTED"):
        peer.call(standalone, "release", "decode-0", "r1")


# ---- release ----------------------------------------------------------------------------------------

def test_release_calls_back_once_per_request(serve: Callable[..., MetadataServer], peer: Peer) -> None:
    released: list[tuple[str, str, bool]] = []
    server = serve(on_release=lambda *a: released.append(a))
    peer.call(server.address, "release", "decode-0", "r1")
    peer.call(server.address, "release", "decode-0", "r1")  # a retry: idempotent
    peer.call(server.address, "release", "decode-0", "r2", aborted=True)
    peer.call(server.address, "release", "decode-1", "r1")  # another consumer's r1 is another release
    assert released == [("decode-0", "r1", False, b""), ("decode-0", "r2", True, b""), ("decode-1", "r1", False, b"")]
    with pytest.raises(errors.ProtocolError, match="INVALID_ARGUMENT: request_id is empty"):
        peer.call(server.address, "release", "decode-0", "")


def test_release_whose_callback_fails_can_be_retried(serve: Callable[..., MetadataServer]) -> None:
    calls: list[str] = []

    def flaky(engine_id: str, request_id: str, aborted: bool, grant: bytes) -> None:
        calls.append(request_id)
        if len(calls) == 1:
            raise RuntimeError("engine busy")

    server = serve(on_release=flaky)
    with MetadataClient(server.address, retries=0) as client:
        with pytest.raises(errors.ProtocolError, match="INTERNAL"):
            client.release("decode-0", "r1")
        client.release("decode-0", "r1")  # not remembered as done: the callback runs again
        client.release("decode-0", "r1")
    assert calls == ["r1", "r1"]


def test_a_release_that_only_asks_changes_nothing(serve: Callable[..., MetadataServer]) -> None:
    """``confirm`` (a release with ``keep``) asks the engine whether it still holds the request, every
    time it is asked; the release proper then still happens, once."""
    released: list[str] = []
    asked: list[tuple[str, str, bytes]] = []
    server = serve(on_release=lambda e, r, a, g: released.append(r) or True,
                   on_confirm=lambda e, r, g: asked.append((e, r, g)) or r == "held")
    with MetadataClient(server.address) as client:
        assert client.confirm("decode-0", "held", grant=b"g") and client.confirm("decode-1", "held", grant=b"g")
        assert not client.confirm("decode-0", "gone")
        assert client.release("decode-0", "held", grant=b"g")  # not a duplicate of the asks
    assert asked == [("decode-0", "held", b"g"), ("decode-1", "held", b"g"), ("decode-0", "gone", b"")]
    assert released == ["held"]
    with MetadataClient(serve(on_release=lambda *a: True).address) as client, \
            pytest.raises(errors.ProtocolError, match="UNIMPLEMENTED"):
        client.confirm("decode-0", "r1")


# ---- directory --------------------------------------------------------------------------------------

def test_directory_publish_and_lookup_across_processes(standalone: str, peer: Peer) -> None:
    peer.call(standalone, "publish", "engine-a", hashes_of("a1", "a2", "a3", "a4"), ttl_s=60, address="10.0.0.1:7")
    with MetadataClient(standalone) as client:
        client.publish("engine-b", hashes_of("a1", "a2"), ttl_s=60)
        client.publish("engine-c", hashes_of("a1", "a3"), ttl_s=60)  # a gap: only its first block counts
        assert client.lookup(hashes_of("a1", "a2", "a3", "x")) == [
            DirectoryEntry("engine-a", 3, "10.0.0.1:7"), DirectoryEntry("engine-b", 2), DirectoryEntry("engine-c", 1),
        ]
        assert client.lookup(hashes_of("zz")) == [] and client.lookup([]) == []
        client.unpublish("engine-a", hashes_of("a2"))
        assert client.lookup(hashes_of("a1", "a2"))[0] == DirectoryEntry("engine-b", 2)
    peer.call(standalone, "unpublish", "engine-b")
    assert peer.call(standalone, "lookup", hashes_of("a1")) == [["engine-a", 1, "10.0.0.1:7"], ["engine-c", 1, ""]]
    for holder in ("engine-a", "engine-c"):
        peer.call(standalone, "unpublish", holder)
    assert peer.call(standalone, "lookup", hashes_of("a1")) == []


def test_directory_entries_of_a_silent_holder_expire(standalone: str) -> None:
    with MetadataClient(standalone) as client:
        client.publish("mortal", hashes_of("e1", "e2"), ttl_s=0.4)
        client.publish("kept", hashes_of("e1"), ttl_s=0.4)
        assert [e.holder for e in client.lookup(hashes_of("e1"))] == ["kept", "mortal"]
        time.sleep(0.25)
        assert client.heartbeat("kept", 0.4)
        time.sleep(0.25)  # mortal's lease is over, kept's was renewed
        assert client.lookup(hashes_of("e1", "e2")) == [DirectoryEntry("kept", 1)]
        assert not client.heartbeat("mortal", 0.4)  # the holder learns that it must publish again
        client.unpublish("kept")


def test_directory_unit_semantics() -> None:
    now = [0.0]
    d = Directory(max_holders=2, max_hashes_per_holder=3, clock=lambda: now[0])
    d.publish("a", hashes_of("1", "2", "3"), ttl_s=10)
    d.publish("a", hashes_of("1", "4"), ttl_s=10)  # re-publishing "1" makes it newest; "2" is now the oldest, evicted
    assert d.holders() == {"a": 3}
    assert d.lookup(hashes_of("1", "2")) == [DirectoryEntry("a", 1)] and d.lookup(hashes_of("3", "4")) == [DirectoryEntry("a", 2)]
    d.publish("b", [], ttl_s=5, address="b:1")  # registers with no hashes
    with pytest.raises(errors.StoreFull):
        d.publish("c", hashes_of("1"), ttl_s=5)
    now[0] = 5.0  # leases end at their deadline exactly
    assert d.holders() == {"a": 3}
    d.publish("c", hashes_of("1"), ttl_s=5)
    assert not d.heartbeat("b", ttl_s=5) and d.heartbeat("a", ttl_s=1)
    now[0] = 6.0
    assert d.lookup(hashes_of("1")) == [DirectoryEntry("c", 1)]
    d.unpublish("c", hashes_of("9"))
    d.unpublish("nobody")
    d.unpublish("c")
    assert d.holders() == {} and d._index == {}  # nothing leaks


# ---- health, reflection, limits --------------------------------------------------------------------

def test_health_and_reflection(standalone: str) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with MetadataClient(standalone) as client:
        assert client.health() and client.health("kvbridge.v1.Directory")
        assert not client.health("kvbridge.v1.Peer")  # standalone: no engine behind it
    with grpc.insecure_channel(standalone) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"kvbridge.v1.Peer", "kvbridge.v1.Directory", "grpc.health.v1.Health"} <= services
    with MetadataClient("127.0.0.1:1", timeout=1) as client:
        assert not client.health()


def test_oversized_requests_are_refused(standalone: str) -> None:
    with MetadataClient(standalone) as client:
        with pytest.raises(errors.ProtocolError, match=f"INVALID_ARGUMENT: {MAX_HASHES + 1} hashes"):
            client.lookup([b"h"] * (MAX_HASHES + 1))
        with pytest.raises(errors.ProtocolError, match="RESOURCE_EXHAUSTED"):
            client.publish("big", [b"x" * 60] * 2000, ttl_s=1)  # over --max-message-bytes, refused unparsed
        assert client.health()


def _raw(channel: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        call(payload, timeout=5)
    except grpc.RpcError as err:
        return err.code()  # type: ignore[attr-defined,no-any-return]
    return grpc.StatusCode.OK


_ids = st.one_of(st.just(""), st.just("x" * 300), st.text(max_size=20))
_hashes = st.lists(st.one_of(st.just(b""), st.binary(min_size=1, max_size=80)), max_size=MAX_HASHES + 8)
_ttls = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0.01, 5))
_directory_requests = st.one_of(
    st.builds(lambda h, a, hs, t: ("Publish", pb.PublishRequest(holder=h, address=a, hashes=hs, ttl_s=t)),
              _ids, _ids, _hashes, _ttls),
    st.builds(lambda h, t: ("Heartbeat", pb.HeartbeatRequest(holder=h, ttl_s=t)), _ids, _ttls),
    st.builds(lambda h, hs: ("Unpublish", pb.UnpublishRequest(holder=h, hashes=hs)), _ids, _hashes),
    st.builds(lambda hs: ("Lookup", pb.LookupRequest(hashes=hs)), _hashes),
)
_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(request=_directory_requests, garbage=st.binary(max_size=64))
def test_malformed_directory_requests_are_invalid_argument(standalone: str, request: Any, garbage: bytes) -> None:
    method, msg = request
    with grpc.insecure_channel(standalone) as channel:
        code = _raw(channel, f"/kvbridge.v1.Directory/{method}", msg.SerializeToString())
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, msg)
        for m in ("Publish", "Lookup"):  # bytes that may not even parse
            assert _raw(channel, f"/kvbridge.v1.Directory/{m}", garbage) in (grpc.StatusCode.OK,
                                                                               grpc.StatusCode.INVALID_ARGUMENT)


_fingerprints = st.one_of(
    st.builds(lambda bs, dt: dataclasses.replace(FP, block_size=bs, dtype=dt).to_json(),
              st.sampled_from([16, 32]), st.sampled_from(["float16", "bfloat16"])),
    st.just(FP.to_json()), st.text(max_size=40), st.just("[" * 4000), st.just('{"dtype": {}}'),
)
_peers = st.builds(
    lambda e, r, v, f, t: pb.PeerInfo(engine_id=e, rank=r, protocol_version=v, layout_fingerprint=f, transport=t),
    _ids, st.integers(-(2**31), 2**31 - 1), st.one_of(st.sampled_from([0, 1, 2]), st.integers(0, 2**32 - 1)),
    _fingerprints, st.dictionaries(st.text(max_size=8), st.binary(max_size=16), max_size=70),
)


@pytest.fixture(scope="module")
def fuzzed_engine() -> Iterator[MetadataServer]:
    server = MetadataServer(on_handshake=lambda p: PRODUCER, on_release=lambda *a: None)
    server.start()
    yield server
    server.stop(0)


@_FUZZ
@given(info=_peers)
def test_malformed_handshakes_are_refused_cleanly(fuzzed_engine: MetadataServer, info: pb.PeerInfo) -> None:
    with grpc.insecure_channel(fuzzed_engine.address) as channel:
        code = _raw(channel, "/kvbridge.v1.Peer/Handshake", pb.HandshakeRequest(peer=info).SerializeToString())
    compatible = info.protocol_version == PROTOCOL_VERSION and info.layout_fingerprint == FP.to_json()
    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK if compatible else grpc.StatusCode.FAILED_PRECONDITION}
    assert code in allowed, (code, info)


def test_fuzzed_servers_are_still_healthy(standalone: str, fuzzed_engine: MetadataServer) -> None:
    for address in (standalone, fuzzed_engine.address):
        with MetadataClient(address) as client:
            assert client.health()


# ---- the standalone process -------------------------------------------------------------------------

def test_sigterm_stops_the_standalone_server_gracefully(children: dict[str, Any]) -> None:
    proc, address = children["doomed"]
    with MetadataClient(address, token="env-token") as client:
        client.publish("p", hashes_of("1"), ttl_s=10)
        with pytest.raises(errors.Unauthorized), MetadataClient(address) as tokenless:
            tokenless.lookup(hashes_of("1"))  # the token came from $KVBRIDGE_METADATA_TOKEN
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert proc.stdout.read().strip().splitlines()[-1] == "stopped"
        assert not client.health()



# ---- security: shared token, TLS, mutual TLS -------------------------------------------------------

def test_token_is_checked_on_every_call_but_health(serve: Callable[..., MetadataServer], peer: Peer) -> None:
    released: list[Any] = []
    server = serve(token="s3cret", on_handshake=lambda p: PRODUCER, on_release=lambda *a: released.append(a))
    for token in (None, "wrong", "s3cret-but-longer", "S3CRET"):
        for method, args in (("handshake", (CONSUMER,)), ("release", ("decode-0", "r1")), ("lookup", ([b"h"],))):
            with pytest.raises(errors.Unauthorized, match="UNAUTHENTICATED"):
                peer.call(server.address, method, *args, token=token)
    assert not released
    assert peer.call(server.address, "health")  # open: load balancers probe it without the token
    assert peer.call(server.address, "handshake", CONSUMER, token="s3cret") == PRODUCER
    peer.call(server.address, "release", "decode-0", "r1", token="s3cret")
    assert released == [("decode-0", "r1", False, b"")]
    with grpc.insecure_channel(server.address) as channel:  # reflection too is behind the token
        stream = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        with pytest.raises(grpc.RpcError) as info:
            list(stream(iter([b""]), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three self-signed certificates for 127.0.0.1: the server's, a client's, and a stranger's."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("certs")
    out = {}
    for name in ("server", "client", "stranger"):
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.crt"), "-days", "2", "-subj", "/CN=localhost",
             "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
            check=True, capture_output=True,
        )
        out[name], out[f"{name}_key"] = str(d / f"{name}.crt"), str(d / f"{name}.key")
    return out


def test_tls_client_must_trust_the_server(serve: Callable[..., MetadataServer], peer: Peer, certs: dict[str, str]) -> None:
    server = serve(tls=wire.ServerTLS(certs["server"], certs["server_key"]), on_handshake=lambda p: PRODUCER)
    assert peer.call(server.address, "handshake", CONSUMER, tls={"ca": certs["server"]}) == PRODUCER
    for tls in ({"ca": certs["stranger"]}, {}):  # a CA that did not sign it; the system's roots
        with pytest.raises(errors.Unauthorized, match="CERTIFICATE_VERIFY_FAILED"):
            peer.call(server.address, "handshake", CONSUMER, tls=tls)
    with pytest.raises(errors.PeerUnreachable):  # plaintext to a TLS port: the server hangs up
        peer.call(server.address, "lookup", [b"h"])


def test_mutual_tls_and_token(serve: Callable[..., MetadataServer], peer: Peer, certs: dict[str, str]) -> None:
    tls = wire.ServerTLS(Path(certs["server"]).read_bytes(), Path(certs["server_key"]).read_bytes(), certs["client"])
    server = serve(tls=tls, token="t0k")
    ok = {"ca": certs["server"], "cert": certs["client"], "key": certs["client_key"]}
    assert peer.call(server.address, "lookup", [b"h"], tls=ok, token="t0k") == []
    with pytest.raises(errors.Unauthorized):
        peer.call(server.address, "lookup", [b"h"], tls=ok)  # the right certificate does not replace the token
    # a refused client certificate ends the connection without a word: it reads as an unreachable peer
    for bad in ({"ca": certs["server"]}, {**ok, "cert": certs["stranger"], "key": certs["stranger_key"]}):
        with pytest.raises((errors.PeerUnreachable, errors.Unauthorized)):
            peer.call(server.address, "lookup", [b"h"], tls=bad, token="t0k")
