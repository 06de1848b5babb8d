"""A serving soak of P/D across emulated hosts, with the link's faults at random times (needs root).

    sudo .venv-vllm/bin/python benches/vllm/soak_hosts.py [--minutes 10] [--concurrency 8] [--seed 1] [--out soak.json]

Three emulated hosts (kvbridge.testing.hosts): host A runs a vLLM api_server as ``kv_producer`` with
``kvbridge.UCXConnector`` (nothing configured for addresses), pinned to core 0; host B the consumer
(``kv_consumer``, ``kv_load_failure_policy: recompute``), pinned to core 1; host C ``kvbridge proxy`` in
front of both, and vLLM's own serving benchmark client (``vllm bench serve`` through bench_client.py) at
``--concurrency``, in rounds of fresh random prompts until the time is up. Every client request crosses the
proxy on host C; the KV crosses the link from A to B.

While the client runs, faults come at seeded random times (logged with their times): host A crashes (every
process killed), boots again and its producer restarts; host A's link goes down, or drops every packet
(nftables), for a few seconds; host B (the consumer) drops every packet for a few seconds. The last part of
the run has no faults, so that loads resuming is visible.

What it checks and reports (``--out`` JSON):

- failed requests: the bench summaries' ``failed``, summed over rounds (must be 0);
- wrong outputs: a checker sends fixed prompts (greedy, each with a fresh ``cache_salt``, so each is a new
  prefill and hand-off) through the proxy throughout, and compares each answer with the same prompt's answer
  from the consumer alone before the soak (must be 0 mismatches, and 0 failed checks); a check whose answer
  says cached prompt tokens (``usage.prompt_tokens_details``) was decoded from KV loaded over kvbridge;
- memory: process-tree RSS of the producer, the consumer and the proxy every ``--sample-s``; first, last,
  max after warm-up and the least-squares slope (MiB a minute); a producer's lives are reported apart;
- kvbridge loads vs recomputes: the consumer's ``kvbridge_*`` series (blocks loaded, blocks failed), the
  proxy's prefill fallbacks, and the blocks loaded after the last fault (loads resumed without a restart);
- the load average, the fault log.

Exit status: 0 when the run met them (0 failed, 0 wrong, some checks from loaded KV, loads after the last
fault; memory is reported, not judged), 1 otherwise, 77 when emulated hosts cannot be made here (not root,
no ``ip netns``), saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VLLM_TESTS = HERE.parent.parent / "tests" / "vllm"
sys.path[:0] = [str(HERE), str(VLLM_TESTS)]
from pd_serve_bench import client_result, server_env  # noqa: E402
from pdkit import make_tiny_llama  # noqa: E402
from soak_kit import Checker, HostLayout, complete, fixed_prompts, http_call, prom_sum, slope_per_min, tree_rss_mib  # noqa: E402

from kvbridge.testing.hosts import EmulatedHosts, Host, unavailable  # noqa: E402

PORTS = {"prefill": 8100, "decode": 8200, "proxy": 8000}
PROXY_TIMEOUT_S = 60  # longer than any fault here: a stalled decode stream must outlive a consumer-side drop
PREFILL_TIMEOUT_S = 5  # a producer behind a cut link costs a request this much, then it is recomputed
FAULT_KINDS = ("crash", "link", "drop", "drop-b")
CHECK_TOKENS = 8


def plan_faults(rng: random.Random, seconds: float, gap: tuple[float, float], quiet_s: float) -> list[dict[str, Any]]:
    """Faults, each ``after`` a random gap once the one before has ended (a restart's time varies with the
    machine's load: the gap keeps a stretch of healthy P/D between faults), kinds in shuffled rounds of
    FAULT_KINDS; as many as could start before ``seconds - quiet_s`` were every fault instant."""
    plan: list[dict[str, Any]] = []
    at, kinds = 0.0, list[str]()
    while True:
        after = rng.uniform(*gap)
        at += after
        if at > seconds - quiet_s:
            return plan
        if not kinds:
            kinds = rng.sample(FAULT_KINDS, len(FAULT_KINDS))
        kind = kinds.pop()
        hold = rng.uniform(2, 4) if kind == "drop-b" else rng.uniform(3, 8)
        plan.append({"after": round(after, 1), "kind": kind, "hold_s": round(hold, 1)})


class Soak:
    def __init__(self, work: Path, model: Path, hosts: list[Host], args: argparse.Namespace):
        self.work, self.model, self.args = work, model, args
        self.a, self.b, self.c = hosts
        self.lay = HostLayout("soak", work, model)
        self.t0 = time.monotonic()
        self.faults: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.rounds: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.last_fault_end = 0.0
        self.deadline = 0.0  # monotonic; a fault that ends late pushes it back (the quiet tail stays)
        self.faulting = threading.Event()  # the client goes on while a fault lasts, whatever the deadline
        self.life_up: dict[int, float] = {}  # producer life -> when it was healthy

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def say(self, text: str) -> None:
        print(f"[soak {self.now():7.1f} s] {text}", flush=True)

    # ---- set-up ------------------------------------------------------------------------------------------
    def start(self) -> None:
        lay = self.lay
        lay.place("prefill", self.a, PORTS["prefill"], core=0)
        lay.place("decode", self.b, PORTS["decode"], core=1)
        lay.server("prefill", {"kv_connector": "kvbridge.UCXConnector", "kv_role": "kv_producer"}, port=PORTS["prefill"])
        lay.server("decode", {"kv_connector": "kvbridge.UCXConnector", "kv_role": "kv_consumer",
                              "kv_load_failure_policy": "recompute"}, port=PORTS["decode"])  # fmt: skip
        lay.proxy_on(self.c, PORTS["proxy"], PROXY_TIMEOUT_S, PREFILL_TIMEOUT_S)
        up = lay.wait_up(["proxy", "prefill", "decode"])
        self.say(f"servers healthy in {up:.0f} s: producer {self.a}, consumer {self.b}, proxy {self.c}")

    def reference(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        """Each fixed prompt's greedy answer from the consumer alone (no hand-off), before any fault."""
        return [complete(self.c, self.b.address, PORTS["decode"], p, "reference", CHECK_TOKENS, 120) for p in prompts]

    # ---- background: samples and the client ----------------------------------------------------------------
    def metrics(self, role: str) -> str:
        host = self.lay.hosts[role]
        try:
            status, body = http_call(self.c, host.address, PORTS[role], "GET", "/metrics", timeout=10)
        except OSError:
            return ""
        return body.decode(errors="replace") if status == 200 else ""

    def sampler(self) -> None:
        while not self.stop.is_set():
            row: dict[str, Any] = {"t": self.now(), "load1": os.getloadavg()[0]}
            for role, proc in self.lay.procs.items():
                row[role] = round(tree_rss_mib(proc.pid), 1) if proc.poll() is None else None
            row["producer_life"] = self.lay.lives["prefill"]
            text = self.metrics("decode")
            if text:
                row["loaded_blocks"] = prom_sum(text, "kvbridge_transfer_blocks_total", direction="load")
                row["failed_blocks"] = prom_sum(text, "kvbridge_failed_blocks_total")
            self.samples.append(row)
            self.stop.wait(self.args.sample_s)

    def client(self) -> None:
        rate, i = 0.0, 0
        while (time.monotonic() < self.deadline or self.faulting.is_set()) and not self.stop.is_set():
            left = max(10.0, self.deadline - time.monotonic())
            n = self.args.concurrency * 6 if not rate else max(self.args.concurrency * 2, int(rate * min(120.0, left)))
            log = self.work / f"bench-{i}.log"
            cmd = [sys.executable, str(VLLM_TESTS / "helpers" / "bench_client.py"), "--backend", "vllm",
                   "--base-url", f"http://{self.c.address}:{PORTS['proxy']}", "--model", "tiny",
                   "--tokenizer", str(self.model), "--dataset-name", "random", "--random-input-len",
                   str(self.args.input_len), "--random-output-len", str(self.args.output_len), "--ignore-eos",
                   "--num-prompts", str(n), "--request-rate", "inf", "--max-concurrency", str(self.args.concurrency),
                   "--seed", str(self.args.seed * 1000 + i), "--disable-tqdm", "--save-detailed",
                   "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "99"]  # fmt: skip
            start = self.now()
            with open(log, "w") as out:
                proc = self.c.popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env())
            try:
                res = client_result(proc, log)
            except RuntimeError as exc:
                res = {"completed": 0, "failed": n, "errors": [str(exc)[-500:]]}
            res.update(round=i, prompts=n, start=start, end=self.now())
            self.rounds.append(res)
            self.say(f"client round {i}: {n} prompts, completed {res.get('completed')}, failed {res.get('failed')}, "
                     f"{res.get('request_throughput') or 0:.2f} req/s")  # fmt: skip
            rate = res.get("request_throughput") or rate
            i += 1

    # ---- faults ------------------------------------------------------------------------------------------
    def fault(self, f: dict[str, Any]) -> None:
        self.faulting.set()
        rec = {**f, "start": self.now()}
        kind, hold = f["kind"], f["hold_s"]
        if kind == "crash":
            self.a.crash()
            self.say("host A crashed (every process killed)")
            time.sleep(1)
            self.a.boot()
            self.lay.restart("prefill")
            rec["restart_s"] = round(self.lay.wait_up(["prefill"]), 1)
            self.life_up[self.lay.lives["prefill"]] = self.now()
            self.say(f"host A booted, producer restarted and healthy in {rec['restart_s']} s")
        elif kind == "link":
            self.a.link_down()
            self.say(f"host A link down for {hold} s")
            time.sleep(hold)
            self.a.link_up()
        elif kind == "drop":
            self.a.drop()
            self.say(f"host A drops every packet for {hold} s")
            time.sleep(hold)
            self.a.undrop()
        else:
            self.b.drop()
            self.say(f"host B (consumer) drops every packet for {hold} s")
            time.sleep(hold)
            self.b.undrop()
        rec["end"] = self.now()
        self.last_fault_end = rec["end"]
        self.faults.append(rec)
        self.deadline = max(self.deadline, time.monotonic() + self.args.quiet_s)
        self.faulting.clear()

    # ---- the run -----------------------------------------------------------------------------------------
    def run(self, seconds: float) -> dict[str, Any]:
        self.start()
        prompts = fixed_prompts(self.args.check_prompts, self.args.input_len, self.args.seed)
        reference = self.reference(prompts)
        rng = random.Random(self.args.seed)
        plan = self.args.plan or plan_faults(rng, seconds, (self.args.min_gap, self.args.max_gap), self.args.quiet_s)
        self.say(f"fault plan: {plan}")
        before = {"proxy": self.metrics("proxy"), "decode": self.metrics("decode")}
        self.t0 = time.monotonic()
        self.deadline = self.t0 + seconds
        self.life_up[1] = 0.0
        checker = Checker(self.c, PORTS["proxy"], prompts, reference, CHECK_TOKENS, self.t0)
        threads = [threading.Thread(target=self.sampler, daemon=True), checker,
                   threading.Thread(target=self.client, daemon=True)]  # fmt: skip
        for t in threads:
            t.start()
        for f in plan:
            time.sleep(max(0.0, self.t0 + self.last_fault_end + f["after"] - time.monotonic()))
            if time.monotonic() > self.t0 + seconds - self.args.quiet_s:
                self.say(f"faults from {f} on skipped: the quiet tail has begun")
                break
            self.fault(f)
        while time.monotonic() < self.deadline:
            time.sleep(max(0.0, self.deadline - time.monotonic()))
        threads[2].join(timeout=900)  # the client's last round ends by itself
        checker.stop.set()
        checker.join(timeout=180)
        self.stop.set()
        threads[0].join(timeout=30)
        return self.report(checker, before)

    def report(self, checker: Checker, before: dict[str, str]) -> dict[str, Any]:
        proxy, decode = self.metrics("proxy"), self.metrics("decode")
        completed = sum(r.get("completed") or 0 for r in self.rounds)
        failed = sum(r.get("failed") or 0 for r in self.rounds)
        warm = [s for s in self.samples if s["t"] >= self.args.warmup_s] or self.samples
        memory: dict[str, Any] = {}
        for role, name in (("decode", "consumer"), ("proxy", "proxy"), ("prefill", "producer")):
            lives = sorted({s["producer_life"] for s in warm}) if role == "prefill" else [None]
            for life in lives:
                pts = [(s["t"], s[role]) for s in warm if s.get(role) and (life is None or s["producer_life"] == life)]
                if life is not None:  # a restarted producer: judged from its warm-up after it was healthy
                    pts = [p for p in pts if p[0] >= self.life_up.get(life, 1e9) + (self.args.warmup_s if life > 1 else 0)]
                if not pts:
                    continue
                key = name if life is None else f"{name} life {life}"
                half = [p for p in pts if p[0] >= (pts[0][0] + pts[-1][0]) / 2]
                memory[key] = {"first_mib": pts[0][1], "last_mib": pts[-1][1], "max_mib": max(v for _, v in pts),
                               "slope_mib_per_min": round(slope_per_min(pts), 2),
                               "second_half_slope_mib_per_min": round(slope_per_min(half), 2), "samples": len(pts),
                               "span_s": round(pts[-1][0] - pts[0][0], 1)}  # fmt: skip
        # blocks loaded since the last sample taken before the last fault ended
        upto = [s["loaded_blocks"] for s in self.samples if "loaded_blocks" in s and s["t"] <= self.last_fault_end]
        loads_after = prom_sum(decode, "kvbridge_transfer_blocks_total", direction="load") - (upto[-1] if upto else 0)

        def delta(text: str, base: str, name: str, **labels: str) -> float:
            return prom_sum(text, name, **labels) - prom_sum(base, name, **labels)

        kv = {
            "loads": delta(decode, before["decode"], "kvbridge_transfers_total", direction="load"),
            "loaded_blocks": delta(decode, before["decode"], "kvbridge_transfer_blocks_total", direction="load"),
            "failed_blocks": delta(decode, before["decode"], "kvbridge_failed_blocks_total"),
            "load_failures": delta(decode, before["decode"], "kvbridge_transfer_failures_total", direction="load"),
            "refused_handoffs": delta(decode, before["decode"], "kvbridge_handoffs_total", outcome="refused"),
            "loaded_blocks_after_last_fault": loads_after,
            "proxy_requests": delta(proxy, before["proxy"], "kvbridge_proxy_requests_total"),
            "proxy_prefill_failures": delta(proxy, before["proxy"], "kvbridge_proxy_prefill_failures_total"),
            "proxy_prefill_fallbacks": delta(proxy, before["proxy"], "kvbridge_proxy_prefill_fallbacks_total"),
            "proxy_decode_failures": delta(proxy, before["proxy"], "kvbridge_proxy_decode_failures_total"),
        }
        loads1 = [s["load1"] for s in self.samples]
        check = checker.report()
        ok = (failed == 0 and check["wrong_outputs"] == 0 and check["failed_requests"] == 0 and loads_after > 0
              and check["loaded_checks"] > 0)  # the answers compared include ones decoded from loaded KV
        return {
            "ok": ok, "seconds": round(self.now(), 1), "concurrency": self.args.concurrency, "seed": self.args.seed,
            "client": {"completed": completed, "failed": failed, "rounds": self.rounds,
                       "busy_s": round(sum(r["end"] - r["start"] for r in self.rounds), 1)},
            "checker": check, "kvbridge": kv, "memory": memory, "faults": self.faults,
            "load_average": {"mean": round(sum(loads1) / max(1, len(loads1)), 2), "max": max(loads1, default=0.0)},
            "cpus": os.cpu_count(), "samples": self.samples,
        }  # fmt: skip


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """One soak of ``args.minutes`` (see the module's text); the report."""
    work = Path(args.work or tempfile.mkdtemp(prefix="soak-hosts-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work dir {work}", flush=True)
    model = make_tiny_llama(work / "tiny-llama", max_positions=1024)
    with EmulatedHosts(3) as hosts:
        s = Soak(work, model, hosts, args)
        try:
            return s.run(args.minutes * 60)
        finally:
            s.stop.set()
            s.lay.close()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="the JSON report")
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--min-gap", type=float, default=25.0, help="seconds from one fault's end to the next one's start, at least")
    ap.add_argument("--max-gap", type=float, default=60.0, help="the same gap, at most")
    ap.add_argument("--quiet-s", type=float, default=60.0, help="the run's last seconds, without faults")
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between memory samples")
    ap.add_argument("--warmup-s", type=float, default=60.0, help="memory samples before this are not judged")
    ap.add_argument("--check-prompts", type=int, default=8)
    ap.add_argument("--work", default="", help="work directory (logs); default a new temporary one")
    ap.set_defaults(plan=None)
    return ap


def main() -> int:
    args = parser().parse_args()
    why = unavailable()
    if why:
        print(f"soak_hosts: cannot run here: {why}", file=sys.stderr)
        return 77
    rep = soak(args)
    slim = {k: v for k, v in rep.items() if k != "samples"}
    print(json.dumps(slim, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rep, indent=1))
        print(f"written to {args.out}")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
