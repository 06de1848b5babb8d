"""The metadata client and server inside one process: retries until a server comes up, deadlines, a
closed client, several embedded servers, listen addresses parsed strictly; the standalone server's command
line refusals; the committed stubs and the status-code map. (Across processes: tests/test_metadata.py.)
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from metakit import CONSUMER, PRODUCER, hashes_of

from kvbridge import errors
from kvbridge.metadata import wire
from kvbridge.metadata.client import MetadataClient
from kvbridge.metadata.server import MetadataServer
from kvbridge.metadata.types import DirectoryEntry


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
            assert client.lookup(hashes_of("x")) == []
    finally:
        server.stop(0)
    t0 = time.monotonic()
    with MetadataClient(f"127.0.0.1:{port}", retries=2, backoff_s=0.05) as client:
        with pytest.raises(errors.PeerUnreachable, match="UNAVAILABLE"):
            client.lookup(hashes_of("x"))
    assert time.monotonic() - t0 >= 0.07  # two backoffs (>= half of 0.05 and 0.1 each) were waited


def test_deadline_becomes_transfer_timeout(serve: Callable[..., MetadataServer]) -> None:
    server = serve(on_handshake=lambda p: time.sleep(1.0) or PRODUCER)
    with MetadataClient(server.address, timeout=0.2, retries=0) as client:
        with pytest.raises(errors.TransferTimeout, match="DEADLINE_EXCEEDED"):
            client.handshake(CONSUMER)


def test_closed_client_raises_closed_error(serve: Callable[..., MetadataServer]) -> None:
    client = MetadataClient(serve().address)
    client.close()
    client.close()
    with pytest.raises(errors.ClosedError):
        client.lookup([])


def test_several_embedded_servers_per_process(serve: Callable[..., MetadataServer]) -> None:
    a, b = serve(), serve(on_handshake=lambda p: PRODUCER)
    assert a.port != b.port
    with MetadataClient(a.address) as ca, MetadataClient(b.address) as cb:
        ca.publish("x", hashes_of("1"), ttl_s=10)
        assert ca.lookup(hashes_of("1")) == [DirectoryEntry("x", 1)] and cb.lookup(hashes_of("1")) == []  # own directories
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

