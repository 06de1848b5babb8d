"""The gRPC metadata protocol, end to end: real servers on 127.0.0.1, clients in other processes.

Three child processes serve the whole module (each pays one import of torch, so they start together):
a standalone ``kvbridge metadata-server`` (directory, health, reflection), a second one that the
SIGTERM test stops, and a *peer*: a Python process that runs :class:`MetadataClient` calls sent to it
as JSON lines and answers with results or kvbridge exception names. Embedded servers run in this
process, so their callbacks can be observed; the security tests (token, TLS) share the peer process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge import errors
from kvbridge.layout import LayoutFingerprint
from kvbridge.metadata import wire
from kvbridge.metadata.client import MetadataClient
from kvbridge.metadata.directory import Directory
from kvbridge.metadata.server import MetadataServer
from kvbridge.metadata.types import PROTOCOL_VERSION, DirectoryEntry, PeerInfo
from kvbridge.v1 import metadata_pb2 as pb

FP = LayoutFingerprint("float16", 2, 4, 64, 16, 16384, "blocks_first")
PRODUCER = PeerInfo("prefill-0", 0, FP, {"ucx_worker_address": b"\x00\xffworker", "ucx_listener": b"127.0.0.1:1"})
CONSUMER = PeerInfo("decode-0", 1, FP, {"ucx_worker_address": b"\x01consumer"})
MAX_HASHES = 64  # the standalone servers' --max-hashes: small, so the fuzzer reaches the limit cheaply
MAX_MESSAGE = 1 << 16

# ---- the peer process: MetadataClient calls over JSON lines -----------------------------------------

PEER_SCRIPT = r"""
import json, sys
from kvbridge import errors
from kvbridge.layout import LayoutFingerprint
from kvbridge.metadata.client import MetadataClient
from kvbridge.metadata.types import DirectoryEntry, PeerInfo
from kvbridge.metadata.wire import ClientTLS

def decode(d):
    if set(d) == {"b"}:
        return bytes.fromhex(d["b"])
    if set(d) == {"peer"}:
        p = d["peer"]
        return PeerInfo(p["engine_id"], p["rank"], LayoutFingerprint.from_json(p["fingerprint"]),
                        p["transport"], p["protocol_version"])
    return d

def encode(v):
    if isinstance(v, PeerInfo):
        return {"peer": {"engine_id": v.engine_id, "rank": v.rank, "fingerprint": v.fingerprint.to_json(),
                         "transport": {k: {"b": x.hex()} for k, x in v.transport.items()},
                         "protocol_version": v.protocol_version}}
    if isinstance(v, DirectoryEntry):
        return [v.holder, v.num_blocks, v.address]
    raise TypeError(type(v))

print("ready", flush=True)
for line in sys.stdin:
    cmd = json.loads(line, object_hook=decode)
    tls = None if cmd["tls"] is None else ClientTLS(**cmd["tls"])
    try:
        with MetadataClient(cmd["address"], token=cmd["token"], tls=tls, timeout=cmd["timeout"],
                            retries=cmd["retries"]) as client:
            out = {"ok": getattr(client, cmd["method"])(*cmd["args"], **cmd["kwargs"])}
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out, default=encode), flush=True)
"""


def _encode(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"b": v.hex()}
    if isinstance(v, PeerInfo):
        return {"peer": {"engine_id": v.engine_id, "rank": v.rank, "fingerprint": v.fingerprint.to_json(),
                         "transport": {k: {"b": x.hex()} for k, x in v.transport.items()},
                         "protocol_version": v.protocol_version}}
    raise TypeError(type(v))


def _decode(d: dict[str, Any]) -> Any:
    if set(d) == {"b"}:
        return bytes.fromhex(d["b"])
    if set(d) == {"peer"}:
        p = d["peer"]
        return PeerInfo(p["engine_id"], p["rank"], LayoutFingerprint.from_json(p["fingerprint"]), p["transport"],
                        p["protocol_version"])
    return d


class Peer:
    """A client in another process: ``peer.call(address, "lookup", hashes)`` returns or raises like MetadataClient."""

    def __init__(self, proc: subprocess.Popen[str]):
        self.proc = proc
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        assert self._next(120) == "ready"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def _next(self, timeout: float) -> str:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"peer process silent for {timeout} s") from None

    def call(self, target: str, method: str, /, *args: Any, token: str | None = None, tls: dict[str, Any] | None = None,
             timeout: float = 5.0, retries: int = 0, **kwargs: Any) -> Any:
        cmd = {"address": target, "method": method, "args": list(args), "kwargs": kwargs, "token": token,
               "tls": tls, "timeout": timeout, "retries": retries}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd, default=_encode) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self._next(60), object_hook=_decode)
        if "error" in out:
            raise getattr(errors, out["error"], RuntimeError)(out["message"])
        return out["ok"]


def _spawn(*args: str, **env_vars: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_vars}
    return subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _server_cmd(*extra: str) -> tuple[str, ...]:
    return ("-m", "kvbridge.cli", "metadata-server", "--listen", "127.0.0.1:0", "--max-hashes", str(MAX_HASHES),
            "--max-message-bytes", str(MAX_MESSAGE), "--grace", "2", *extra)


def _listening(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()  # the contract: the first stdout line names the address
    assert line.startswith("listening on 127.0.0.1:"), line
    return line.removeprefix("listening on ")


@pytest.fixture(scope="module")
def children() -> Iterator[dict[str, Any]]:
    procs = {"standalone": _spawn(*_server_cmd()), "doomed": _spawn(*_server_cmd(), KVBRIDGE_METADATA_TOKEN="env-token"), "peer": _spawn("-c", PEER_SCRIPT)}
    try:
        yield {"standalone": _listening(procs["standalone"]), "doomed": (procs["doomed"], _listening(procs["doomed"])),
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


@pytest.fixture
def serve() -> Iterator[Callable[..., MetadataServer]]:
    """Start embedded servers in this process; all are stopped at the end of the test."""
    started: list[MetadataServer] = []

    def start(**kwargs: Any) -> MetadataServer:
        server = MetadataServer(**kwargs)
        server.start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop(0)


def _h(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


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
    peer.call(standalone, "publish", "engine-a", _h("a1", "a2", "a3", "a4"), ttl_s=60, address="10.0.0.1:7")
    with MetadataClient(standalone) as client:
        client.publish("engine-b", _h("a1", "a2"), ttl_s=60)
        client.publish("engine-c", _h("a1", "a3"), ttl_s=60)  # a gap: only its first block counts
        assert client.lookup(_h("a1", "a2", "a3", "x")) == [
            DirectoryEntry("engine-a", 3, "10.0.0.1:7"), DirectoryEntry("engine-b", 2), DirectoryEntry("engine-c", 1),
        ]
        assert client.lookup(_h("zz")) == [] and client.lookup([]) == []
        client.unpublish("engine-a", _h("a2"))
        assert client.lookup(_h("a1", "a2"))[0] == DirectoryEntry("engine-b", 2)
    peer.call(standalone, "unpublish", "engine-b")
    assert peer.call(standalone, "lookup", _h("a1")) == [["engine-a", 1, "10.0.0.1:7"], ["engine-c", 1, ""]]
    for holder in ("engine-a", "engine-c"):
        peer.call(standalone, "unpublish", holder)
    assert peer.call(standalone, "lookup", _h("a1")) == []


def test_directory_entries_of_a_silent_holder_expire(standalone: str) -> None:
    with MetadataClient(standalone) as client:
        client.publish("mortal", _h("e1", "e2"), ttl_s=0.4)
        client.publish("kept", _h("e1"), ttl_s=0.4)
        assert [e.holder for e in client.lookup(_h("e1"))] == ["kept", "mortal"]
        time.sleep(0.25)
        assert client.heartbeat("kept", 0.4)
        time.sleep(0.25)  # mortal's lease is over, kept's was renewed
        assert client.lookup(_h("e1", "e2")) == [DirectoryEntry("kept", 1)]
        assert not client.heartbeat("mortal", 0.4)  # the holder learns that it must publish again
        client.unpublish("kept")


def test_directory_unit_semantics() -> None:
    now = [0.0]
    d = Directory(max_holders=2, max_hashes_per_holder=3, clock=lambda: now[0])
    d.publish("a", _h("1", "2", "3"), ttl_s=10)
    d.publish("a", _h("1", "4"), ttl_s=10)  # re-publishing "1" makes it newest; "2" is now the oldest, evicted
    assert d.holders() == {"a": 3}
    assert d.lookup(_h("1", "2")) == [DirectoryEntry("a", 1)] and d.lookup(_h("3", "4")) == [DirectoryEntry("a", 2)]
    d.publish("b", [], ttl_s=5, address="b:1")  # registers with no hashes
    with pytest.raises(errors.StoreFull):
        d.publish("c", _h("1"), ttl_s=5)
    now[0] = 5.0  # leases end at their deadline exactly
    assert d.holders() == {"a": 3}
    d.publish("c", _h("1"), ttl_s=5)
    assert not d.heartbeat("b", ttl_s=5) and d.heartbeat("a", ttl_s=1)
    now[0] = 6.0
    assert d.lookup(_h("1")) == [DirectoryEntry("c", 1)]
    d.unpublish("c", _h("9"))
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


# ---- client behaviour -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_idempotent_calls_retry_until_the_server_comes_up() -> None:
    port = _free_port()
    server = MetadataServer(f"127.0.0.1:{port}")
    threading.Timer(0.3, server.start).start()
    try:
        with MetadataClient(f"127.0.0.1:{port}", retries=8, backoff_s=0.05, max_backoff_s=0.2) as client:
            assert client.lookup(_h("x")) == []
    finally:
        server.stop(0)
    t0 = time.monotonic()
    with MetadataClient(f"127.0.0.1:{port}", retries=2, backoff_s=0.05) as client:
        with pytest.raises(errors.PeerUnreachable, match="UNAVAILABLE"):
            client.lookup(_h("x"))
    assert time.monotonic() - t0 >= 0.07  # two backoffs (>= half of 0.05 and 0.1 each) were waited


def test_deadline_becomes_transfer_timeout(serve: Callable[..., MetadataServer]) -> None:
    server = serve(on_handshake=lambda p: time.sleep(1.0) or PRODUCER)
    with MetadataClient(server.address, timeout=0.2, retries=0) as client:
        with pytest.raises(errors.TransferTimeout, match="DEADLINE_EXCEEDED"):
            client.handshake(CONSUMER)


def test_closed_client_raises_closed_error(standalone: str) -> None:
    client = MetadataClient(standalone)
    client.close()
    client.close()
    with pytest.raises(errors.ClosedError):
        client.lookup([])


def test_several_embedded_servers_per_process(serve: Callable[..., MetadataServer]) -> None:
    a, b = serve(), serve(on_handshake=lambda p: PRODUCER)
    assert a.port != b.port
    with MetadataClient(a.address) as ca, MetadataClient(b.address) as cb:
        ca.publish("x", _h("1"), ttl_s=10)
        assert ca.lookup(_h("1")) == [DirectoryEntry("x", 1)] and cb.lookup(_h("1")) == []  # own directories
        a.stop(0)
        assert not ca.health() and cb.handshake(CONSUMER) == PRODUCER


def test_listening_on_a_taken_port_is_a_config_error(serve: Callable[..., MetadataServer]) -> None:
    taken = serve()
    with pytest.raises(errors.ConfigError, match="cannot listen"):
        MetadataServer(taken.address).start()


@pytest.mark.parametrize("listen,message", [("127.0.0.1:99999", "out of range"), ("127.0.0.1", "expected HOST:PORT"),
                                            ("[127.0.0.1]:0", "not an IPv6"), (":5000", "expected HOST:PORT")])
def test_a_listen_address_is_parsed_strictly(listen: str, message: str) -> None:
    """A port that would wrap (99999 -> 34463) or a missing one (-> :443) is refused, never guessed."""
    with pytest.raises(errors.ConfigError, match=message):
        MetadataServer(listen)


def test_an_ipv6_listener_reports_its_address(serve: Callable[..., MetadataServer]) -> None:
    try:
        server = serve(listen="[::1]:0")
    except errors.ConfigError as exc:  # a machine without IPv6 loopback
        pytest.skip(str(exc))
    assert server.address == f"[::1]:{server.port}"


# ---- the standalone process -------------------------------------------------------------------------

def test_cli_refuses_a_bad_listen_address_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from kvbridge.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["metadata-server", "--listen", "127.0.0.1:99999"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "port 99999" in err and "Traceback" not in err


def test_cli_refuses_bad_options_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    from kvbridge.cli import main

    assert main(["metadata-server", "--tls-cert", "x.pem"]) == 2
    out = capsys.readouterr()
    assert "--tls-cert and --tls-key go together" in out.err and not out.out


def test_sigterm_stops_the_standalone_server_gracefully(children: dict[str, Any]) -> None:
    proc, address = children["doomed"]
    with MetadataClient(address, token="env-token") as client:
        client.publish("p", _h("1"), ttl_s=10)
        with pytest.raises(errors.Unauthorized), MetadataClient(address) as tokenless:
            tokenless.lookup(_h("1"))  # the token came from $KVBRIDGE_METADATA_TOKEN
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert proc.stdout.read().strip().splitlines()[-1] == "stopped"
        assert not client.health()


def test_codegen_stubs_are_current() -> None:
    from kvbridge.metadata import codegen

    if codegen.generator_version(sys.executable).rsplit(".", 1)[0] != codegen.GENERATOR:
        pytest.skip(f"needs grpcio-tools=={codegen.GENERATOR}.*")
    assert codegen.main(["--check"]) == 0


def test_wire_maps_status_codes() -> None:
    assert wire.status_of(wire.Invalid("x"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert wire.status_of(errors.LayoutMismatch("x")) == (grpc.StatusCode.FAILED_PRECONDITION, "layout_mismatch")
    assert wire.status_of(errors.Unauthorized("x"))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert wire.status_of(KeyError("x"))[0] == grpc.StatusCode.INTERNAL
    with pytest.raises(errors.ProtocolError, match="protocol_version differs"):
        wire.check_compatible(PRODUCER, dataclasses.replace(CONSUMER, protocol_version=7))


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
