"""Routing by what kvbridge's tiers publish: requests whose prefix sits only in one engine's cpu tier, sent
round-robin or cache-aware from a directory fed by the engines' own KV-event streams.

    .venv-vllm/bin/python benches/vllm/tier_routing_bench.py [WORKDIR] [--prompts 16] [--rounds 2] [--flush 5]

Two ``api_server`` engines of the tiny model (one core each), each ``kv_both`` with ``kvbridge.CPUConnector``
(a 192-block cpu tier), a 24-block GPU KV cache and ``--kv-events-config`` on ZMQ: vLLM publishes its GPU
prefix cache there (medium ``GPU``) and kvbridge its cpu tier (medium ``CPU``, :mod:`kvbridge.vllm.events`).
Beside each engine ``kvbridge publish`` keeps its stream in a Redis directory. Two ``kvbridge proxy``
instances in front of both engines: ``--policy round-robin``, and ``--policy cache-aware --directory``.

Per policy and round (``--rounds``, alternating which policy goes first): ``--prompts`` fresh 200-token prompts, each computed once on its home engine (homes 0,0,1,1,...:
not round robin's order), then ``--flush`` other prompts per engine push them out of the GPU caches (the
cpu tiers keep them, and so does the directory: a block stays published while any medium holds it), then
the prompts again, one at a time, through the proxy. Printed per policy: the hit rate (share of requests
whose engine reported ``cached_tokens`` > 0), the time to the first (and only) token, mean and p99 (the
whole request: one output token), the cpu-tier loads per engine (``kvbridge_transfers_total{direction=
"load"}``) and the GPU prefix-cache hit tokens (``vllm:prefix_cache_hits_total``; 0 once the flush worked,
so every hit is a tier's).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from pdkit import engine_env, make_tiny_llama  # noqa: E402
from test_api_server import call, free_port, stop_all, text_of, wait_healthy  # noqa: E402

from kvbridge.testing.services import RedisServer  # noqa: E402

BLOCK_BYTES = 65536  # the tiny model's KV of one 32-token block
POLICIES = ("round-robin", "cache-aware")


def _engine(model: Path, tmp: Path, i: int, env: dict[str, str]) -> tuple[subprocess.Popen, Path, int, int]:
    port, events = free_port(), free_port()
    kv = {"kv_connector": "kvbridge.CPUConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"capacity_bytes": 192 * BLOCK_BYTES}}  # fmt: skip
    evc = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}"}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
        "--enforce-eager", "--block-size", "32", "--max-model-len", "256", "--dtype", "float32",
        "--kv-cache-memory-bytes", str(24 * BLOCK_BYTES), "--seed", "0", "--enable-prompt-tokens-details",
        "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config", json.dumps(kv),
        "--kv-events-config", json.dumps(evc),
    ]  # fmt: skip
    log = tmp / f"engine{i}.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(env, VLLM_CPU_OMP_THREADS_BIND=str(i), OMP_NUM_THREADS="1"))  # fmt: skip
    return proc, log, port, events


def _side(cmd: list[str], tmp: Path, name: str, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    log = tmp / f"{name}.log"
    return subprocess.Popen([sys.executable, "-m", "kvbridge.cli", *cmd], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True), log  # fmt: skip


def _series(port: int) -> tuple[float, float]:
    _, data = call(port, "GET", "/metrics")
    loads = gpu = 0.0
    for line in data.decode().splitlines():
        if line.startswith("kvbridge_transfers_total{") and 'direction="load"' in line:
            loads += float(line.split()[-1])
        if line.startswith("vllm:prefix_cache_hits_total{"):
            gpu += float(line.split()[-1])
    return loads, gpu


def _ask(port: int, prompt: list[int]) -> tuple[int, float]:
    body = {"model": "tiny", "prompt": text_of(prompt), "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    status, data = call(port, "POST", "/v1/completions", body, timeout=300)
    took = time.perf_counter() - t
    assert status == 200, data[:500]
    return int((json.loads(data)["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0), took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", type=Path, nargs="?")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per policy")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both policies, alternating which goes first")
    ap.add_argument("--flush", type=int, default=5, help="prompts per engine that push them out of the GPU caches")
    args = ap.parse_args()
    tmp: Path = args.workdir or Path(tempfile.mkdtemp(prefix="tier_routing_bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    model = tmp / "tiny"
    if not (model / "config.json").exists():
        make_tiny_llama(model)
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    redis = RedisServer(tmp)
    redis.start()
    engines = [_engine(model, tmp, i, env) for i in range(2)]
    urls = [f"http://127.0.0.1:{port}" for _, _, port, _ in engines]
    sides = [_side(["publish", "--kv-events", f"tcp://127.0.0.1:{ev}", "--directory", redis.url, "--advertise-url", url,
                    "--model", "tiny"], tmp, f"publish{i}", env) for i, ((_, _, _, ev), url) in enumerate(zip(engines, urls))]  # fmt: skip
    proxies: dict[str, tuple[subprocess.Popen, Path, int]] = {}
    for policy in POLICIES:
        port = free_port()
        more = ["--directory", redis.url, "--tokenizer", str(model)] if policy == "cache-aware" else []
        cmd = ["proxy", "--policy", policy, *more, "--listen", f"127.0.0.1:{port}", "--timeout", "300",
               *(a for u in urls for a in ("--replica", u))]  # fmt: skip
        proxies[policy] = (*_side(cmd, tmp, f"proxy-{policy}", env), port)
    procs = [(p, log, port) for p, log, port, _ in engines] + list(proxies.values())
    try:
        deadline = time.monotonic() + 900
        for proc, log, port in procs:
            wait_healthy(port, proc, log, deadline)
        time.sleep(3)  # the sidecars' SUB sockets join a moment after they connect
        rng = random.Random(5)
        fresh = lambda: [rng.randrange(4, 2048) for _ in range(200)]  # noqa: E731
        ports = [port for _, _, port, _ in engines]
        got: dict[str, list[tuple[int, float]]] = {p: [] for p in POLICIES}
        loads: dict[str, list[float]] = {p: [0.0, 0.0] for p in POLICIES}
        gpu: dict[str, list[float]] = {p: [0.0, 0.0] for p in POLICIES}
        for rnd in range(args.rounds):
            for policy in POLICIES if rnd % 2 == 0 else POLICIES[::-1]:  # A/B, B/A: drift in the load hits both
                prompts = [fresh() for _ in range(args.prompts)]
                for i, prompt in enumerate(prompts):
                    _ask(ports[i // 2 % 2], prompt)  # homes 0,0,1,1,...
                for _ in range(args.flush):
                    for p in ports:
                        _ask(p, fresh())
                time.sleep(2)  # the last events reach the directory
                before = [_series(p) for p in ports]
                res = [_ask(proxies[policy][2], prompt) for prompt in prompts]
                time.sleep(2)
                after = [_series(p) for p in ports]
                got[policy] += res
                for e, (a, b) in enumerate(zip(after, before)):
                    loads[policy][e] += a[0] - b[0]
                    gpu[policy][e] += a[1] - b[1]
                print(f"round {rnd} {policy}: cached_tokens {[c for c, _ in res]}", flush=True)
        head = f"{'policy':<12}  {'hit rate':>12}  {'TTFT mean':>9}  {'TTFT p50':>8}  {'TTFT p99':>8}  {'tier loads':>10}  {'GPU hit tokens':>14}"
        print("\n" + head + "\n" + "-" * len(head))
        for policy in POLICIES:
            res, ttft = got[policy], sorted(1e3 * t for _, t in got[policy])
            hits = sum(1 for c, _ in res if c)
            p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
            print(f"{policy:<12}  {hits:>4}/{len(res):<4} {100 * hits / len(res):>3.0f}%  {statistics.fmean(ttft):>9.1f}  "
                  f"{statistics.median(ttft):>8.1f}  {p99:>8.1f}  {'+'.join(f'{x:.0f}' for x in loads[policy]):>10}  "
                  f"{'+'.join(f'{x:.0f}' for x in gpu[policy]):>14}")  # fmt: skip
        print("(TTFT in ms: the whole request through the proxy, one output token; tier loads and GPU hit tokens per engine)")
        page = call(proxies["cache-aware"][2], "GET", "/metrics")[1].decode()
        for name in ("tokenize", "directory"):  # what cache-aware routing itself costs, inside its TTFT
            vals = {k: float(line.split()[-1]) for line in page.splitlines() for k in ("sum", "count")
                    if line.startswith(f"kvbridge_proxy_{name}_seconds_{k}")}  # fmt: skip
            if vals.get("count"):
                print(f"(cache-aware: {name} took the proxy {1e3 * vals['sum'] / vals['count']:.1f} ms per request, mean)")
    finally:
        stop_all([p for p, _, _ in procs] + [p for p, _ in sides])
        redis.kill()


if __name__ == "__main__":
    main()
