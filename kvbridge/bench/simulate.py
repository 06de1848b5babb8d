"""``kvbridge simulate``: a discrete-event what-if of colocated vs disaggregated prefill/decode serving.

Requests arrive (Poisson, seeded) with a mix of short and long prompts. A *colocated* server runs
both phases: a prefill, while it runs, blocks the decode steps of every request on that server
(prefill first, no chunking). A *disaggregated* deployment of ``xP:yD`` runs prefills on ``x``
servers and decodes on ``y``; each request's KV is handed off over the decode server's link (one
transfer at a time, FIFO) and costs ``latency + bytes / GB/s`` — the cost toy simulations leave out.

Decode is continuous batching: one step of ``decode_ms`` serves every request active when it starts.
Every request gets ``1 + decode_steps`` tokens: the first from its prefill (delivered, under
disaggregation, when its KV has arrived on the decode server), then one per decode step. Reports
p50/p99 inter-token latency, mean/p99 time to first token, and goodput under an SLO.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import json
import math
import random
from collections.abc import Sequence
from typing import Any

# KV bytes per token of kvbridge.bench.core.SHAPES, without importing torch (this module is pure Python)
KV_BYTES_PER_TOKEN = {"8b": 32 * 2 * 8 * 128 * 2, "70b": 80 * 2 * 8 * 128 * 2}


@dataclasses.dataclass(frozen=True)
class Workload:
    """The requests: ``requests`` Poisson arrivals at ``rate``/s, ``long_frac`` of them long prompts.

    A prompt's length is its prefill time times ``prefill_tps``; its KV is ``kv_bytes_per_token`` a token.
    """

    requests: int = 240
    rate: float = 2.0
    long_frac: float = 0.2
    short_ms: tuple[float, float] = (20.0, 120.0)
    long_ms: tuple[float, float] = (700.0, 1800.0)
    decode_steps: int = 20
    decode_ms: float = 5.0
    prefill_tps: float = 10_000.0
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN["8b"]
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Transfer:
    """KV hand-off cost: ``latency_ms + bytes / gbps``, or ``fixed_ms`` per request when given."""

    gbps: float = 5.0
    latency_ms: float = 1.0
    fixed_ms: float | None = None

    def seconds(self, nbytes: int) -> float:
        if self.fixed_ms is not None:
            return self.fixed_ms / 1e3
        return self.latency_ms / 1e3 + (
            nbytes / (self.gbps * 1e9) if self.gbps > 0 and not math.isinf(self.gbps) else 0.0
        )


@dataclasses.dataclass(frozen=True)
class Request:
    id: int
    arrival: float
    prefill_s: float
    tokens: int
    long: bool


def make_requests(w: Workload) -> list[Request]:
    """The workload's requests, in arrival order (deterministic for a seed)."""
    rng = random.Random(w.seed)
    out, t = [], 0.0
    for i in range(w.requests):
        t += rng.expovariate(w.rate)
        long = rng.random() < w.long_frac
        lo, hi = w.long_ms if long else w.short_ms
        prefill = rng.uniform(lo, hi) / 1e3
        out.append(Request(i, t, prefill, max(1, round(prefill * w.prefill_tps)), long))
    return out


@dataclasses.dataclass
class Trace:
    """What happened to one request: when each of its tokens was emitted, and its KV hand-off time."""

    request: Request
    token_times: list[float] = dataclasses.field(default_factory=list)
    handoff_s: float = 0.0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.request.arrival

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclasses.dataclass
class _Server:
    idx: int
    role: str  # "both", "prefill" or "decode"
    queue: collections.deque[Trace] = dataclasses.field(default_factory=collections.deque)
    queued_s: float = 0.0
    active: list[Trace] = dataclasses.field(default_factory=list)
    busy_until: float | None = None
    work: tuple[str, Any] = ("idle", None)
    link_free: float = 0.0
    inbound: int = 0


def simulate(
    workload: Workload, transfer: Transfer, *, colocated: int = 0, pools: tuple[int, int] | None = None
) -> list[Trace]:
    """Serve the workload on ``colocated`` colocated servers, or on ``pools = (prefill, decode)`` servers."""
    if pools is None:
        servers = [_Server(i, "both") for i in range(colocated)]
    else:
        servers = [_Server(i, "prefill") for i in range(pools[0])] + [
            _Server(pools[0] + i, "decode") for i in range(pools[1])
        ]
    if not any(s.role != "decode" for s in servers) or not any(s.role != "prefill" for s in servers):
        raise ValueError("need at least one server for prefill and one for decode")
    w = workload
    done_after = 1 + w.decode_steps
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, data: Any) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, data))
        seq += 1

    def kick(s: _Server, now: float) -> None:
        if s.busy_until is not None:
            return
        if s.role != "decode" and s.queue:
            trace = s.queue.popleft()
            s.queued_s -= trace.request.prefill_s
            s.work, s.busy_until = ("prefill", trace), now + trace.request.prefill_s
        elif s.role != "prefill" and s.active:
            s.work, s.busy_until = ("decode", list(s.active)), now + w.decode_ms / 1e3
        else:
            return
        push(s.busy_until, "done", s)

    traces = [Trace(r) for r in make_requests(w)]
    for trace in traces:
        push(trace.request.arrival, "arrive", trace)
    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            s = min(
                (s for s in servers if s.role != "decode"),
                key=lambda s: (s.queued_s + max(0.0, (s.busy_until or now) - now), len(s.active), s.idx),
            )
            s.queue.append(data)
            s.queued_s += data.request.prefill_s
            kick(s, now)
        elif kind == "kv":  # a hand-off arrived: the first token reaches the client, decode begins
            d, trace = data
            d.inbound -= 1
            trace.token_times.append(now)
            d.active.append(trace)
            kick(d, now)
        else:
            s = data
            what, payload = s.work
            s.busy_until, s.work = None, ("idle", None)
            if what == "prefill" and s.role == "both":
                payload.token_times.append(now)
                s.active.append(payload)
            elif what == "prefill":
                d = min((d for d in servers if d.role == "decode"), key=lambda d: (len(d.active) + d.inbound, d.idx))
                start = max(now, d.link_free)
                d.link_free = start + transfer.seconds(payload.request.tokens * w.kv_bytes_per_token)
                d.inbound += 1
                payload.handoff_s = d.link_free - now
                push(d.link_free, "kv", (d, payload))
            else:
                for trace in payload:
                    trace.token_times.append(now)
                s.active = [t for t in s.active if len(t.token_times) < done_after]
            kick(s, now)
    return traces


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)] if ordered else math.nan


@dataclasses.dataclass(frozen=True)
class Slo:
    """A request meets the SLO when its TTFT and every one of its inter-token gaps are within bounds."""

    ttft_ms: float = 3000.0
    itl_ms: float = 100.0


def metrics(traces: Sequence[Trace], slo: Slo) -> dict[str, float]:
    """ITL p50/p99, TTFT mean/p99, mean hand-off (ms), goodput (requests/s meeting the SLO) and its share."""
    gaps = [g for t in traces for g in t.gaps]
    ttfts = [t.ttft for t in traces]
    good = sum(1 for t in traces if t.ttft * 1e3 <= slo.ttft_ms and max(t.gaps, default=0.0) * 1e3 <= slo.itl_ms)
    span = max(t.token_times[-1] for t in traces) - min(t.request.arrival for t in traces)
    return {
        "itl_p50_ms": percentile(gaps, 50) * 1e3,
        "itl_p99_ms": percentile(gaps, 99) * 1e3,
        "ttft_mean_ms": sum(ttfts) / len(ttfts) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "handoff_mean_ms": sum(t.handoff_s for t in traces) / len(traces) * 1e3,
        "goodput_rps": good / span,
        "slo_met": good / len(traces),
    }


def scenarios(
    workload: Workload, transfer: Transfer, servers: int, pools: Sequence[tuple[int, int]], slo: Slo
) -> list[tuple[str, dict[str, float]]]:
    """Colocated on ``servers``, then each ``xP:yD`` with the transfer cost, then the first with free hand-offs."""
    out = [(f"colocated x{servers}", metrics(simulate(workload, transfer, colocated=servers), slo))]
    for p, d in pools:
        out.append((f"{p}P:{d}D", metrics(simulate(workload, transfer, pools=(p, d)), slo)))
    if pools:
        p, d = pools[0]
        free = Transfer(gbps=math.inf, latency_ms=0.0)
        out.append((f"{p}P:{d}D free KV", metrics(simulate(workload, free, pools=(p, d)), slo)))
    return out


def gbps_from_bench(path: str, backend: str | None = None) -> tuple[float, str]:
    """The GB/s of the largest measured ``load``/``transfer`` in a ``kvbridge bench --json`` file."""
    with open(path) as f:
        records = json.load(f)
    picked = [
        r for r in records
        if r.get("op") in ("load", "transfer") and r.get("gbps") and (backend is None or r.get("backend") == backend)
    ]  # fmt: skip
    if not picked:
        raise SystemExit(
            f"kvbridge simulate: no measured load/transfer{f' of {backend!r}' if backend else ''} in {path}"
        )
    best = max(picked, key=lambda r: (r["bytes"], r["gbps"]))
    return float(best["gbps"]), f"{best['backend']} {best['op']} of {best['bytes'] >> 20} MiB in {path}"


def _range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition("-")
    return float(lo), float(hi or lo)


def _pools(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        p, _, d = part.strip().upper().replace("P", "").replace("D", "").partition(":")
        out.append((int(p), int(d)))
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    w, t, s = Workload(), Transfer(), Slo()
    add = parser.add_argument
    add("--requests", type=int, default=w.requests, help=f"number of requests (default {w.requests})")
    add("--rate", type=float, default=w.rate, help=f"Poisson arrivals per second (default {w.rate})")
    add("--servers", type=int, default=2, help="servers of the colocated deployment (default 2)")
    add("--pools", type=_pools, help="disaggregated pool sizes, e.g. 1:1,1:2 (default: every xP:yD with x+y = servers)")
    add("--long-frac", type=float, default=w.long_frac, help=f"share of long prompts (default {w.long_frac})")
    add("--short-ms", type=_range, default=w.short_ms, help="prefill time range of short prompts, ms (default 20-120)")
    add("--long-ms", type=_range, default=w.long_ms, help="prefill time range of long prompts, ms (default 700-1800)")
    add("--decode-steps", type=int, default=w.decode_steps, help=f"decode steps per request (default {w.decode_steps})")
    add("--decode-ms", type=float, default=w.decode_ms, help=f"time of one decode step (default {w.decode_ms})")
    add(
        "--prefill-tps",
        type=float,
        default=w.prefill_tps,
        help="prefill tokens/s: prompt length = time x this (default 10000)",
    )
    add(
        "--shape",
        choices=sorted(KV_BYTES_PER_TOKEN),
        default="8b",
        help="model whose KV bytes/token the hand-off moves (default 8b)",
    )
    add("--transfer-gbps", type=float, default=t.gbps, help=f"KV hand-off bandwidth, GB/s (default {t.gbps})")
    add("--transfer-latency-ms", type=float, default=t.latency_ms, help="fixed cost per hand-off (default 1)")
    add("--transfer-ms", type=float, help="hand-off time per request, ms (overrides the bandwidth model)")
    add("--from-bench", metavar="JSON", help="take --transfer-gbps from a kvbridge bench --json file")
    add("--bench-backend", help="with --from-bench: the backend whose figure to use")
    add("--slo-ttft-ms", type=float, default=s.ttft_ms, help=f"TTFT bound of the SLO (default {s.ttft_ms:g})")
    add("--slo-itl-ms", type=float, default=s.itl_ms, help=f"inter-token bound of the SLO (default {s.itl_ms:g})")
    add("--seed", type=int, default=w.seed, help="random seed (default 0)")
    add("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    source = "--transfer-gbps"
    gbps = args.transfer_gbps
    if args.from_bench:
        gbps, source = gbps_from_bench(args.from_bench, args.bench_backend)
    workload = Workload(
        args.requests, args.rate, args.long_frac, args.short_ms, args.long_ms, args.decode_steps, args.decode_ms,
        args.prefill_tps, KV_BYTES_PER_TOKEN[args.shape], args.seed,
    )  # fmt: skip
    transfer = Transfer(gbps, args.transfer_latency_ms, args.transfer_ms)
    pools = args.pools or [(p, args.servers - p) for p in range(1, args.servers)]
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    results = scenarios(workload, transfer, args.servers, pools, slo)
    if args.json:
        print(json.dumps([{"config": name, **m} for name, m in results], indent=1))
        return 0
    cost = (
        f"{args.transfer_ms:g} ms per request"
        if args.transfer_ms is not None
        else f"{gbps:.2f} GB/s ({source}) + {transfer.latency_ms:g} ms"
    )
    print(
        f"{workload.requests} requests at {workload.rate:g}/s (seed {workload.seed}); {workload.long_frac:.0%} long prompts "
        f"({workload.long_ms[0]:g}-{workload.long_ms[1]:g} ms prefill), short {workload.short_ms[0]:g}-{workload.short_ms[1]:g} ms; "
        f"{workload.decode_steps} decode steps of {workload.decode_ms:g} ms\n"
        f"KV {args.shape} = {workload.kv_bytes_per_token >> 10} KiB/token at {workload.prefill_tps:g} prefill tok/s; "
        f"hand-off {cost}; SLO TTFT <= {slo.ttft_ms:g} ms and every ITL <= {slo.itl_ms:g} ms\n"
    )
    head = ("config", "ITL p50", "ITL p99", "TTFT mean", "TTFT p99", "hand-off", "goodput", "SLO met")
    rows = [
        (name, f"{m['itl_p50_ms']:.1f}", f"{m['itl_p99_ms']:.1f}", f"{m['ttft_mean_ms']:.0f}", f"{m['ttft_p99_ms']:.0f}",
         f"{m['handoff_mean_ms']:.1f}", f"{m['goodput_rps']:.2f}/s", f"{m['slo_met']:.0%}")
        for name, m in results
    ]  # fmt: skip
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths))) + "   (ms)")
    for r in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return 0


__all__ = [
    "Request",
    "Slo",
    "Trace",
    "Transfer",
    "Workload",
    "make_requests",
    "metrics",
    "percentile",
    "scenarios",
    "simulate",
]
