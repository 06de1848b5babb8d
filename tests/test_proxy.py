"""``kvbridge proxy`` against stand-in OpenAI-compatible upstreams (fast; the real vLLM servers are in
tests/vllm/test_api_server.py). The stand-ins are tiny HTTP servers: what is tested is the proxy's own
routing, fallbacks, deadlines, validation and metrics, over real sockets."""

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

from kvbridge import cli
from kvbridge.errors import ConfigError
from kvbridge.keys import ROUTE_TOKENS, route_keys
from kvbridge.metadata.holdings import Holdings, open_directory
from kvbridge.serving.proxy import make_server
from kvbridge.testing.services import RedisServer, eventually, held_depth


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, role: str, **behaviour: Any):
        self.role, self.behaviour, self.requests = role, behaviour, []
        self.tokenized = 0
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the proxy hung up on this stand-in (deadline and disconnect tests): not what is tested


class _FakeHandler(BaseHTTPRequestHandler):
    server: FakeServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/metrics":  # what vLLM's page says of its queue, as far as the router reads it
            running = self.server.behaviour.get("running", 0)
            text = f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"m\"}} {running}\n"
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._send(404, {"error": {"message": "no such route"}})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        b = self.server.behaviour
        time.sleep(b.get("delay", 0))
        if "status" in b:
            return self._send(b["status"], {"error": {"message": "bad request from fake"}})
        if self.path == "/tokenize" and b.get("tokenizer"):  # a byte tokenizer: a token per UTF-8 byte of the prompt (or messages)
            text = body.get("prompt") if "prompt" in body else json.dumps(body.get("messages"))
            tokens = list(str(text).encode())
            self.server.tokenized += 1
            return self._send(200, {"tokens": tokens, "count": len(tokens), "max_model_len": 4096})
        if self.server.role == "replica":
            return self._send(200, {"choices": [{"text": f"from {self.server.url}"}]})
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
def started() -> Iterator[Any]:
    """``start(*make_server args) -> port``: a proxy serving on a thread, shut down after the test."""
    servers: list[Any] = []

    def start(*args: Any, **kwargs: Any) -> int:
        srv = make_server(*args, **kwargs)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return int(srv.server_address[1])

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def proxy_for(started: Any) -> Any:
    def start(prefill: str | list[str], decode: str, timeout: float = 5.0) -> int:
        return int(started(prefill if isinstance(prefill, list) else [prefill], [decode], "127.0.0.1:0", timeout))

    return start


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


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, resp.read()


def metrics(port: int) -> dict[str, float]:
    status, data = get(port, "/metrics")
    assert status == 200
    return {k: float(v) for k, v in (line.split() for line in data.decode().splitlines() if not line.startswith("#"))}


def test_dead_prefill_costs_latency_not_the_request(proxy_for: Any) -> None:
    """No prefill server answers: the decode server gets the original request (no hand-off) and recomputes."""
    decode = FakeServer("decode")
    port = proxy_for(f"http://127.0.0.1:{free_port()}", decode.url)
    status, data, _ = post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 5})
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "decoded"
    assert decode.requests == [("/v1/completions", {"prompt": "hi", "max_tokens": 5})]  # no kv_transfer_params
    m = metrics(port)
    assert m["kvbridge_proxy_prefill_failures_total"] == 1 and m["kvbridge_proxy_prefill_fallbacks_total"] == 1


def test_a_failing_prefill_server_is_skipped_for_the_next(proxy_for: Any) -> None:
    broken, good, decode = FakeServer("prefill", status=500), FakeServer("prefill"), FakeServer("decode")
    port = proxy_for([broken.url, good.url], decode.url)
    for _ in range(2):  # round-robin starts once at each: both requests end on the good one
        status, _, _ = post(port, "/v1/completions", {"prompt": "hi"})
        assert status == 200
    assert len(good.requests) == 2 and len(broken.requests) == 1
    assert all(body["kv_transfer_params"] == {"remote": "p1", "block_ids": [1, 2]} for _, body in decode.requests)
    m = metrics(port)
    assert m["kvbridge_proxy_requests_total"] == 2 and m["kvbridge_proxy_prefill_failures_total"] == 1
    assert "kvbridge_proxy_prefill_fallbacks_total" not in m
    assert m["kvbridge_proxy_request_seconds_count"] == 2 and m["kvbridge_proxy_request_seconds_sum"] > 0


def test_silent_decode_hits_the_deadline(proxy_for: Any) -> None:
    port = proxy_for(FakeServer("prefill").url, FakeServer("decode", delay=3).url, timeout=0.5)
    t0 = time.monotonic()
    status, data, _ = post(port, "/v1/completions", {"prompt": "hi"})
    assert status == 502 and "timed out" in json.loads(data)["error"]["message"]
    assert time.monotonic() - t0 < 2.5


def test_a_silent_prefill_costs_the_prefill_timeout_not_the_request(started: Any) -> None:
    """A producer behind a cut link answers nothing: after ``prefill_timeout`` (not the decode's ``timeout``)
    the request is decoded without a hand-off."""
    prefill, decode = FakeServer("prefill", delay=3), FakeServer("decode")
    port = int(started([prefill.url], [decode.url], "127.0.0.1:0", 30.0, prefill_timeout=0.5))
    t0 = time.monotonic()
    status, data, _ = post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 5})
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "decoded"
    assert time.monotonic() - t0 < 2.5
    assert decode.requests == [("/v1/completions", {"prompt": "hi", "max_tokens": 5})]  # no kv_transfer_params
    assert metrics(port)["kvbridge_proxy_prefill_fallbacks_total"] == 1


def test_upstream_errors(proxy_for: Any) -> None:
    port = proxy_for(FakeServer("prefill", status=400).url, FakeServer("decode").url)
    status, data, _ = post(port, "/v1/completions", {"prompt": "hi"})
    assert status == 400 and json.loads(data)["error"]["message"] == "bad request from fake"  # the client's fault
    port = proxy_for(FakeServer("prefill").url, FakeServer("decode", status=500).url)
    status, data, _ = post(port, "/v1/completions", {"prompt": "hi"})
    assert status == 500 and json.loads(data)["error"]["message"] == "bad request from fake"  # the decode's own answer


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


def test_tokenize_and_detokenize_go_to_a_decode_server(proxy_for: Any) -> None:
    prefill, decode = FakeServer("prefill"), FakeServer("decode")
    port = proxy_for(prefill.url, decode.url)
    for path in ("/tokenize", "/detokenize"):
        status, data, _ = post(port, path, {"prompt": "hi"})
        assert status == 200 and json.loads(data)["echo"] == {"prompt": "hi"}
    assert [p for p, _ in decode.requests] == ["/tokenize", "/detokenize"] and prefill.requests == []


def test_a_client_that_hangs_up_leaves_no_traceback(proxy_for: Any, capfd: pytest.CaptureFixture[str]) -> None:
    port = proxy_for(FakeServer("prefill").url, FakeServer("decode", delay=0.5).url)
    with socket.create_connection(("127.0.0.1", port)) as s:
        body = json.dumps({"prompt": "hi", "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    time.sleep(1.5)  # the decode answer arrives for a client that is gone
    assert get(port, "/health")[0] == 200, "the proxy still serves"
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize(
    "listen,prefill,message",
    [
        ("127.0.0.1:99999", "http://127.0.0.1:1", "port 99999"),
        ("127.0.0.1", "http://127.0.0.1:1", "expected HOST:PORT"),
        ("127.0.0.1:0", "foo", "not a URL"),
        ("127.0.0.1:0", "ftp://127.0.0.1:21", "not an http"),
        ("127.0.0.1:0", "http://127.0.0.1:70000", "no usable"),
    ],
)
def test_bad_addresses_are_named_errors(listen: str, prefill: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_server([prefill], ["http://127.0.0.1:2"], listen)


@pytest.mark.parametrize(
    "argv",
    [
        ["proxy", "--prefill", "foo", "--decode", "http://127.0.0.1:2"],
        ["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--listen", "127.0.0.1:99999"],
        ["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--listen", "127.0.0.1"],
        ["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--timeout", "0"],
        ["proxy", "--replica", "http://127.0.0.1:1", "--directory", "127.0.0.1:6379"],
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_cli_defaults_parse() -> None:
    """Every default passes its own check (argparse runs ``type`` on string defaults too)."""
    import argparse

    from kvbridge.serving import proxy

    parser = argparse.ArgumentParser()
    proxy.configure(parser)
    args = parser.parse_args(["--replica", "http://127.0.0.1:1"])
    assert args.directory is None and args.policy == "cache-aware" and args.listen == "127.0.0.1:8000"
    assert args.prefill_timeout is None and parser.parse_args(["--replica", "h:1", "--prefill-timeout", "5"]).prefill_timeout == 5
    assert parser.parse_args(["--replica", "h:1", "--directory", "redis://127.0.0.1:1/0"]).directory == "redis://127.0.0.1:1/0"


def test_listen_on_a_port_in_use_is_a_named_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ConfigError, match="cannot listen"):
            make_server(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], f"127.0.0.1:{s.getsockname()[1]}")


# ---- routing -------------------------------------------------------------------------------------------

@pytest.fixture
def replicas_proxy(started: Any) -> Any:
    def start(urls: list[str], policy: str, poll_s: float = 0.05) -> int:
        return int(started([], [], "127.0.0.1:0", 5.0, replicas=urls, policy=policy, poll_s=poll_s))

    return start


def _ask(port: int, prompt: str) -> tuple[str, str]:
    """(which replica answered, the proxy's routing reason)."""
    status, data, resp = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert status == 200, data
    return json.loads(data)["choices"][0]["text"].removeprefix("from "), resp.getheader("x-kvbridge-route") or ""


def test_cache_aware_sends_a_shared_prefix_where_it_was_computed(replicas_proxy: Any) -> None:
    a, b = FakeServer("replica"), FakeServer("replica")
    port = replicas_proxy([a.url, b.url], "cache-aware")
    system = [f"You are agent {i}. " * 60 for i in range(4)]  # four long system prompts, ~1 KiB each
    first = {i: _ask(port, system[i] + "question 0")[0] for i in range(4)}
    assert set(first.values()) == {a.url, b.url}, "new prefixes spread over the replicas (least-loaded)"
    for turn in range(1, 6):
        for i in range(4):
            where, why = _ask(port, system[i] + f"question {turn}")
            assert where == first[i] and why.startswith("cache-aware: ") and "chunks held" in why


def test_round_robin_ignores_prefixes(replicas_proxy: Any) -> None:
    a, b = FakeServer("replica"), FakeServer("replica")
    port = replicas_proxy([a.url, b.url], "round-robin")
    seen = [_ask(port, "same long prompt " * 40)[0] for _ in range(4)]
    assert seen == [a.url, b.url, a.url, b.url]


def test_least_loaded_reads_the_engines_metrics(replicas_proxy: Any) -> None:
    busy, idle = FakeServer("replica", running=9), FakeServer("replica", running=0)
    port = replicas_proxy([busy.url, idle.url], "least-loaded", poll_s=0.05)
    time.sleep(0.5)  # a few polls
    assert {_ask(port, f"p{i}")[0] for i in range(5)} == {idle.url}


def test_a_dead_replica_is_ejected_and_requests_keep_succeeding(replicas_proxy: Any) -> None:
    a, b = FakeServer("replica"), FakeServer("replica")
    port = replicas_proxy([a.url, b.url], "cache-aware")
    prompt = "shared prefix " * 80
    home = _ask(port, prompt + "0")[0]
    dead, alive = (a, b) if home == a.url else (b, a)
    dead.shutdown()
    dead.server_close()
    for i in range(1, 6):  # the first retries past the dead one; the rest skip it while it is ejected
        assert _ask(port, prompt + str(i))[0] == alive.url
    m = metrics(port)
    assert m["kvbridge_proxy_upstream_failures_total"] == 1, "ejected after one failure, not tried again meanwhile"


def test_router_keeps_a_hot_prefix_from_piling_onto_one_engine() -> None:
    from kvbridge.serving.routing import Router

    router = Router(["a", "b"], "cache-aware", chunk_chars=8, max_imbalance=2)
    body = {"prompt": "x" * 64}
    d, keys = router.pick(body)
    router.done(d, keys, ok=True)
    held = [router.pick(body) for _ in range(2)]  # two in flight on the holder
    assert all(dec.index == d.index for dec, _ in held)
    spill, _ = router.pick(body)
    assert spill.index != d.index and "too busy" in spill.reason


# ---- routing from a directory (what engines publish) ---------------------------------------------------


def _tokens(text: str) -> list[int]:
    return list(text.encode())  # what the stand-ins' /tokenize answers


def _ask_body(port: int, body: dict) -> tuple[str, str]:
    status, data, resp = post(port, "/v1/completions" if "prompt" in body else "/v1/chat/completions", body)
    assert status == 200, data
    return json.loads(data)["choices"][0]["text"].removeprefix("from "), resp.getheader("x-kvbridge-route") or ""


def test_the_proxy_routes_to_the_engine_that_published_the_prefix(redis: RedisServer, started: Any) -> None:
    a, b = FakeServer("replica", tokenizer=True), FakeServer("replica", tokenizer=True)
    port = started([], [], "127.0.0.1:0", 5.0, replicas=[a.url, b.url], policy="cache-aware", directory=redis.url)
    system = "You are a careful assistant. " * 20
    # b's engine holds the system prompt (as its connector would publish it); a holds another
    engines = {u: Holdings(open_directory(redis.url), u, address=u, ttl_s=5) for u in (a.url, b.url)}
    try:
        engines[b.url].hold(route_keys(_tokens(system), "tiny"))
        engines[a.url].hold(route_keys(_tokens("Something else entirely. " * 20), "tiny"))
        reader = open_directory(redis.url)
        assert eventually(lambda: len(reader.holders()) == 2)
        for i in range(3):
            where, why = _ask_body(port, {"model": "tiny", "prompt": system + f"question {i}"})
            assert where == b.url and why.startswith("cache-aware: directory: ") and "chunks held" in why, why
        held = len(_tokens(system)) // ROUTE_TOKENS
        assert f"{held} of " in why
        # another model's keys are another namespace: no holder, least-loaded
        _, why = _ask_body(port, {"model": "other", "prompt": system})
        assert "no live holder" in why
        # a chat request is tokenized by the engine too (here: its messages), and found the same way
        messages = [{"role": "system", "content": system}]
        engines[a.url].hold(route_keys(_tokens(json.dumps(messages)), "tiny"))
        assert eventually(lambda: held_depth(reader, a.url, route_keys(_tokens(json.dumps(messages)), "tiny")) > 0)
        where, why = _ask_body(port, {"model": "tiny", "messages": messages})
        assert where == a.url and "directory" in why, why
        # token ids need no tokenizer
        before = a.tokenized + b.tokenized
        where, _ = _ask_body(port, {"model": "tiny", "prompt": _tokens(system)})
        assert where == b.url and a.tokenized + b.tokenized == before

        # Redis dies: every request still succeeds, least-loaded, and says why
        redis.kill()
        for i in range(4):
            where, why = _ask_body(port, {"model": "tiny", "prompt": system + f"later {i}"})
            assert "directory: unreachable, least-loaded" in why, why
        assert {_ask_body(port, {"model": "tiny", "prompt": f"{i} " + system})[0] for i in range(4)} == {a.url, b.url}
        # ... and comes back empty: the engines publish again, and routing follows the prefix again
        redis.start()
        assert eventually(lambda: _ask_body(port, {"model": "tiny", "prompt": system + "back"})[0] == b.url
                          and "chunks held" in _ask_body(port, {"model": "tiny", "prompt": system + "back"})[1], 15)  # fmt: skip
        m = metrics(port)
        assert m["kvbridge_proxy_tokenize_seconds_count"] >= 10 and m["kvbridge_proxy_directory_seconds_count"] >= 10
        assert m["kvbridge_proxy_route_cache_aware_unreachable_total"] >= 8 and m["kvbridge_proxy_route_cache_aware_held_total"] >= 5
    finally:
        for held in engines.values():
            held.close()


def test_a_directory_needs_cache_aware(started: Any) -> None:
    with pytest.raises(ConfigError, match="cache-aware"):
        started([], [], "127.0.0.1:0", 5.0, replicas=["http://127.0.0.1:1"], policy="round-robin",
                directory="redis://127.0.0.1:1/0")  # fmt: skip
