"""vLLM's own serving benchmark against colocated, fs P/D and ucx P/D, one layout after the other.

    .venv-vllm/bin/python benches/vllm/pd_serve_bench.py [--prompts 32] [--input-len 200] [--output-len 16] [--rate 4]

Each layout starts its servers (``python -m vllm.entrypoints.openai.api_server`` with the tiny Llama of
pdkit.py), runs the same ``bench_client.py`` workload (random dataset, fixed seed) and stops them before the
next layout starts: (1) colocated, one plain server, the client straight at it; (2) fs P/D, a producer and a
consumer over one fs store behind ``kvbridge proxy``; (3) ucx P/D likewise with kvbridge.UCXConnector. In the
ucx layout the idle CPU of the producer and consumer servers (each process tree: vLLM's engine core is a child
process) is sampled over 10 s before traffic and again after it, and finally the client runs once more and the
producer server (its whole process tree) is killed ``--kill-after`` seconds in: the proxy should send the rest
to the decode engine, 0 failed. Prints a table and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VLLM_TESTS = ROOT / "tests" / "vllm"  # pdkit, and the helpers/ processes
sys.path[:0] = [str(HERE), str(VLLM_TESTS)]
from pdkit import engine_env, make_tiny_llama  # noqa: E402

SERVER_START_S = 600
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def server_env() -> dict[str, str]:
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # real servers: the engine core in its own process
    return env


# --- process-tree CPU -------------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime+stime seconds) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st:
                children.setdefault(st[0], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_cpu(pid: int) -> dict[int, float]:
    return {p: st[1] for p in tree(pid) if (st := _stat(p))}


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """% of one core each process tree used over ``seconds`` (processes present at both samples)."""
    before = {name: tree_cpu(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    after = {name: tree_cpu(pid) for name, pid in pids.items()}
    dt = time.monotonic() - t0
    return {
        name: 100.0 * sum(after[name][p] - before[name].get(p, 0.0) for p in after[name]) / dt for name in pids
    }


# --- servers ----------------------------------------------------------------------------------------------------


class Layout:
    """The servers of one layout; :meth:`close` stops every process tree it started."""

    def __init__(self, name: str, work: Path, model: Path):
        self.name, self.work, self.model = name, work, model
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}

    def server(self, role: str, kv: dict[str, Any] | None, kv_bytes: int = 128 << 20, more: Sequence[str] = (),
               port: int | None = None) -> None:  # fmt: skip
        port = port or free_port()
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--served-model-name", "tiny", "--enforce-eager", "--block-size", "32", "--max-model-len", "1024",
            "--dtype", "float32", "--kv-cache-memory-bytes", str(kv_bytes), "--seed", "0",
            "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        self._start(role, port, [*cmd, *more])

    def proxy(self) -> None:
        port = free_port()
        cmd = [
            sys.executable, "-m", "kvbridge.cli", "proxy", "--prefill", f"http://127.0.0.1:{self.ports['prefill']}",
            "--decode", f"http://127.0.0.1:{self.ports['decode']}", "--listen", f"127.0.0.1:{port}", "--timeout", "120",
        ]  # fmt: skip
        self._start("proxy", port, cmd)

    def _start(self, role: str, port: int, cmd: list[str]) -> None:
        log = open(self.work / f"{self.name}-{role}.log", "w")
        self.procs[role] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env())
        self.ports[role] = port

    def wait_healthy(self) -> float:
        t0 = time.monotonic()
        for role, proc in self.procs.items():
            while not healthy(self.ports[role]):
                if proc.poll() is not None or time.monotonic() - t0 > SERVER_START_S:
                    log = (self.work / f"{self.name}-{role}.log").read_text()[-6000:]
                    raise RuntimeError(f"{self.name} {role} did not come up (rc {proc.poll()}):\n{log}")
                time.sleep(1)
        return time.monotonic() - t0

    def kill(self, role: str) -> None:
        """SIGKILL ``role``'s server and every process under it (no orphaned engine core left running)."""
        pids = tree(self.procs[role].pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[role].wait(30)

    def close(self) -> None:
        pids = {role: tree(proc.pid) for role, proc in self.procs.items()}
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for role, proc in self.procs.items():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pid in pids[role][1:]:  # children the server left behind
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


# --- the client -------------------------------------------------------------------------------------------------


def start_client(port: int, args: argparse.Namespace, model: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(VLLM_TESTS / "helpers" / "bench_client.py"), "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{port}", "--model", "tiny", "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos", "--num-prompts", str(args.prompts),
           "--request-rate", str(args.rate), "--seed", str(args.seed), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "99"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=engine_env())


def client_result(proc: subprocess.Popen, log: Path) -> dict[str, Any]:
    proc.wait(timeout=900)
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench client failed (rc {proc.returncode}):\n{text[-4000:]}")
    return dict(json.loads(lines[-1][len("BENCH ") :]))


def run_client(port: int, args: argparse.Namespace, model: Path, log: Path) -> dict[str, Any]:
    return client_result(start_client(port, args, model, log), log)


# --- main -------------------------------------------------------------------------------------------------------


def pd_layout(name: str, connector: str, work: Path, model: Path, extra: dict[str, Any]) -> Layout:
    lay = Layout(name, work, model)
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        kv: dict[str, Any] = {"kv_connector": connector, "kv_role": kv_role}
        if extra:
            kv["kv_connector_extra_config"] = extra
        lay.server(role, kv)
    lay.proxy()
    return lay


def fmt(x: Any, nd: int = 1) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rate", type=float, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--kill-after", type=float, default=2.0)
    ap.add_argument("--kill-layout", choices=("ucx", "fs"), default="ucx")
    ap.add_argument("--out", type=Path, default=ROOT / "benches" / "results" / "pd_serve.txt")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = ap.parse_args()
    load0, date0 = os.getloadavg()[0], datetime.datetime.now().strftime("%Y-%m-%d %H:%M")

    work = Path(tempfile.mkdtemp(prefix="pd_serve_bench-"))
    print(f"work dir {work}", flush=True)
    model = make_tiny_llama(work / "tiny-llama", max_positions=1024)
    rows: list[tuple[str, dict[str, Any]]] = []
    notes: list[str] = []
    idle: dict[str, dict[str, float]] = {}
    killed: dict[str, Any] | None = None

    layouts = [
        ("colocated", None),
        ("fs P/D", ("kvbridge.FSConnector", {"path": str(work / "store")})),
        ("ucx P/D", ("kvbridge.UCXConnector", {})),
    ]
    for name, spec in layouts:
        tag = name.split()[0]
        if spec is None:
            lay = Layout(tag, work, model)
            lay.server("server", None)
        else:
            lay = pd_layout(tag, spec[0], work, model, spec[1])
        try:
            up = lay.wait_healthy()
            print(f"[{name}] servers healthy in {up:.0f} s", flush=True)
            port = lay.ports.get("proxy", lay.ports.get("server"))
            workers = {"producer": lay.procs["prefill"].pid, "consumer": lay.procs["decode"].pid} if spec else {}
            if tag == "ucx":
                time.sleep(3)  # let start-up work (compile, warm-up) settle
                idle["before traffic"] = idle_cpu(workers, args.idle_s)
                print(f"[{name}] idle CPU before traffic {idle['before traffic']}", flush=True)
            res = run_client(port, args, model, work / f"bench-{tag}.log")
            rows.append((name, res))
            print(f"[{name}] {res}", flush=True)
            if tag == "ucx":
                idle["after traffic"] = idle_cpu(workers, args.idle_s)
                print(f"[{name}] idle CPU after traffic {idle['after traffic']}", flush=True)
            if tag == args.kill_layout:
                log = work / f"bench-{tag}-killed.log"
                client = start_client(port, args, model, log)
                time.sleep(args.kill_after)
                lay.kill("prefill")
                print(f"[{name}] producer server killed {args.kill_after:.1f} s into the run", flush=True)
                killed = client_result(client, log)
                killed["layout"] = name
                print(f"[{name}] producer killed: {killed}", flush=True)
        finally:
            lay.close()

    head = f"{'layout':<10}  {'completed':>9}  {'failed':>6}  {'TTFT mean':>9}  {'TTFT p99':>8}  {'ITL mean':>8}  {'ITL p99':>7}  {'req/s':>5}"
    lines = [head, "-" * len(head)]
    for name, r in rows:
        lines.append(
            f"{name:<10}  {fmt(r['completed']):>9}  {fmt(r['failed']):>6}  {fmt(r['mean_ttft_ms']):>9}  "
            f"{fmt(r['p99_ttft_ms']):>8}  {fmt(r['mean_itl_ms']):>8}  {fmt(r['p99_itl_ms']):>7}  "
            f"{fmt(r['request_throughput'], 2):>5}"
        )
    lines.append("(TTFT and ITL in ms)")
    lines.append("")
    for when, cpu in idle.items():
        lines.append(f"ucx P/D idle CPU {when} ({args.idle_s:.0f} s, % of one core, API server + children): "
                     + ", ".join(f"{k} {v:.1f}%" for k, v in cpu.items()))
    if killed is not None:
        lines.append(
            f"{killed['layout']}, producer server killed {args.kill_after:.1f} s into the run: "
            f"completed {killed['completed']}, failed {killed['failed']} (TTFT mean {fmt(killed['mean_ttft_ms'])} ms, "
            f"p99 {fmt(killed['p99_ttft_ms'])} ms)"
        )
    lines += notes
    table = "\n".join(lines)
    print("\n" + table)

    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=False).stdout.strip()  # fmt: skip
    except OSError:
        rev = "?"
    import vllm

    cmd = " ".join([".venv-vllm/bin/python", "benches/vllm/pd_serve_bench.py", *sys.argv[1:]])
    header = [
        f"# {cmd}",
        f"# {date0}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}),"
        f" load at start {load0:.2f}; vllm {vllm.__version__}, Python {platform.python_version()}, tree at {rev}",
        f"# workload: vllm.benchmarks.serve random dataset, {args.prompts} prompts, {args.input_len} tokens in,"
        f" {args.output_len} out (--ignore-eos), {args.rate} req/s, seed {args.seed}; tiny 2-layer Llama"
        " (pdkit.make_tiny_llama), float32, --enforce-eager, block 32, 128 MiB KV cache per server",
        "# layouts one after the other (never two layouts' servers at once); P/D through `kvbridge proxy`;"
        " every process of a layout shares the same cores",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(header) + table + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
