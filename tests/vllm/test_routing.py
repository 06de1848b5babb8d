"""Routing across two real vLLM replicas: ``kvbridge proxy --replica A --replica B``.

Two plain ``python -m vllm.entrypoints.openai.api_server`` processes (prefix caching on, as vLLM's
default) behind two proxies, one ``cache-aware`` and one ``round-robin``. A prompt sent twice through
the cache-aware proxy reaches the replica that served it, and that replica really serves the prompt
from its prefix cache (``prompt_tokens_details.cached_tokens``); through round-robin the second copy
lands on the other replica and computes everything again. Both answers equal a direct call. A prompt
sharing only a long prefix follows it too; a killed replica is ejected and requests keep succeeding.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pdkit import BLOCK, PROMPT_LEN, engine_env
from test_api_server import SERVER_START_S, completion, free_port, stop_all, text_of, wait_healthy

FULL_TOKENS = PROMPT_LEN // BLOCK * BLOCK


def _server_cmd(model: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "tiny", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "512",
        "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
        "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


@pytest.fixture
def replicas(tiny_model: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Two replica servers and a proxy per policy in front of both; their ports."""
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # real servers: engine core and worker in their own processes
    ports = {"a": free_port(), "b": free_port(), "cache-aware": free_port(), "round-robin": free_port()}
    procs: list[tuple[subprocess.Popen, Path, int]] = []
    for name in ("a", "b"):
        log = tmp_path / f"replica-{name}.log"
        proc = subprocess.Popen(_server_cmd(tiny_model, ports[name]), stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
        procs.append((proc, log, ports[name]))
    urls = [arg for name in ("a", "b") for arg in ("--replica", f"http://127.0.0.1:{ports[name]}")]
    for policy in ("cache-aware", "round-robin"):
        log = tmp_path / f"proxy-{policy}.log"
        cmd = [sys.executable, "-m", "kvbridge.cli", "proxy", *urls, "--policy", policy,
               "--listen", f"127.0.0.1:{ports[policy]}", "--timeout", "120"]  # fmt: skip
        procs.append((subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env), log, ports[policy]))
    try:
        deadline = time.monotonic() + SERVER_START_S
        for proc, log, port in procs:
            wait_healthy(port, proc, log, deadline)
        yield {**ports, "procs": {"a": procs[0][0], "b": procs[1][0]}}
    finally:
        stop_all(p for p, _, _ in procs)


def _routed(port: int, prompt: str) -> tuple[dict, str]:
    """A greedy completion through the proxy on ``port``: the answer and the proxy's routing reason."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data[:2000]
        return json.loads(data), resp.getheader("x-kvbridge-route") or ""
    finally:
        conn.close()


def _cached(answer: dict) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_cache_aware_sends_a_prompt_back_to_the_replica_that_holds_it(replicas: dict[str, Any], prompts: dict) -> None:
    aware, rr = replicas["cache-aware"], replicas["round-robin"]
    first, why_first = _routed(aware, text_of(prompts["A"]))
    assert _cached(first) == 0 and "no live holder" in why_first, why_first
    other, _ = _routed(aware, text_of(prompts["B"]))  # a new prefix: the tie goes to the other, idle replica
    again, why_again = _routed(aware, text_of(prompts["A"]))
    assert "chunks held" in why_again, why_again
    assert _cached(again) == FULL_TOKENS, f"the holder did not serve A from its prefix cache: {again['usage']}"
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert _cached(other) == 0

    # a prompt that only shares A's long prefix goes to A's holder too, which serves that prefix from its cache
    shared = prompts["A"][:160] + prompts["D"][:40]
    tail, why_tail = _routed(aware, text_of(shared))
    assert "chunks held" in why_tail and _cached(tail) == 160 // BLOCK * BLOCK, (why_tail, tail["usage"])

    # round-robin: the second copy of a prompt lands on the other replica, which computes it all again
    c1, _ = _routed(rr, text_of(prompts["C"]))
    c2, why = _routed(rr, text_of(prompts["C"]))
    assert why == "round-robin" and _cached(c1) == 0 and _cached(c2) == 0, (why, c1["usage"], c2["usage"])
    direct = completion(replicas["a"], text_of(prompts["C"]))["choices"][0]["token_ids"]
    assert c1["choices"][0]["token_ids"] == c2["choices"][0]["token_ids"] == direct[:4]

    # a dead replica is ejected: every request still succeeds, on the one left
    replicas["procs"]["a"].kill()
    replicas["procs"]["a"].wait(30)
    for name in ("A", "B"):  # one of them was held by the dead replica
        assert _routed(aware, text_of(prompts[name]))[0]["choices"]  # 200, or _routed fails
    answer, _ = _routed(aware, text_of(prompts["C"]))
    assert answer["choices"][0]["token_ids"] == c1["choices"][0]["token_ids"]
