"""``kvbridge proxy``: a small prefill/decode proxy in front of two OpenAI-compatible vLLM servers.

For every ``POST /v1/completions`` or ``/v1/chat/completions``:

1. the request goes to a *prefill* server with ``kv_transfer_params={"do_remote_decode": true}``,
   ``max_tokens=1`` and ``stream=false``: it computes the prompt's KV, hands it to its connector, and
   answers with the ``kv_transfer_params`` a consumer needs (``null`` for stores, which find the KV
   by its block keys);
2. the *original* request goes to a *decode* server with those ``kv_transfer_params``; its answer —
   streamed (server-sent events, relayed chunk by chunk) or not — is the client's answer.

Several ``--prefill`` / ``--decode`` URLs are used round-robin. Every upstream call has a deadline
(``--timeout`` seconds without progress). An upstream that cannot be reached, times out or answers
5xx gives the client ``502`` with a JSON error naming that upstream; a 4xx from the prefill server is
the client's own error and is passed through. Standard library only: the proxy adds no dependency.

``GET /health`` answers 200; ``GET /v1/models`` is forwarded to a decode server.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade"}


class UpstreamError(Exception):
    """An upstream call failed: unreachable, timed out, or answered with an error status."""

    def __init__(self, url: str, message: str, status: int = 502, body: bytes = b""):
        super().__init__(f"{url}: {message}")
        self.url, self.status, self.body = url, status, body


class Upstream:
    """One OpenAI-compatible server, given by its base URL (``http://host:port[/prefix]``)."""

    def __init__(self, url: str, timeout: float):
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout

    def open(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
        """Send a request and return the response once its headers arrived (the body is unread)."""
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, self.prefix + path, body=body, headers=headers or {})
            return conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise UpstreamError(self.url, f"{type(exc).__name__}: {exc}") from exc

    def post_json(self, path: str, payload: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """POST ``payload``; the decoded JSON answer. Errors -> :class:`UpstreamError`."""
        resp = self.open("POST", path, json.dumps(payload).encode(), {**headers, "Content-Type": "application/json"})
        try:
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise UpstreamError(self.url, f"reading the answer: {exc}") from exc
        finally:
            resp.close()
        if resp.status >= 500:
            raise UpstreamError(self.url, f"answered {resp.status}: {body[:500].decode(errors='replace')}")
        if resp.status >= 400:  # the client's request was bad: let the client see the server's answer
            raise UpstreamError(self.url, f"answered {resp.status}", status=resp.status, body=body)
        try:
            answer = json.loads(body)
        except ValueError as exc:
            raise UpstreamError(self.url, f"answered non-JSON: {body[:200]!r}") from exc
        if not isinstance(answer, dict):
            raise UpstreamError(self.url, "answered JSON that is not an object")
        return answer


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: one token, no streaming, a hand-off requested."""
    req = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    req.update(kv_transfer_params={"do_remote_decode": True}, max_tokens=1, stream=False)
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    return req


def decode_request(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The original request, with the prefill server's ``kv_transfer_params`` attached."""
    params = prefill_answer.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params is not None else dict(body)


class ProxyServer(ThreadingHTTPServer):
    """The proxy's HTTP server; ``prefill``/``decode`` are picked round-robin per request."""

    daemon_threads = True

    def __init__(self, listen: tuple[str, int], prefill: Sequence[Upstream], decode: Sequence[Upstream]):
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode server")
        self.prefill_servers, self.decode_servers = list(prefill), list(decode)
        self._prefill: Iterator[Upstream] = itertools.cycle(self.prefill_servers)
        self._decode: Iterator[Upstream] = itertools.cycle(self.decode_servers)
        self._lock = threading.Lock()
        super().__init__(listen, _Handler)

    def pick(self) -> tuple[Upstream, Upstream]:
        with self._lock:
            return next(self._prefill), next(self._decode)


class _Handler(BaseHTTPRequestHandler):
    server: ProxyServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.info("%s %s", self.address_string(), format % args)

    # ---- routes --------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            self._send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            _, decode = self.server.pick()
            try:
                self._relay(decode.open("GET", "/v1/models"))
            except UpstreamError as exc:
                self._send_error(exc)
        else:
            self._send_json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        if path not in COMPLETION_PATHS:
            self._send_json(404, {"error": {"message": f"no route {path}", "type": "not_found"}})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._send_json(400, {"error": {"message": "the request body must be a JSON object", "type": "invalid_request"}})
            return
        prefill, decode = self.server.pick()
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "x-request-id")}
        try:
            answer = prefill.post_json(path, prefill_request(body), headers)
            payload = json.dumps(decode_request(body, answer)).encode()
            self._relay(decode.open("POST", path, payload, {**headers, "Content-Type": "application/json"}))
        except UpstreamError as exc:
            self._send_error(exc)

    # ---- responses -----------------------------------------------------------------------------
    def _relay(self, resp: http.client.HTTPResponse) -> None:
        """Pass an upstream response on: as chunks when it streams, else whole."""
        try:
            streaming = resp.getheader("Transfer-Encoding", "").lower() == "chunked" or resp.getheader("Content-Length") is None
            self.send_response(resp.status)
            for key, value in resp.getheaders():
                if key.lower() not in _HOP_BY_HOP:
                    self.send_header(key, value)
            if not streaming:
                data = resp.read()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                try:
                    piece = resp.read1(65536)
                except (OSError, http.client.HTTPException) as exc:  # headers are out: all we can do is stop
                    log.warning("decode stream broke: %s", exc)
                    self.close_connection = True
                    return
                if not piece:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            resp.close()

    def _send_error(self, exc: UpstreamError) -> None:
        if exc.status < 500 and exc.body:
            self._send_bytes(exc.status, exc.body, "application/json")
            return
        log.warning("upstream failed: %s", exc)
        self._send_json(502, {"error": {"message": f"upstream failed: {exc}", "type": "bad_gateway", "upstream": exc.url}})

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        self._send_bytes(status, json.dumps(payload).encode(), "application/json")

    def _send_bytes(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def make_server(prefill: Sequence[str], decode: Sequence[str], listen: str = "127.0.0.1:8000", timeout: float = 300.0) -> ProxyServer:
    """A proxy bound to ``listen`` (``HOST:PORT``; port 0 picks a free one), not yet serving."""
    host, _, port = listen.rpartition(":")
    return ProxyServer(
        (host or "127.0.0.1", int(port)),
        [Upstream(u, timeout) for u in prefill],
        [Upstream(u, timeout) for u in decode],
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", required=True, metavar="URL", help="prefill server (repeatable)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL", help="decode server (repeatable)")
    parser.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="where to listen (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds an upstream may stay silent (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    server = make_server(args.prefill, args.decode, args.listen, args.timeout)
    host, port = str(server.server_address[0]), int(server.server_address[1])
    print(f"kvbridge proxy on http://{host}:{port}  prefill={args.prefill} decode={args.decode}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


__all__ = ["COMPLETION_PATHS", "ProxyServer", "Upstream", "UpstreamError", "configure", "decode_request", "make_server", "prefill_request", "run"]
