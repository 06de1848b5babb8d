"""P/D behind **vllm-router** (the Rust router vLLM publishes, ``pip install vllm-router``), with real servers.

A producer and a consumer ``vllm.entrypoints.openai.api_server`` with ``kvbridge.UCXConnector`` (the
consumer's prefix cache off, so every cached token it reports was loaded), each pinned to one core, and
``vllm-router --vllm-pd-disaggregation`` in front. Between the router and the consumer sits a recording
relay (:class:`Relay`, a plain HTTP pass-through): vllm-router answers the client with the *prefill*
server's ``prompt_tokens_details`` (its ``pd_cached_tokens`` rewrite: the producer's own prefix-cache hit),
so the client's ``cached_tokens`` says nothing about the hand-off; the consumer's own answer does.

Checked: fresh prompts (never seen by the producer), one at a time and concurrently, are served by the
consumer from loaded KV (its ``cached_tokens`` is every full block of the prompt) and their texts equal a
colocated engine's; the same prompts again likewise; and the consumer's ``/metrics`` carries kvbridge's
series (:mod:`kvbridge.vllm.prom`).
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pdkit import BLOCK, PROMPT_LEN, engine_env
from test_api_server import SERVER_START_S, call, free_port, stop_all, text_of, wait_healthy

ROUTER = Path(sys.executable).with_name("vllm-router")
FULL_TOKENS = PROMPT_LEN // BLOCK * BLOCK  # what a consumer loads: the prompt's full blocks
MAX_TOKENS = 8

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed: pip install vllm-router==0.1.17")


class Relay:
    """An HTTP pass-through to ``127.0.0.1:target`` that keeps each completion answer it relays, by the
    request's ``X-Request-Id`` (vllm-router sends the same id to the prefill and the decode server)."""

    def __init__(self, target: int):
        self.answers: dict[str, dict[str, Any]] = {}
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._relay()

            def do_POST(self) -> None:
                self._relay()

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                keep = ("content-type", "x-request-id", "authorization")
                headers = {k: v for k, v in self.headers.items() if k.lower() in keep}
                conn = http.client.HTTPConnection("127.0.0.1", target, timeout=300)
                try:
                    conn.request(self.command, self.path, body, headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if self.path.startswith("/v1/") and resp.status == 200:
                    relay.answers[self.headers.get("X-Request-Id", "")] = json.loads(data)
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _server_cmd(model: Path, port: int, kv_role: str) -> list[str]:
    kv = {"kv_connector": "kvbridge.UCXConnector", "kv_role": kv_role, "kv_connector_extra_config": {}}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "tiny", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "512",
        "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
        "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    return cmd + (["--no-enable-prefix-caching"] if kv_role == "kv_consumer" else [])


@pytest.fixture(scope="module")
def routed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Producer and consumer servers (one core each), the relay before the consumer, vllm-router in front."""
    import subprocess

    tmp = tmp_path_factory.mktemp("vllm-router")
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # real servers: engine core and worker in their own processes
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port()}
    procs: list[tuple[subprocess.Popen, Path, int]] = []
    for name, kv_role, core in (("prefill", "kv_producer", "0"), ("decode", "kv_consumer", "1")):
        log = tmp / f"{name}.log"
        pinned = dict(env, VLLM_CPU_OMP_THREADS_BIND=core, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(_server_cmd(tiny_model, ports[name], kv_role), stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, env=pinned, start_new_session=True)
        procs.append((proc, log, ports[name]))
    relay = Relay(ports["decode"])
    router_log = tmp / "router.log"
    router_cmd = [
        str(ROUTER), "--vllm-pd-disaggregation", "--policy", "round_robin", "--host", "127.0.0.1",
        "--port", str(ports["router"]), "--prefill", f"http://127.0.0.1:{ports['prefill']}",
        "--decode", f"http://127.0.0.1:{relay.port}",
    ]  # fmt: skip
    router = subprocess.Popen(router_cmd, stdout=open(router_log, "w"), stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)
    procs.append((router, router_log, ports["router"]))
    try:
        import time

        deadline = time.monotonic() + SERVER_START_S
        for proc, log, port in procs:
            wait_healthy(port, proc, log, deadline)
        yield {**ports, "relay": relay, "tmp": tmp}
    finally:
        stop_all(p for p, _, _ in procs)
        relay.close()


def routed_completion(routed: dict[str, Any], prompt: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One completion through the router: (the router's answer, the consumer's own answer to it)."""
    body = {"model": "tiny", "prompt": text_of(prompt), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    status, data = call(routed["router"], "POST", "/v1/completions", body, timeout=300)
    assert status == 200, data[:2000]
    answer = json.loads(data)
    rid = answer["id"].removeprefix("cmpl-")
    consumer = routed["relay"].answers.get(rid)
    assert consumer is not None, f"the consumer never answered {rid} (relayed: {list(routed['relay'].answers)})"
    return answer, consumer


def expected_text(tokens: list[int]) -> str:
    """The text the test tokenizer gives ``tokens`` (``w<N>`` per id; the 4 special ids are skipped)."""
    return "".join(f" w{t}" for t in tokens if t >= 4)


def _cached(answer: dict[str, Any]) -> int | None:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")


def test_fresh_prompts_load_behind_vllm_router(routed: dict[str, Any], prompts: dict, baseline: dict) -> None:
    figures: list[str] = []

    def check(name: str, round_: str) -> None:
        answer, consumer = results[name]
        want = expected_text(baseline[name]["tokens"])
        assert answer["choices"][0]["text"] == want, f"{name}: routed P/D differs from the colocated engine"
        assert consumer["choices"][0]["text"] == want
        # every full block of the prompt came from the producer: the consumer computed only the tail
        assert _cached(consumer) == FULL_TOKENS, f"{name} ({round_}): the consumer did not load: {consumer['usage']}"
        figures.append(f"{round_} {name}: consumer cached_tokens={_cached(consumer)}, router's={_cached(answer)}")

    results: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for name in "AB":  # fresh, one at a time
        results[name] = routed_completion(routed, prompts[name])
        check(name, "fresh sequential")
        # the router's own usage is the prefill server's: nothing of a fresh prompt was cached there
        assert _cached(results[name][0]) == 0, results[name][0]["usage"]
    with cf.ThreadPoolExecutor(2) as pool:  # fresh, at once
        results.update(zip("CD", pool.map(lambda n: routed_completion(routed, prompts[n]), "CD")))
    for name in "CD":
        check(name, "fresh concurrent")
    with cf.ThreadPoolExecutor(4) as pool:  # again: now in the producer's prefix cache too
        results.update(zip("ABCD", pool.map(lambda n: routed_completion(routed, prompts[n]), "ABCD")))
    for name in "ABCD":
        check(name, "repeat concurrent")
    print("\n".join(figures))


def kvbridge_series(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every ``kvbridge_*`` sample on a server's ``/metrics``: (name, sorted labels but vLLM's) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, data = call(port, "GET", "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(data.decode()):
        for s in family.samples:
            if s.name.startswith("kvbridge_"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name")))
                out[(s.name, labels)] = s.value
    return out


def test_kvbridge_series_on_the_servers_metrics(routed: dict[str, Any]) -> None:
    """After one more fresh P/D request, the consumer's /metrics count one more ucx load of exactly the
    prompt's full blocks (the tiny model: 2 layers x 2 KV heads x 64 dims x K and V x 4 bytes a token)."""
    import random
    import time

    load = ("direction", "load"), ("backend", "ucx"), ("tier", "ucx")
    before = kvbridge_series(routed["decode"])
    rng = random.Random(4242)
    answer, consumer = routed_completion(routed, [rng.randrange(4, 2048) for _ in range(PROMPT_LEN)])
    assert _cached(consumer) == FULL_TOKENS, consumer["usage"]
    deadline = time.monotonic() + 30  # the stats reach the API server with the engine's next outputs
    after = kvbridge_series(routed["decode"])

    def delta(name: str, labels: tuple[tuple[str, str], ...]) -> float:
        key = (name, tuple(sorted(labels)))
        return after.get(key, 0.0) - before.get(key, 0.0)

    while delta("kvbridge_transfers_total", load) < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
        after = kvbridge_series(routed["decode"])
    assert delta("kvbridge_transfers_total", load) == 1, sorted(after)
    assert delta("kvbridge_transfer_blocks_total", load) == FULL_TOKENS // BLOCK
    assert delta("kvbridge_transfer_bytes_total", load) == FULL_TOKENS * 2 * 2 * 64 * 2 * 4
    assert delta("kvbridge_transfer_seconds_count", (("backend", "ucx"), ("direction", "load"))) == 1
    lanes = sum(delta("kvbridge_loads_by_lane_total", (("lane", lane),)) for lane in ("cma", "ucp", "two-sided"))
    assert lanes == 1, {k: v for k, v in after.items() if "lane" in k[0]}
    assert after.get(("kvbridge_lane_info", (("lane", "auto"),))) == 1
    assert delta("kvbridge_failed_blocks_total", (("backend", "ucx"), ("tier", "ucx"))) == 0
    producer = kvbridge_series(routed["prefill"])
    assert producer.get(("kvbridge_lane_info", (("lane", "auto"),))) == 1, sorted(producer)
    print("consumer kvbridge series:", {f"{n}{dict(lab)}": v for (n, lab), v in sorted(after.items()) if v})
