"""``kvbridge simulate``: what disaggregating prefill and decode buys and costs, before buying the GPUs.

``--preset toy-go`` is the published toy simulation that motivates P/D disaggregation (kvbridge/simulate/toy.py),
reproducing its table; the default is an engine model (kvbridge/simulate/model.py): continuous batching, decode
steps costing a fixed + per-sequence + per-context-token time, prefill a time per token, a KV capacity, chunked
prefill, xP:yD pools and the KV hand-off measured by ``kvbridge bench --json`` (``--from-bench``) over a link
shared by the transfers in flight; from ``kvbridge bench hosts --json``, per row and link (measured, or
derived for a link the bench did not run: kvbridge/simulate/hostbench.py), with the answer "does P/D pay". Every figure is a median over ``--seeds`` runs with a 95% interval;
``--sweep-rate`` finds each layout's goodput (the highest rate at which 90% of requests meet the TTFT and TPOT
targets); ``--json`` and ``--plot`` write them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge.errors import ConfigError
from kvbridge.simulate import hostbench
from kvbridge.simulate import inputs as inp
from kvbridge.simulate import toy as sim_toy
from kvbridge.simulate.model import KV_BYTES_PER_TOKEN, EngineModel, HandOff, Layout, Result, Workload, make_requests
from kvbridge.simulate.model import simulate as simulate_engine
from kvbridge.simulate.stats import Slo, gaps, goodput, metrics, summarize

PRESETS = {"default": Workload(), "toy-go": sim_toy.WORKLOAD}
SEEDS = {"default": 10, "toy-go": 100}
# flags of the engine model, meaningless for the toy (whose steps are the article's fixed 5 ms jobs)
ENGINE_FLAGS = ("calibrate", "kv_tokens", "kv_full", "max_seqs", "step_ms", "seq_ms", "ctx_ms_per_ktok",
                "prefill_ms_per_ktok", "chunk_tokens")  # fmt: skip


def configure(parser: argparse.ArgumentParser) -> None:
    def one_line(message: str) -> None:  # a bad flag: one line on stderr, exit 2 (no usage block)
        parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")

    setattr(parser, "error", one_line)  # noqa: B010
    d, m, s = Workload(), EngineModel(), Slo()
    add = parser.add_argument
    add(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="toy-go: the published toy simulation, its table reproduced; default: the engine model",
    )
    add("--seeds", type=inp.positive_int, help="runs (seeds --seed, --seed+1, ...) per figure (default 10; toy-go 100)")
    add("--seed", type=inp.count, default=0, help="first seed (default 0)")
    g = parser.add_argument_group("workload (defaults: the preset's)")
    g.add_argument("--requests", type=inp.positive_int, help=f"requests per run (default {d.requests})")
    g.add_argument(
        "--rate", type=inp.positive_float, help=f"arrivals per second (default {d.rate:g}; toy-go 1/0.426 s)"
    )
    g.add_argument("--arrivals", choices=("poisson", "fixed"), help="Poisson, or a fixed spacing 1/rate (toy-go)")
    g.add_argument("--long-frac", type=inp.fraction, help=f"share of long prompts (default {d.long_frac:g})")
    g.add_argument("--short-tokens", type=inp.token_range, help="short prompt lengths, A-B tokens (default 300-900)")
    g.add_argument("--long-tokens", type=inp.token_range, help="long prompt lengths, A-B tokens (default 7000-18000)")
    g.add_argument(
        "--output-tokens", type=inp.token_range, help="tokens generated, the first included (default 256; toy-go 21)"
    )
    g.add_argument(
        "--shape", choices=sorted(KV_BYTES_PER_TOKEN), default="8b", help="model whose KV bytes/token are handed off"
    )
    g = parser.add_argument_group("layouts")
    g.add_argument("--servers", type=inp.positive_int, default=2, help="engines of the colocated layouts (default 2)")
    g.add_argument(
        "--pools", type=inp.pools, help="disaggregated xP:yD, comma-separated (default 1:1 ... every x+y = servers)"
    )
    g.add_argument(
        "--chunk-tokens",
        type=inp.count,
        help="token budget of a chunked-prefill step (default 2048; 0 leaves chunked out)",
    )
    g = parser.add_argument_group("engine model (defaults: 8B on an H100-class GPU)")
    g.add_argument(
        "--calibrate",
        type=inp.calibration_file,
        metavar="JSON",
        help="fit the step costs to measured step times (see sim_inputs.calibration_file)",
    )
    g.add_argument("--step-ms", type=inp.non_negative_float, help=f"fixed cost of a step (default {m.step_ms:g})")
    g.add_argument(
        "--seq-ms", type=inp.non_negative_float, help=f"cost per sequence in the decode batch (default {m.seq_ms:g})"
    )
    g.add_argument(
        "--ctx-ms-per-ktok",
        type=inp.non_negative_float,
        help=f"cost per 1000 context tokens the batch reads (default {m.ctx_ms_per_ktok:g})",
    )
    g.add_argument(
        "--prefill-ms-per-ktok",
        type=inp.positive_float,
        help=f"prefill cost per 1000 prompt tokens (default {m.prefill_ms_per_ktok:g})",
    )
    g.add_argument(
        "--kv-tokens", type=inp.positive_int, help=f"KV capacity of an engine, tokens (default {m.kv_tokens})"
    )
    g.add_argument(
        "--kv-full",
        choices=("preempt", "queue"),
        help="when KV is full: preempt the newest and recompute it (default), or admit only what fits",
    )
    g.add_argument("--max-seqs", type=inp.positive_int, help=f"largest decode batch (default {m.max_seqs})")
    g = parser.add_argument_group("KV hand-off")
    g.add_argument(
        "--from-bench",
        type=inp.bench_file,
        metavar="JSON",
        help="fit fixed + per-byte cost per backend from kvbridge bench --json, or per row and link from "
        "kvbridge bench hosts --json (then: does P/D pay at each --links)",
    )
    g.add_argument(
        "--bench-backend",
        type=inp.names,
        help="with --from-bench: the backends (bench hosts: rows) to simulate (default: every one in the file)",
    )
    g.add_argument(
        "--links",
        type=inp.links,
        help="with a bench hosts --from-bench: the links to answer for, tc rates (default 10gbit,25gbit,100gbit; "
        "none: the uncapped link); one the file did not run is derived from its uncapped run",
    )
    g.add_argument(
        "--transfer-gbps", type=inp.bandwidth, help="link bandwidth without --from-bench, GB/s (default 25; inf: free)"
    )
    g.add_argument("--transfer-fixed-ms", type=inp.non_negative_float, help="fixed cost of a hand-off (default 1)")
    g = parser.add_argument_group("SLO and output")
    g.add_argument(
        "--slo-ttft-ms", type=inp.positive_float, default=s.ttft_ms, help=f"TTFT target (default {s.ttft_ms:g})"
    )
    g.add_argument(
        "--slo-tpot-ms", type=inp.positive_float, default=s.tpot_ms, help=f"TPOT target (default {s.tpot_ms:g})"
    )
    g.add_argument(
        "--sweep-rate",
        type=inp.sweep,
        metavar="A:B:STEP",
        help="also run every rate A..B: SLO attainment and goodput per layout",
    )
    g.add_argument("--json", type=inp.out_file, metavar="FILE", help="write the figures as JSON (- for stdout)")
    g.add_argument(
        "--plot",
        type=inp.plot_file,
        metavar="FILE",
        help="write ITL CDF (+ TTFT and goodput vs rate with --sweep-rate)",
    )


def workload(args: argparse.Namespace) -> Workload:
    w = PRESETS[args.preset]
    given = {k: getattr(args, k) for k in ("requests", "rate", "arrivals", "long_frac", "short_tokens", "long_tokens",
                                          "output_tokens") if getattr(args, k, None) is not None}  # fmt: skip
    return dataclasses.replace(w, **given, kv_bytes_per_token=KV_BYTES_PER_TOKEN[args.shape])


def engine(args: argparse.Namespace) -> EngineModel:
    m = EngineModel()
    if args.calibrate is not None:
        m = args.calibrate.apply(m)
    given = {k: getattr(args, k) for k in ("step_ms", "seq_ms", "ctx_ms_per_ktok", "prefill_ms_per_ktok", "kv_tokens",
                                          "kv_full", "max_seqs") if getattr(args, k) is not None}  # fmt: skip
    return dataclasses.replace(m, **given)


def handoffs(args: argparse.Namespace) -> list[HandOff]:
    """The hand-off models to simulate: per backend of --from-bench (per row and link of a bench hosts file),
    else the --transfer-* one."""
    hosts = args.from_bench.hosts if args.from_bench is not None else None
    if args.links and hosts is None:
        raise ConfigError("--links needs --from-bench with a kvbridge bench hosts --json file")
    if hosts is not None:
        return hosts.handoffs(args.bench_backend, args.links or hostbench.LINKS)[0]
    if args.from_bench is None:
        if args.bench_backend:
            raise ConfigError("--bench-backend needs --from-bench")
        gbps = 25.0 if args.transfer_gbps is None else args.transfer_gbps
        fixed = 1.0 if args.transfer_fixed_ms is None else args.transfer_fixed_ms
        return [HandOff("nominal", fixed, gbps, f"{fixed:g} ms + {gbps:g} GB/s (--transfer-*)")]
    fits = args.from_bench.handoffs
    unknown = [b for b in args.bench_backend or () if b not in fits]
    if unknown:
        raise ConfigError(
            f"--bench-backend {','.join(unknown)}: not in {args.from_bench.path} (it has {', '.join(fits)})"
        )
    return [fits[b] for b in args.bench_backend or fits]


def layouts(args: argparse.Namespace) -> list[Layout]:
    toy = args.preset == "toy-go"
    out = [Layout("colocated", "colocated", servers=args.servers)]
    chunk = 2048 if args.chunk_tokens is None else args.chunk_tokens
    if not toy and chunk:
        out.append(Layout("chunked", "chunked", servers=args.servers, chunk=chunk))
    pools = args.pools or [(p, args.servers - p) for p in range(1, args.servers)] or [(1, 1)]
    kv = handoffs(args)
    explicit = args.from_bench is not None or args.transfer_gbps is not None or args.transfer_fixed_ms is not None
    if toy:  # the article's hand-off is free; a measured one is an extra layout
        kinds: list[HandOff | None] = [None, *(kv if explicit else [])]
    else:
        kinds = list(kv)
    for p, d in pools:
        for h in kinds:
            name = "disaggregated" if len(pools) == 1 else f"disaggregated {p}P:{d}D"
            if h is not None and (toy or len(kinds) > 1):
                name += f" {h.name}"
            out.append(Layout(name, "disaggregated", servers=p + d, pools=(p, d), handoff=h))
    return out


def run_once(preset: str, layout: Layout, w: Workload, model: EngineModel, seed: int) -> Result:
    reqs = make_requests(w, seed)
    if preset == "toy-go":
        return sim_toy.simulate(layout, reqs, w.kv_bytes_per_token)
    return simulate_engine(layout, reqs, model, w.kv_bytes_per_token)


def run_seeds(
    preset: str,
    lays: Sequence[Layout],
    w: Workload,
    model: EngineModel,
    seeds: Sequence[int],
    slo: Slo,
    keep_gaps: bool = False,
) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]]:
    """Per layout, the summary over ``seeds`` (and, with ``keep_gaps``, every gap of every run, ms)."""
    out, pooled = {}, {}
    for lay in lays:
        runs, all_gaps = [], []
        for seed in seeds:
            r = run_once(preset, lay, w, model, seed)
            runs.append(metrics(r, slo))
            if keep_gaps:
                all_gaps.append(gaps(r) * 1e3)
        out[lay.name] = summarize(runs)
        if keep_gaps:
            pooled[lay.name] = np.concatenate(all_gaps)
    return out, pooled


def _plain(value: Any) -> Any:
    """``value`` with every non-finite number as a string: strict JSON (``inf`` GB/s is a free link)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def describe(lay: Layout) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": lay.kind}
    if lay.kind == "disaggregated":
        d["pools"] = list(lay.pools)
        d["handoff"] = dataclasses.asdict(lay.handoff) if lay.handoff else "free (the article's)"
    else:
        d["servers"] = lay.servers
    if lay.kind == "chunked":
        d["chunk_tokens"] = lay.chunk
    return d


def check(args: argparse.Namespace, w: Workload, model: EngineModel) -> None:
    """Flags that parse one by one but not together: one line, exit 2 (kvbridge.cli), before any run."""
    if args.preset == "toy-go":
        bad = [f"--{k.replace('_', '-')}" for k in ENGINE_FLAGS if getattr(args, k) is not None]
        if bad:
            raise ConfigError(
                f"{', '.join(bad)}: not for --preset toy-go (its steps are the article's fixed 5 ms jobs)"
            )
        return
    need = max(w.short_tokens[1], w.long_tokens[1] if w.long_frac else 0) + w.output_tokens[1]
    if need > model.kv_tokens:
        raise ConfigError(f"a request can need {need} KV tokens, more than --kv-tokens {model.kv_tokens}")


def _cell(summary: dict[str, Any], key: str, fmt: str, ci: bool) -> str:
    v = format(summary[key], fmt)
    if not ci or summary["seeds"] < 2:
        return v
    lo, hi = summary["ci95"][key]
    return f"{v} [{format(lo, fmt)}-{format(hi, fmt)}]"


def table(results: dict[str, dict[str, Any]], reference: dict[str, dict[str, float]] | None = None) -> str:
    cols = [("TTFT mean", "ttft_mean_ms", ".0f", True), ("TTFT p99", "ttft_p99_ms", ".0f", False),
            ("ITL mean", "itl_mean_ms", ".1f", True), ("ITL p99", "itl_p99_ms", ".1f", True),
            ("ITL p99.9", "itl_p999_ms", ".0f", False), ("ITL max", "itl_max_ms", ".0f", False), ("TPOT p99", "tpot_p99_ms", ".1f", False),
            ("hand-off", "handoff_mean_ms", ".1f", False), ("SLO met", "slo_attainment", ".0%", False)]  # fmt: skip
    rows = [["layout", *(c[0] for c in cols)]]
    for name, s in results.items():
        rows.append([name, *(_cell(s, k, f, ci) for _, k, f, ci in cols)])
        ref = (reference or {}).get(name)
        if ref:
            rows.append(["  the article", *(format(ref[k], f) if k in ref else "" for _, k, f, _ in cols)])
            rows.append(["  error", *(f"{(s[k] / ref[k] - 1) * 100:+.1f}%" if k in ref else "" for _, k, _, _ in cols)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(wd) if i == 0 else c.rjust(wd) for i, (c, wd) in enumerate(zip(r, widths)))
                     for r in rows)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    w, model = workload(args), engine(args)
    check(args, w, model)
    lays = layouts(args)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    n = args.seeds or SEEDS[args.preset]
    seeds = range(args.seed, args.seed + n)
    toy = args.preset == "toy-go"
    results, pooled = run_seeds(args.preset, lays, w, model, seeds, slo, keep_gaps=bool(args.plot))
    sweep: dict[str, Any] | None = None
    if args.sweep_rate:
        per: dict[str, dict[str, list[float]]] = {lay.name: {} for lay in lays}
        for rate in args.sweep_rate:
            print(f"  sweep: {rate:g} req/s", file=sys.stderr, flush=True)
            at, _ = run_seeds(args.preset, lays, dataclasses.replace(w, rate=rate), model, seeds, slo)
            for name, s in at.items():
                for k in ("slo_attainment", "ttft_mean_ms", "ttft_p99_ms", "itl_p99_ms", "itl_max_ms", "tpot_p99_ms"):
                    per[name].setdefault(k, []).append(s[k])
        sweep = {"rates": args.sweep_rate, "layouts": per,
                 "goodput_rps": {name: goodput(args.sweep_rate, s["slo_attainment"], slo) for name, s in per.items()}}  # fmt: skip
    arrivals = f"fixed spacing {1e3 / w.rate:.0f} ms" if w.arrivals == "fixed" else f"Poisson {w.rate:g}/s"
    out_tok = f"{w.output_tokens[0]}" + (f"-{w.output_tokens[1]}" if w.output_tokens[1] != w.output_tokens[0] else "")
    head = (f"kvbridge simulate --preset {args.preset}: {w.requests} requests, {arrivals}, {w.long_frac:.0%} long prompts "
            f"({w.long_tokens[0]}-{w.long_tokens[1]} tokens), short {w.short_tokens[0]}-{w.short_tokens[1]}, "
            f"{out_tok} output tokens; medians [95% CI] over {n} seeds ({seeds[0]}-{seeds[-1]})")  # fmt: skip
    if toy:
        engine_line = "engine: the article's: every prefill (0.1 ms/token) and every 5 ms decode step its own job, FCFS"
    else:
        engine_line = (f"engine ({model.source}): step {model.step_ms:g} ms + {model.seq_ms:g} ms/seq + "
                       f"{model.ctx_ms_per_ktok:g} ms/1k context tokens; prefill {model.prefill_ms_per_ktok:g} ms/1k "
                       f"tokens; KV {model.kv_tokens} tokens ({model.kv_full} when full), <= {model.max_seqs} seqs")  # fmt: skip
    kvs = {lay.handoff.name: lay.handoff.source for lay in lays if lay.handoff}
    out = sys.stderr if args.json == "-" else sys.stdout  # the table, unless stdout is the JSON's
    print(head, file=out)
    print(engine_line, file=out)
    hosts = args.from_bench.hosts if args.from_bench is not None else None
    if hosts is not None:
        print(f"hand-offs from kvbridge bench hosts ({hosts.path}): each row's fixed cost + bytes / GB/s fitted per "
              "link cap; each decode engine's link shared by the transfers in flight", file=out)  # fmt: skip
        for line in hosts.handoffs(args.bench_backend, args.links or hostbench.LINKS)[1]:
            print(f"  {line}", file=out)
        for name, src in kvs.items():
            print(f"hand-off {name}: {src}", file=out)
    else:
        for name, src in kvs.items():
            print(f"hand-off {name}: {src}; each decode engine's link shared by the transfers in flight", file=out)
    print(f"SLO: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms\n", file=out)
    print(table(results, sim_toy.REFERENCE if toy else None), file=out)
    if sweep:
        print(f"\nSLO attainment (median over seeds) by request rate; goodput = the highest rate up to which "
              f">= {slo.attainment:.0%} of requests meet the SLO", file=out)  # fmt: skip
        names = list(sweep["layouts"])
        rows = [["req/s", *names]] + [[f"{r:g}", *(f"{sweep['layouts'][nm]['slo_attainment'][i]:.0%}" for nm in names)]
                                      for i, r in enumerate(sweep["rates"])]  # fmt: skip
        rows.append(["goodput", *(f"{sweep['goodput_rps'][nm]:g}/s" for nm in names)])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        print("\n".join("  ".join(c.rjust(wd) for c, wd in zip(r, widths)) for r in rows), file=out)
    verdict = hostbench.answer(lays, results, sweep["goodput_rps"] if sweep else None) if hosts else []
    if verdict:
        print(f"\n{hostbench.answer_table(verdict, w.rate)}", file=out)
    doc = {
        "preset": args.preset,
        "seeds": n,
        "first_seed": args.seed,
        "workload": dataclasses.asdict(w),
        "engine": "toy-go" if toy else dataclasses.asdict(model),
        "slo": dataclasses.asdict(slo),
        "layouts": {lay.name: {**describe(lay), **results[lay.name]} for lay in lays},
    }
    if toy:
        doc["reference"] = sim_toy.REFERENCE
        doc["error_pct"] = {k: {f: (results[k][f] / ref - 1) * 100 for f, ref in refs.items()}
                            for k, refs in sim_toy.REFERENCE.items() if k in results}  # fmt: skip
    if sweep:
        doc["sweep"] = sweep
    if verdict:
        doc["pd_pays"] = verdict
    doc = _plain(doc)
    if args.json == "-":
        print(json.dumps(doc, indent=1, allow_nan=False))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
        print(f"\nwrote {args.json}", file=out)
    if args.plot:
        from kvbridge.simulate.plot import plot

        kv = ", ".join(
            f"{h.name} {h.fixed_ms:.3g} ms + {h.gbps:.3g} GB/s"
            for h in dict.fromkeys(lay.handoff for lay in lays if lay.handoff)
        )
        title = head.split(";")[0] + (f"; hand-off {kv}" if kv else "")
        plot(args.plot, title, pooled, sweep, slo, arrivals)
        print(f"wrote {args.plot}", file=out)
    return 0


__all__ = ["configure", "handoffs", "layouts", "run", "run_once", "run_seeds", "workload"]
