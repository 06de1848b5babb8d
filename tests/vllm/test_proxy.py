"""``kvbridge proxy`` against fake OpenAI-compatible upstreams (fast; the real servers are in test_api_server.py)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvbridge.vllm.proxy import make_server


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, role: str, **behaviour: Any):
        self.role, self.behaviour, self.requests = role, behaviour, []
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FakeHandler(BaseHTTPRequestHandler):
    server: FakeServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        b = self.server.behaviour
        time.sleep(b.get("delay", 0))
        if "status" in b:
            return self._send(b["status"], {"error": {"message": "bad request from fake"}})
        if self.server.role == "prefill":
            return self._send(200, {"choices": [{"text": "x"}], "kv_transfer_params": {"remote": "p1", "block_ids": [1, 2]}})
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                event = f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"5\r\ndata:\r\n0\r\n\r\n")
            return None
        return self._send(200, {"choices": [{"text": "decoded"}], "echo": body})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # the proxy gave up on us (the deadline test)
            pass


@pytest.fixture
def proxy_for() -> Iterator[Any]:
    servers: list[Any] = []

    def start(prefill: str, decode: str, timeout: float = 5.0) -> int:
        srv = make_server([prefill], [decode], "127.0.0.1:0", timeout)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return int(srv.server_address[1])

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def post(port: int, path: str, body: dict) -> tuple[int, bytes, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read(), resp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prefill_then_decode_with_params(proxy_for: Any, path: str) -> None:
    prefill, decode = FakeServer("prefill"), FakeServer("decode")
    port = proxy_for(prefill.url, decode.url)
    status, data, _ = post(port, path, {"prompt": "hi", "max_tokens": 20, "stream_options": {"include_usage": True}})
    assert status == 200
    (p_path, p_body), (d_path, d_body) = prefill.requests[0], decode.requests[0]
    assert p_path == d_path == path
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False and "stream_options" not in p_body
    assert d_body == {"prompt": "hi", "max_tokens": 20, "stream_options": {"include_usage": True},
                      "kv_transfer_params": {"remote": "p1", "block_ids": [1, 2]}}  # fmt: skip
    assert json.loads(data)["choices"][0]["text"] == "decoded"


def test_stream_passes_through_chunked(proxy_for: Any) -> None:
    port = proxy_for(FakeServer("prefill").url, FakeServer("decode").url)
    status, data, resp = post(port, "/v1/completions", {"prompt": "hi", "stream": True})
    assert status == 200 and resp.getheader("Transfer-Encoding") == "chunked"
    assert resp.getheader("Content-Type") == "text/event-stream"
    events = [line for line in data.decode().split("\n") if line.startswith("data:")]
    assert [json.loads(e[5:])["choices"][0]["text"] for e in events[:3]] == ["t0", "t1", "t2"]


def test_unreachable_prefill_is_502(proxy_for: Any) -> None:
    decode = FakeServer("decode")
    port = proxy_for(f"http://127.0.0.1:{free_port()}", decode.url)
    status, data, _ = post(port, "/v1/completions", {"prompt": "hi"})
    assert status == 502
    err = json.loads(data)["error"]
    assert err["type"] == "bad_gateway" and "127.0.0.1" in err["upstream"] and "ConnectionRefused" in err["message"]
    assert decode.requests == []


def test_silent_decode_hits_the_deadline(proxy_for: Any) -> None:
    port = proxy_for(FakeServer("prefill").url, FakeServer("decode", delay=3).url, timeout=0.5)
    t0 = time.monotonic()
    status, data, _ = post(port, "/v1/completions", {"prompt": "hi"})
    assert status == 502 and "timed out" in json.loads(data)["error"]["message"]
    assert time.monotonic() - t0 < 2.5


def test_upstream_errors(proxy_for: Any) -> None:
    port = proxy_for(FakeServer("prefill", status=400).url, FakeServer("decode").url)
    status, data, _ = post(port, "/v1/completions", {"prompt": "hi"})
    assert status == 400 and json.loads(data)["error"]["message"] == "bad request from fake"  # the client's fault
    port = proxy_for(FakeServer("prefill", status=500).url, FakeServer("decode").url)
    status, data, _ = post(port, "/v1/completions", {"prompt": "hi"})
    assert status == 502 and "answered 500" in json.loads(data)["error"]["message"]


def test_routes(proxy_for: Any) -> None:
    port = proxy_for(FakeServer("prefill").url, FakeServer("decode").url)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    status, _, _ = post(port, "/v1/embeddings", {})
    assert status == 404
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/v1/completions", b"[1, 2]", {"Content-Type": "application/json"})
    assert conn.getresponse().status == 400
