"""The routing bench: a shared-prefix workload through ``kvbridge proxy`` in front of two real vLLM replicas,
each policy in the same run (one after the other, fresh replicas each time). ``directory`` is cache-aware
from what the replicas publish (vLLM's own KV-cache events, kept in a Redis that the run starts by a
``kvbridge publish`` beside each replica) instead of the proxy's own record of where it sent each prompt.

    .venv-vllm/bin/python benches/vllm/routing_bench.py [--prompts 64] [--prefixes 8] [--prefix-len 384] [--rate 4]

The workload is vLLM's own benchmark client with its ``prefix_repetition`` dataset: ``--prefixes`` long
"system prompts" of ``--prefix-len`` tokens, each request one of them plus its own ``--suffix-len``
tokens, in random order. Each replica's KV cache (``--kv-mib``) holds about half of the prefixes, as a
busy engine's cache holds a part of what its clients send: a policy that sends a prefix back to the
replica that holds it finds it there; one that spreads every prefix over both replicas makes each
cache churn. Per policy: the prefix-cache hit rate (the replicas' ``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``, in tokens), TTFT mean and p99, ITL mean, requests/s and failures.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VLLM_TESTS = ROOT / "tests" / "vllm"  # pdkit, and the helpers/ processes
sys.path[:0] = [str(HERE), str(VLLM_TESTS)]
from pd_serve_bench import Layout, client_result, fmt, free_port  # noqa: E402
from pdkit import engine_env, make_tiny_llama  # noqa: E402

from kvbridge.testing.services import RedisServer  # noqa: E402

POLICIES = ("round-robin", "least-loaded", "cache-aware", "directory")


def metrics_page(port: int) -> dict[str, float]:
    """A server's (a replica's or the proxy's) ``/metrics``, summed over label sets."""
    from kvbridge.serving.routing import parse_prometheus

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return parse_prometheus(conn.getresponse().read().decode())
    finally:
        conn.close()


def prefix_counters(port: int) -> tuple[float, float]:
    """(hits, queries) of a replica's prefix cache, in tokens, from its /metrics."""
    page = metrics_page(port)
    return page.get("vllm:prefix_cache_hits_total", 0.0), page.get("vllm:prefix_cache_queries_total", 0.0)


def kv_events() -> tuple[str, list[str]]:
    """A replica's KV-event endpoint, and the server flags that make vLLM publish there."""
    port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    return f"tcp://127.0.0.1:{port}", ["--kv-events-config", json.dumps(events)]


def run_policy(policy: str, args: argparse.Namespace, work: Path, model: Path) -> dict[str, Any]:
    lay = Layout(policy, work, model)
    redis = RedisServer(work) if policy == "directory" else None
    proxy_args = ["--policy", policy]
    sidecars: list[subprocess.Popen] = []
    for name in ("a", "b"):
        if redis is None:
            lay.server(name, None, kv_bytes=args.kv_mib << 20)
            continue
        # plain engines that publish their KV events; `kvbridge publish` beside each keeps them in the directory
        port, (endpoint, more) = free_port(), kv_events()
        lay.server(name, None, kv_bytes=args.kv_mib << 20, more=more, port=port)
        sidecars.append(subprocess.Popen([sys.executable, "-m", "kvbridge.cli", "publish", "--kv-events", endpoint,
                                          "--directory", redis.url, "--advertise-url", f"http://127.0.0.1:{port}",
                                          "--model", "tiny"], stdout=open(work / f"publish-{name}.log", "w"),
                                         stderr=subprocess.STDOUT))  # fmt: skip
    if redis is not None:
        redis.start()
        proxy_args = ["--policy", "cache-aware", "--directory", redis.url, "--tokenizer", str(model)]
    port = free_port()
    cmd = [sys.executable, "-m", "kvbridge.cli", "proxy", *proxy_args, "--listen", f"127.0.0.1:{port}",
           "--timeout", "120", *(a for n in ("a", "b") for a in ("--replica", f"http://127.0.0.1:{lay.ports[n]}"))]
    lay._start("proxy", port, cmd)
    try:
        print(f"[{policy}] replicas healthy in {lay.wait_healthy():.0f} s", flush=True)
        before = [prefix_counters(lay.ports[n]) for n in ("a", "b")]
        log = work / f"bench-{policy}.log"
        client = [sys.executable, str(VLLM_TESTS / "helpers" / "bench_client.py"), "--backend", "vllm",
                  "--base-url", f"http://127.0.0.1:{port}", "--model", "tiny", "--tokenizer", str(model),
                  "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                  "--prefix-repetition-suffix-len", str(args.suffix_len),
                  "--prefix-repetition-num-prefixes", str(args.prefixes),
                  "--prefix-repetition-output-len", str(args.output_len), "--ignore-eos",
                  "--num-prompts", str(args.prompts), "--request-rate", str(args.rate), "--seed", str(args.seed),
                  "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "99"]  # fmt: skip
        res = client_result(subprocess.Popen(client, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=engine_env()), log)
        after = [prefix_counters(lay.ports[n]) for n in ("a", "b")]
        hits = sum(a[0] - b[0] for a, b in zip(after, before))
        queries = sum(a[1] - b[1] for a, b in zip(after, before))
        res["hit_rate"] = hits / queries if queries else None
        proxy = metrics_page(port)  # what routing itself cost per request (the directory policy's two calls)
        for name in ("tokenize", "directory"):
            n = proxy.get(f"kvbridge_proxy_{name}_seconds_count", 0)
            res[f"{name}_ms"] = 1000 * proxy[f"kvbridge_proxy_{name}_seconds_sum"] / n if n else None
        print(f"[{policy}] {res}", flush=True)
        return res
    finally:
        lay.close()
        for proc in sidecars:
            proc.terminate()
            proc.wait(30)
        if redis is not None:
            redis.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--rate", type=float, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-mib", type=int, default=4, help="KV cache per replica (4 MiB: ~2,000 tokens of the tiny model)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", type=Path, default=ROOT / "benches" / "results" / "routing.txt")
    args = ap.parse_args()
    load0, date0 = os.getloadavg()[0], datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    work = Path(tempfile.mkdtemp(prefix="routing_bench-"))
    print(f"work dir {work}", flush=True)
    model = make_tiny_llama(work / "tiny-llama", max_positions=1024)
    rows = [(p, run_policy(p, args, work, model)) for p in args.policies.split(",")]

    head = f"{'policy':<12}  {'completed':>9}  {'failed':>6}  {'hit rate':>8}  {'TTFT mean':>9}  {'TTFT p99':>8}  {'ITL mean':>8}  {'req/s':>5}"
    lines = [head, "-" * len(head)]
    for name, r in rows:
        rate = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        lines.append(f"{name:<12}  {fmt(r['completed']):>9}  {fmt(r['failed']):>6}  {rate:>8}  {fmt(r['mean_ttft_ms']):>9}  "
                     f"{fmt(r['p99_ttft_ms']):>8}  {fmt(r['mean_itl_ms']):>8}  {fmt(r['request_throughput'], 2):>5}")
    lines.append("(hit rate: prefix-cache hits over queries, in tokens, both replicas; TTFT and ITL in ms)")
    for name, r in rows:
        if r.get("tokenize_ms") is not None:
            lines.append(f"({name}: tokenizing took the proxy {r['tokenize_ms']:.1f} ms and the directory lookup"
                         f" {r['directory_ms']:.1f} ms per request, mean; both are in its TTFT)")
    table = "\n".join(lines)
    print("\n" + table)
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=False).stdout.strip()  # fmt: skip
    import vllm

    header = [
        "# " + " ".join([".venv-vllm/bin/python", "benches/vllm/routing_bench.py", *sys.argv[1:]]),
        f"# {date0}, {os.cpu_count()} CPUs ({platform.machine()}), load at start {load0:.2f}; vllm {vllm.__version__},"
        f" Python {platform.python_version()}, tree at {rev}",
        f"# workload: vllm.benchmarks.serve prefix_repetition dataset, {args.prompts} prompts, {args.prefixes} prefixes of"
        f" {args.prefix_len} tokens + {args.suffix_len} own, {args.output_len} out, {args.rate} req/s, seed {args.seed};"
        f" two replicas of the tiny 2-layer Llama, float32, block 32, {args.kv_mib} MiB KV cache each, behind"
        " `kvbridge proxy --replica A --replica B --policy P` (directory: `--policy cache-aware --directory redis://... --tokenizer MODEL`,"
        " replicas' KV events kept there by `kvbridge publish`); fresh replicas per policy",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(header) + table + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
