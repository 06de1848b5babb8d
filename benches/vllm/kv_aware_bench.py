"""Does an event-reading router send a request to the engine whose *kvbridge tier* holds its prefix?

    python benches/vllm/kv_aware_bench.py WORKDIR [--flush N]

Two ``api_server`` engines (``kv_both``, ``kvbridge.CPUConnector`` with a 96-block cpu tier, a 24-block GPU
KV cache, ``--kv-events-config`` publishing on ZMQ), one core each; two vllm-router 0.1.17 instances in front
of both: ``--policy round_robin`` and ``--policy kv_aware`` fed both engines' event streams
(``--kv-event-source``). Per policy: 8 fresh 200-token prompts, each computed once on its home engine
(homes 0,0,1,1,...: not round robin's order), then ``--flush`` other prompts per engine push them out of
the GPU caches (they stay in the cpu tiers), then the 8 prompts again through the router. Printed per
policy: requests served with cached tokens (``hits``), mean time to the first (only) token, the cpu-tier
loads on each engine (``kvbridge_transfers_total{direction="load"}``) and GPU prefix-cache hit tokens
(``vllm:prefix_cache_hits_total``; 0 once the flush worked, so every hit is a tier's).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "vllm"))  # pdkit

from pdkit import engine_env, make_tiny_llama  # noqa: E402
from test_api_server import free_port, stop_all, wait_healthy  # noqa: E402
from tier_routing_bench import _ask, _series  # noqa: E402 - the same two probes of an engine

BLOCK_BYTES = 65536  # the tiny model's KV of one 32-token block


def _engine(model: Path, tmp: Path, i: int, env: dict[str, str], hash_algo: str) -> tuple[subprocess.Popen, Path, int, int]:
    port, events = free_port(), free_port()
    kv = {"kv_connector": "kvbridge.CPUConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"capacity_bytes": 96 * BLOCK_BYTES}}  # fmt: skip
    evc = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}", "topic": "kv"}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
        "--enforce-eager", "--block-size", "32", "--max-model-len", "256", "--dtype", "float32",
        "--kv-cache-memory-bytes", str(24 * BLOCK_BYTES), "--seed", "0", "--enable-prompt-tokens-details",
        "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config", json.dumps(kv),
        "--kv-events-config", json.dumps(evc), "--prefix-caching-hash-algo", hash_algo,
    ]  # fmt: skip
    log = tmp / f"engine{i}.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(env, VLLM_CPU_OMP_THREADS_BIND=str(i), OMP_NUM_THREADS="1"))
    return proc, log, port, events


def _router(model: Path, tmp: Path, policy: str, engines: list[tuple[int, int]], env: dict[str, str]) -> tuple[subprocess.Popen, Path, int]:
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("vllm-router")), "--worker-urls", *[f"http://127.0.0.1:{p}" for p, _ in engines],
           "--policy", policy, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]  # fmt: skip
    if policy == "kv_aware":
        for p, ev in engines:
            cmd += ["--kv-event-source", f"http://127.0.0.1:{p}=tcp://127.0.0.1:{ev}"]
        cmd += ["--kv-event-block-size", "32", "--kv-event-model", str(model)]
    log = tmp / f"router-{policy}.log"
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True), log, port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--flush", type=int, default=5, help="prompts per engine that push the 8 out of the GPU caches")
    ap.add_argument("--hash-algo", default="sha256_cbor", help="the engines' --prefix-caching-hash-algo (vLLM's "
                    "default, sha256, hashes Python pickles: no router can compute those)")
    args = ap.parse_args()
    tmp: Path = args.workdir
    tmp.mkdir(parents=True, exist_ok=True)
    model = tmp / "tiny"
    if not (model / "config.json").exists():
        make_tiny_llama(model)
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    engines = [_engine(model, tmp, i, env, args.hash_algo) for i in range(2)]
    ports = [(p, ev) for _, _, p, ev in engines]
    routers = {pol: _router(model, tmp, pol, ports, env) for pol in ("round_robin", "kv_aware")}
    procs = [(p, log, port) for p, log, port, _ in engines] + list(routers.values())
    try:
        deadline = time.monotonic() + 900
        for proc, log, port in procs:
            wait_healthy(port, proc, log, deadline)
        for _, log, _ in routers.values():  # kv_aware subscribes once ready: what is published before is lost
            while "Router ready" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(1)
        time.sleep(3)
        rng = random.Random(5)
        fresh = lambda: [rng.randrange(4, 2048) for _ in range(200)]  # noqa: E731
        out: dict[str, Any] = {}
        for policy in ("round_robin", "kv_aware"):
            prompts = [fresh() for _ in range(8)]
            for home, prompt in zip([0, 0, 1, 1, 0, 0, 1, 1], prompts):
                _ask(ports[home][0], prompt)
            for _ in range(args.flush):
                for p, _ in ports:
                    _ask(p, fresh())
            time.sleep(2)
            before = [_series(p) for p, _ in ports]
            res = [_ask(routers[policy][2], prompt) for prompt in prompts]
            time.sleep(2)
            after = [_series(p) for p, _ in ports]
            out[policy] = {"hits": sum(1 for c, _ in res if c), "of": len(res), "cached": [c for c, _ in res],
                           "ttft_ms_mean": round(1e3 * sum(t for _, t in res) / len(res), 1),
                           "tier_loads_per_engine": [a[0] - b[0] for a, b in zip(after, before)],
                           "gpu_hit_tokens_per_engine": [a[1] - b[1] for a, b in zip(after, before)]}  # fmt: skip
            print(policy, json.dumps(out[policy]), flush=True)
    finally:
        stop_all(p for p, _, _ in procs)


if __name__ == "__main__":
    main()
