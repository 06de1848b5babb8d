"""Routing across two real vLLM replicas: ``kvbridge proxy --replica A --replica B``.

Two plain ``python -m vllm.entrypoints.openai.api_server`` processes (prefix caching on, as vLLM's
default) behind two proxies, one ``cache-aware`` and one ``round-robin``. A prompt sent twice through
the cache-aware proxy reaches the replica that served it, and that replica really serves the prompt
from its prefix cache (``prompt_tokens_details.cached_tokens``); through round-robin the second copy
lands on the other replica and computes everything again. Both answers equal a direct call. A prompt
sharing only a long prefix follows it too; a killed replica is ejected and requests keep succeeding.

With a directory (``--directory redis://...``): each replica's kvbridge connector publishes its own
prefix cache to a real Redis — one from vLLM's KV-cache events, one at each request's end — and proxies
that never saw a prompt route it to the replica holding it; a Redis killed mid-run makes them
least-loaded (no request fails) until it is back and the engines have published again. One set of
replicas serves every test here (each replica costs a minute to start), in the order they are written.

Replica ``a`` (a cpu tier of 12 blocks, vLLM's KV-cache events on) is also the server of
``test_kv_events.py``'s checks of kvbridge's tier on vLLM's event stream: the first test here runs them, on
prompts of its own, before any other request reaches it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pdkit import BLOCK, PROMPT_LEN, engine_env
from test_api_server import SERVER_START_S, completion, free_port, stop_all, text_of, wait_healthy
from test_kv_events import BLOCK_BYTES, TIER_BLOCKS, check_cpu_tier_on_the_stream

from kvbridge.keys import route_keys
from kvbridge.metadata.holdings import open_directory
from kvbridge.testing.services import REDIS, RedisServer, eventually

FULL_TOKENS = PROMPT_LEN // BLOCK * BLOCK


def _server_cmd(model: Path, port: int, more: tuple[str, ...] = ()) -> list[str]:
    return [*_base_cmd(model, port), *more]


def _base_cmd(model: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "tiny", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "512",
        "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
        "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def _replica(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A replica server in a session of its own: :func:`kill_replica` kills its engine-core process too
    (killed alone, an API server leaves its engine core running, and publishing)."""
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill_replica(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def _publishing(port: int, directory: str, events_port: int | None) -> tuple[str, ...]:
    """A replica whose kvbridge connector (a small CPU tier) publishes its prefix cache to ``directory``:
    from vLLM's KV-cache events when ``events_port`` is given (and then a tier of TIER_BLOCKS, which
    test_kv_events' checks fill), else at each request's end."""
    capacity = TIER_BLOCKS * BLOCK_BYTES if events_port is not None else 32 << 20
    extra = {"capacity_bytes": capacity, "directory": directory, "advertise_url": f"http://127.0.0.1:{port}", "directory_ttl_s": 3}
    more = ["--kv-transfer-config", json.dumps({"kv_connector": "kvbridge.CPUConnector", "kv_role": "kv_both",
                                                "kv_connector_extra_config": extra})]  # fmt: skip
    if events_port is not None:
        more += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                   "endpoint": f"tcp://*:{events_port}", "topic": "kv"})]  # fmt: skip
    return tuple(more)


@pytest.fixture(scope="module")
def replicas(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two publishing replicas (``a`` from vLLM's KV events, ``b`` at each request's end), a Redis, and proxies
    in front of both: ``cache-aware`` (its own record), ``round-robin``, and ``p1``/``p2`` cache-aware on the
    directory (``p2`` tokenizes in the proxy: it finds the prefixes only if its ids equal the engines').
    One set for the module (starting two replicas takes a minute); the last test kills replica ``a``."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    tmp = tmp_path_factory.mktemp("routing")
    redis = RedisServer(tmp)
    redis.start()
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # real servers: engine core and worker in their own processes
    ports = {name: free_port() for name in ("a", "b", "cache-aware", "round-robin", "p1", "p2")}
    procs: list[tuple[subprocess.Popen, Path, int]] = []
    events_port = free_port()
    for name, events in (("a", events_port), ("b", None)):
        log = tmp / f"replica-{name}.log"
        cmd = _server_cmd(tiny_model, ports[name], _publishing(ports[name], redis.url, events))
        procs.append((_replica(cmd, log, env), log, ports[name]))
    urls = [arg for name in ("a", "b") for arg in ("--replica", f"http://127.0.0.1:{ports[name]}")]
    policies = {"cache-aware": ["--policy", "cache-aware"], "round-robin": ["--policy", "round-robin"],
                "p1": ["--policy", "cache-aware", "--directory", redis.url],
                "p2": ["--policy", "cache-aware", "--directory", redis.url, "--tokenizer", str(tiny_model)]}  # fmt: skip
    for name, args in policies.items():
        log = tmp / f"proxy-{name}.log"
        cmd = [sys.executable, "-m", "kvbridge.cli", "proxy", *urls, *args, "--listen", f"127.0.0.1:{ports[name]}",
               "--timeout", "120"]  # fmt: skip
        procs.append((subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env), log, ports[name]))
    try:
        deadline = time.monotonic() + SERVER_START_S
        for proc, log, port in procs:
            wait_healthy(port, proc, log, deadline)
        yield {**ports, "redis": redis, "procs": {"a": procs[0][0], "b": procs[1][0]}, "events": events_port}
    finally:
        stop_all(p for p, _, _ in procs)
        for proc, _, _ in procs[:2]:
            kill_replica(proc)
        redis.kill()


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


def test_a_cpu_tier_is_on_vllms_event_stream(replicas: dict[str, Any]) -> None:
    """test_kv_events.py's checks on replica ``a``, first (they need its tier untouched), with prompts that
    no other test sends (the routing tests below need their prompts unseen by either replica)."""
    rng = random.Random(4321)
    own = {name: [rng.randrange(4, 2048) for _ in range(PROMPT_LEN)] for name in "ABCD"}
    check_cpu_tier_on_the_stream(replicas["a"], replicas["events"], own)


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


def _holder(redis: RedisServer, tokens: list[int]) -> tuple[str, int]:
    """(the replica URL the directory names for these prompt tokens, leading chunks it holds), or ("", 0)."""
    entries = open_directory(redis.url).lookup(route_keys(tokens, "tiny"))
    return (entries[0].holder, entries[0].num_blocks) if entries else ("", 0)


def test_cache_aware_from_what_the_replicas_publish(replicas: dict[str, Any], prompts: dict) -> None:
    """Runs after the test above, on the same replicas: new prompts (E, F), which neither has seen."""
    redis, p1, p2 = replicas["redis"], replicas["p1"], replicas["p2"]
    url = {name: f"http://127.0.0.1:{replicas[name]}" for name in ("a", "b")}
    fresh = {"E": prompts["A"][::-1], "F": prompts["B"][::-1]}
    first, why = _routed(p1, text_of(fresh["E"]))
    assert "no live holder" in why and _cached(first) == 0, why
    second, _ = _routed(p1, text_of(fresh["F"]))
    # whichever replica served each published its prompt's full blocks, under its own URL
    def published(tokens: list[int]) -> tuple[str, int] | None:  # falsy until every full block is named
        holder = _holder(redis, tokens)
        return holder if holder[1] == FULL_TOKENS // 16 else None

    held = {name: eventually(lambda n=name: published(fresh[n]), 30) or _holder(redis, fresh[name]) for name in ("E", "F")}
    assert all(h in url.values() and n == FULL_TOKENS // 16 for h, n in held.values()), held

    # the other proxy never saw E or F (and tokenizes them itself), and still sends each to the replica that holds it
    for name in ("E", "F"):
        again, why = _routed(p2, text_of(fresh[name]))
        assert f"directory: {FULL_TOKENS // 16} of" in why, why
        assert _cached(again) == FULL_TOKENS, f"{name} was not served from the holder's prefix cache: {again['usage']}"
    assert _routed(p2, text_of(fresh["E"]))[0]["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert second["choices"]

    # Redis dies: requests succeed, least-loaded, and say why; it comes back empty and the engines publish again
    redis.kill()
    for name in ("E", "C"):
        answer, why = _routed(p1, text_of(fresh.get(name) or prompts[name]))
        assert "directory: unreachable, least-loaded" in why and answer["choices"], why
    redis.start()
    assert eventually(lambda: _holder(redis, fresh["E"])[0] != "", 30), "the replicas never published again"
    _, why = _routed(p2, text_of(fresh["E"]))
    assert "chunks held" in why, why

    # a replica killed, engine core and all: it is ejected by every proxy, every request still succeeds, and
    # its keys lapse with its lease (3 s)
    c_before = _routed(replicas["cache-aware"], text_of(prompts["C"]))[0]["choices"][0]["token_ids"]
    kill_replica(replicas["procs"]["a"])
    for port in (replicas["cache-aware"], p1):
        for name in ("A", "B", "C", "D"):
            assert _routed(port, text_of(prompts[name]))[0]["choices"]  # 200, or _routed fails
    assert _routed(replicas["cache-aware"], text_of(prompts["C"]))[0]["choices"][0]["token_ids"] == c_before
    assert eventually(lambda: url["a"] not in open_directory(redis.url).holders(), 15)
