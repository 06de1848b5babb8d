"""``kvbridge proxy``: a small prefill/decode proxy in front of two OpenAI-compatible vLLM servers.

For every ``POST /v1/completions`` or ``/v1/chat/completions``:

1. the request goes to a *prefill* server with ``kv_transfer_params={"do_remote_decode": true}``,
   ``max_tokens=1`` and ``stream=false``: it computes the prompt's KV, hands it to its connector, and
   answers with the ``kv_transfer_params`` a consumer needs (``null`` for stores, which find the KV
   by its block keys);
2. the *original* request goes to a *decode* server with those ``kv_transfer_params``; its answer —
   streamed (server-sent events, relayed chunk by chunk) or not — is the client's answer.

Several ``--prefill`` / ``--decode`` URLs are used round-robin. Every upstream call has a deadline
(``--timeout`` seconds without progress). **A prefill server that cannot be reached, times out or
answers 5xx costs latency, never the request**: the next prefill server is tried, and when none
answers, the request goes to the decode server without ``kv_transfer_params`` (it recomputes the
prompt) — counted in ``/metrics`` and logged once per request. ``--prefill-timeout`` (default: the
``--timeout``) bounds what a silent prefill server costs: a producer behind a cut link answers nothing at
all, and a request should not wait for the link longer than a recompute takes. A 4xx from the prefill server is the
client's own error and is passed through. A decode server that fails gives the client ``502`` with a
JSON error naming it. A client that goes away mid-answer is logged at debug level, no traceback.

Other routes, so the proxy stands in for a vLLM server (benchmark clients probe them): ``GET /health``,
``GET /v1/models``, ``POST /tokenize`` and ``/detokenize`` (forwarded to a decode server), and
``GET /metrics``: the proxy's own counters in Prometheus text format.

``--directory URL`` (``redis://HOST:PORT/DB`` or ``grpc://HOST:PORT``): cache-aware routing from what
the engines publish (:class:`~kvbridge.serving.routing.DirectoryView`). The proxy then asks an engine's
``/tokenize`` for each prompt's tokens (chat requests through the chat template, as the engine will)
and the directory who holds them: two calls on the request path, timed in ``/metrics``
(``tokenize_seconds``, ``directory_seconds``). ``--tokenizer PATH`` (the engines' tokenizer, loaded with
``transformers``) tokenizes completion prompts in the proxy instead, saving the first call (a round trip to
a busy engine); chat requests still go to ``/tokenize``, where the engine's chat template is.

Standard library only, but for the directory's client and ``--tokenizer``'s transformers.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvbridge.addresses import parse_host_port, parse_http_url
from kvbridge.errors import ConfigError
from kvbridge.serving.routing import POLICIES, DirectoryView, Held, MetricsPoller, Router
from kvbridge.serving.upstream import (
    LocalTokenizer,
    Upstream,
    UpstreamError,
    decode_request,
    prefill_request,
    tokenize_request,
)

log = logging.getLogger(__name__)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_POSTS = ("/tokenize", "/detokenize")  # answered by a decode server as they are
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade"}


class Metrics:
    """The proxy's counters and latency sums, as ``GET /metrics`` shows them (Prometheus text format)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def time(self, name: str, seconds: float) -> None:
        with self._lock:
            self.counts[f"{name}_count"] += 1
            self.seconds[name] += seconds

    def render(self) -> str:
        with self._lock:
            lines = []
            for name in sorted(self.counts):
                kind = "summary" if name.endswith("_count") else "counter"
                base = name.removesuffix("_count")
                if kind == "counter":
                    lines += [f"# TYPE kvbridge_proxy_{name}_total counter", f"kvbridge_proxy_{name}_total {self.counts[name]}"]
                else:
                    lines += [f"# TYPE kvbridge_proxy_{base}_seconds summary",
                              f"kvbridge_proxy_{base}_seconds_count {self.counts[name]}",
                              f"kvbridge_proxy_{base}_seconds_sum {self.seconds[base]:.6f}"]  # fmt: skip
            return "\n".join(lines) + "\n"


class ProxyServer(ThreadingHTTPServer):
    """The proxy's HTTP server: P/D (``prefill`` + ``decode`` pools) or plain ``replicas``, each pool routed
    by a :class:`~kvbridge.serving.routing.Router` under ``policy``."""

    daemon_threads = True

    def __init__(self, listen: tuple[str, int], prefill: Sequence[Upstream], decode: Sequence[Upstream],
                 replicas: Sequence[Upstream] = (), policy: str = "round-robin", poll_s: float = 1.0,
                 directory: str = "", tokenizer: str = ""):  # fmt: skip
        if policy not in POLICIES:
            raise ConfigError(f"proxy --policy must be one of {list(POLICIES)}, got {policy!r}")
        if replicas and (prefill or decode):
            raise ConfigError("the proxy takes either --replica servers or --prefill and --decode servers, not both")
        if not replicas and (not prefill or not decode):
            raise ConfigError("the proxy needs at least one prefill and one decode server (or --replica servers)")
        self.prefill_servers, self.decode_servers, self.replicas = list(prefill), list(decode), list(replicas)
        self.policy = policy
        # prefill engines (or replicas) hold the prompts' prefixes: they get the policy; decode engines get
        # their KV handed over, so only their load matters
        first = self.replicas or self.prefill_servers
        self.router = Router([u.url for u in first], policy)
        if directory and policy != "cache-aware":
            raise ConfigError(f"proxy --directory routes by cache: it needs --policy cache-aware, not {policy}")
        self.directory: DirectoryView | None = None
        if directory:
            from kvbridge.metadata.holdings import open_directory

            self.directory = DirectoryView(open_directory(directory), [u.url for u in first])
        if tokenizer and not directory:
            raise ConfigError("proxy --tokenizer is for --directory routing; give --directory too")
        self.tokenizer = LocalTokenizer(tokenizer) if tokenizer else None
        self.decode_router = Router([u.url for u in self.decode_servers] or ["-"],
                                    "round-robin" if policy == "round-robin" else "least-loaded")  # fmt: skip
        self.metrics = Metrics()
        self._pollers = [MetricsPoller(r, [u.metrics_text for u in ups], poll_s)
                         for r, ups in ((self.router, first), (self.decode_router, self.decode_servers))
                         if r.policy != "round-robin" and ups]  # fmt: skip
        if ":" in listen[0]:
            self.address_family = socket.AF_INET6
        try:
            super().__init__(listen, _Handler)
        except OSError as exc:
            raise ConfigError(f"proxy: cannot listen on {listen[0]}:{listen[1]}: {exc.strerror or exc}") from exc
        for poller in self._pollers:
            poller.start()

    def server_close(self) -> None:
        for poller in self._pollers:
            poller.stopped.set()
        if self.directory is not None:
            self.directory.directory.close()
        super().server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up is not an error worth a traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("client %s went away: %s", client_address, exc)
            self.metrics.count("client_disconnects")
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server: ProxyServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.info("%s %s", self.address_string(), format % args)

    # ---- routes --------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send_json(200, {"status": "ok"})
        elif path == "/metrics":
            self._send_bytes(200, self.server.metrics.render().encode(), "text/plain; version=0.0.4")
        elif path == "/v1/models":
            pool = self.server.replicas or self.server.decode_servers
            self._forward(lambda: pool[0].open("GET", "/v1/models"))
        else:
            self._send_json(404, {"error": {"message": f"no route {path}", "type": "not_found"}})

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        if path not in COMPLETION_PATHS and path not in FORWARDED_POSTS:
            self._send_json(404, {"error": {"message": f"no route {path}", "type": "not_found"}})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._send_json(400, {"error": {"message": "the request body must be a JSON object", "type": "invalid_request"}})
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "x-request-id")}
        srv = self.server
        self._route: str | None = None  # why the prefill went where it went (a keep-alive handler serves many)
        if path in FORWARDED_POSTS:  # tokenizers are the same everywhere: any server that decodes
            pool, router = (srv.replicas, srv.router) if srv.replicas else (srv.decode_servers, srv.decode_router)
            self._routed(pool, router, None, path, body, headers)
            return
        t0 = time.perf_counter()
        srv.metrics.count("requests")
        if srv.replicas:
            self._routed(srv.replicas, srv.router, body, path, body, headers)
            srv.metrics.time("request", time.perf_counter() - t0)
            return
        try:
            answer = self._prefill(path, body, headers)
        except UpstreamError as exc:  # the client's own error (4xx): it sees the server's answer
            srv.metrics.count("client_errors")
            self._send_error(exc)
            return
        srv.metrics.time("prefill", time.perf_counter() - t0)
        payload = decode_request(body, answer) if answer is not None else body
        self._routed(srv.decode_servers, srv.decode_router, None, path, payload, headers)
        srv.metrics.time("request", time.perf_counter() - t0)

    def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
        """The first prefill server's answer, in the router's order; ``None`` when every one failed (the
        decode server then recomputes the prompt). A 4xx is the client's error and is raised."""
        srv, failures, tried = self.server, [], list[int]()
        held = self._held(srv.prefill_servers, srv.router, body)
        while len(tried) < len(srv.prefill_servers):
            decision, keys = srv.router.pick(body, exclude=tried, held=held)
            tried.append(decision.index)
            srv.metrics.count(f"route_{decision.outcome}")
            try:
                answer = srv.prefill_servers[decision.index].post_json(path, prefill_request(body), headers)
            except UpstreamError as exc:
                srv.router.done(decision, keys, ok=exc.status < 500)
                if exc.status < 500:
                    raise
                failures.append(str(exc))
                srv.metrics.count("prefill_failures")
                continue
            srv.router.done(decision, keys, ok=True)
            self._route = decision.reason
            return answer
        srv.metrics.count("prefill_fallbacks")
        log.warning("every prefill server failed (%s); decoding without a hand-off (the prompt is recomputed)", "; ".join(failures))
        return None

    def _routed(self, pool: Sequence[Upstream], router: Router, route_body: dict[str, Any] | None, path: str,
                body: dict[str, Any], headers: dict[str, str]) -> None:  # fmt: skip
        """Send ``body`` to an upstream of ``pool`` chosen by ``router`` and relay its answer; one that fails
        before its first byte is ejected and the next one tried (a retry is safe: nothing reached the client)."""
        payload = json.dumps(body).encode()
        tried: list[int] = []
        last: UpstreamError | None = None
        held = self._held(pool, router, route_body) if route_body is not None and router is self.server.router else None
        while len(tried) < len(pool):
            decision, keys = router.pick(route_body, exclude=tried, held=held)
            tried.append(decision.index)
            if route_body is not None:
                self.server.metrics.count(f"route_{decision.outcome}")
            try:
                resp = pool[decision.index].open("POST", path, payload, {**headers, "Content-Type": "application/json"})
            except UpstreamError as exc:
                router.done(decision, keys, ok=False)
                self.server.metrics.count("upstream_failures")
                last = exc
                continue
            ok = resp.status < 500
            try:
                self._relay(resp, route=self._route or decision.reason)
            finally:
                router.done(decision, keys, ok=ok)
            return
        self.server.metrics.count("decode_failures")
        assert last is not None
        self._send_error(last)

    def _held(self, pool: Sequence[Upstream], router: Router, body: dict[str, Any]) -> Held | None:
        """What the directory says of this prompt (``None`` without a directory): tokenized by a live
        upstream of ``pool`` unless the client sent token ids."""
        view = self.server.directory
        if view is None:
            return None
        t0 = time.perf_counter()
        tokens = self._tokens(pool, router, body)
        t1 = time.perf_counter()
        held = view.held(tokens, str(body.get("model", "")), str(body.get("cache_salt") or ""))
        self.server.metrics.time("tokenize", t1 - t0)
        self.server.metrics.time("directory", time.perf_counter() - t1)
        return held

    def _tokens(self, pool: Sequence[Upstream], router: Router, body: dict[str, Any]) -> list[int] | None:
        request = tokenize_request(body)
        if request is None or isinstance(request, list):
            return request
        if self.server.tokenizer is not None:
            local = self.server.tokenizer(request)
            if local is not None:
                return local
        for i in router.live()[:2]:  # a second try where the first is down
            try:
                answer = pool[i].post_json("/tokenize", request, {})
            except UpstreamError as exc:
                log.debug("tokenize on %s: %s", pool[i].url, exc)
                continue
            tokens = answer.get("tokens")
            if isinstance(tokens, list):
                return [int(t) for t in tokens]
        self.server.metrics.count("tokenize_failures")
        return None

    def _forward(self, call: Callable[[], http.client.HTTPResponse]) -> None:
        try:
            self._relay(call())
        except UpstreamError as exc:
            self.server.metrics.count("decode_failures")
            self._send_error(exc)

    # ---- responses -----------------------------------------------------------------------------
    def _relay(self, resp: http.client.HTTPResponse, route: str | None = None) -> None:
        """Pass an upstream response on: as chunks when it streams, else whole; ``route`` says why it went there."""
        try:
            streaming = resp.getheader("Transfer-Encoding", "").lower() == "chunked" or resp.getheader("Content-Length") is None
            self.send_response(resp.status)
            if route:
                self.send_header("x-kvbridge-route", route)
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


def make_server(prefill: Sequence[str], decode: Sequence[str], listen: str = "127.0.0.1:8000", timeout: float = 300.0,
                *, replicas: Sequence[str] = (), policy: str = "round-robin", poll_s: float = 1.0,
                directory: str = "", tokenizer: str = "", prefill_timeout: float | None = None) -> ProxyServer:  # fmt: skip
    """A proxy bound to ``listen`` (``HOST:PORT``; port 0 picks a free one), not yet serving.
    ``prefill_timeout`` (default ``timeout``): how long a prefill server may stay silent before the request
    is decoded without a hand-off. Bad input raises :class:`~kvbridge.errors.ConfigError` naming it."""
    where = parse_host_port(listen, what="proxy --listen", allow_zero=True)
    return ProxyServer(
        (where.host, where.port),
        [Upstream(u, timeout if prefill_timeout is None else prefill_timeout) for u in prefill],
        [Upstream(u, timeout) for u in decode],
        [Upstream(u, timeout) for u in replicas],
        policy,
        poll_s,
        directory,
        tokenizer,
    )


def checked(parse: Callable[[str], Any]) -> Callable[[str], str]:
    """An argparse ``type`` that validates with ``parse`` and keeps the text (errors exit 2, no traceback)."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _directory_url(text: str) -> str:
    from kvbridge.metadata.holdings import check_directory_url

    return check_directory_url(text)


def configure(parser: argparse.ArgumentParser) -> None:
    url = checked(lambda t: parse_http_url(t, what="URL"))
    parser.add_argument("--prefill", action="append", default=[], type=url, metavar="URL", help="prefill server (repeatable)")
    parser.add_argument("--decode", action="append", default=[], type=url, metavar="URL", help="decode server (repeatable)")
    parser.add_argument("--replica", action="append", default=[], type=url, metavar="URL",
                        help="a plain (not disaggregated) server, instead of --prefill/--decode (repeatable)")
    parser.add_argument("--policy", choices=POLICIES, default="cache-aware",
                        help="how an upstream is picked (default %(default)s; see kvbridge.serving.routing)")
    parser.add_argument("--directory", default=None, metavar="URL", type=checked(_directory_url),
                        help="route cache-aware from what engines publish to this block directory "
                             "(redis://HOST:PORT/DB or grpc://HOST:PORT; each engine sets advertise_url)")  # fmt: skip
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="with --directory: tokenize completion prompts here with this Hugging Face tokenizer "
                             "(the engines'), instead of asking an engine's /tokenize")  # fmt: skip
    parser.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="where to listen (default %(default)s)",
                        type=checked(lambda t: parse_host_port(t, what="HOST:PORT", allow_zero=True)))  # fmt: skip
    parser.add_argument("--timeout", type=positive_seconds, default=300.0, help="seconds an upstream may stay silent (default %(default)s)")
    parser.add_argument("--prefill-timeout", type=positive_seconds, default=None, metavar="SECONDS",
                        help="seconds a prefill server may stay silent before the request is decoded without a "
                             "hand-off (recomputed); default: --timeout")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    server = make_server(args.prefill, args.decode, args.listen, args.timeout, replicas=args.replica, policy=args.policy,
                         directory=args.directory or "", tokenizer=args.tokenizer or "",
                         prefill_timeout=args.prefill_timeout)
    host, port = str(server.server_address[0]), int(server.server_address[1])
    upstreams = f"replicas={args.replica}" if args.replica else f"prefill={args.prefill} decode={args.decode}"
    where = f" directory={args.directory}" if args.directory else ""
    print(f"kvbridge proxy on http://{host}:{port}  {upstreams} policy={args.policy}{where}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


__all__ = ["COMPLETION_PATHS", "FORWARDED_POSTS", "Metrics", "ProxyServer", "Upstream", "UpstreamError", "configure", "decode_request", "make_server", "prefill_request", "run", "tokenize_request"]
