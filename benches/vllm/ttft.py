"""Measure time to first token of prompts whose KV an engine loads from an fs store vs prompts it recomputes.

    .venv-vllm/bin/python benches/vllm/ttft.py [--tokens 1500] [--prompts 4] [--layout single|multi|core|both|all]
        [--block-size 32] [--max-tokens 1] [--batch] [--busy N] [--text] [--async-scheduling on|off]
        [--baseline miss|plain] [--env K=V ...] [--workdir DIR] [--json OUT]

A producer engine prefills every timed prompt into an fs store (its outputs are the reference the
loaded ones must equal). Then, for each layout — ``single``: engine loop, scheduler and worker in one
process, as vLLM's offline ``LLM`` runs; ``multi``: frontend, engine core and worker in three
processes, as a server runs; ``core``: frontend apart, engine core and worker in one process — one
consumer engine (fs connector) runs two warm-up requests, then alternately a stored prompt (loaded)
and a fresh prompt of the same length (recomputed: the store misses), each alone in a ``generate`` of
``max_tokens`` tokens; TTFT is that call's wall time. ``--baseline plain`` recomputes the stored prompts
themselves in an engine without a connector instead. ``--batch`` sends the loaded prompts in one
``generate`` and the recomputed ones in another; ``--busy N`` adds to each timed request a short one
decoding N tokens beside it (both take TTFT from vLLM's request metrics). Engines run one after the
other, never two at once, so they do not compete for cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdkit import Engine, kv_config, make_tiny_llama  # noqa: E402

# layout -> engine_run's "multiprocess", and LLM arguments
LAYOUTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "single": (False, {}),  # frontend, engine loop, scheduler and worker in one process (vLLM's offline LLM)
    "multi": (True, {}),  # frontend, engine core, worker: three processes (vLLM's default for a server)
    "core": (True, {"distributed_executor_backend": "uni"}),  # frontend; engine core and worker in one process
}


def _stats(ms: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(ms), 2), "mean_ms": round(statistics.mean(ms), 2),
            "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2)}  # fmt: skip


def measure(
    work: Path,
    *,
    tokens: int = 1500,
    prompts: int = 4,
    layouts: tuple[str, ...] = ("single", "multi"),
    block_size: int = 32,
    max_tokens: int = 1,
    batch: bool = False,
    busy: int = 0,
    text: bool = False,
    baseline: str = "miss",
    llm_args: dict[str, Any] | None = None,
    timeout: float = 900,
) -> dict[str, Any]:
    """Run the producer and one consumer per layout; return TTFT figures and every request's result.

    ``out[layout]["loaded"]`` / ``["recomputed"]``: ``{name: engine_run result}``; ``out["reference"]``:
    the producer's results of the stored prompts; ``out["figures"]``: what :func:`main` prints."""
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-llama"
    if not (model / "config.json").exists():
        make_tiny_llama(model, max_positions=4096)
    rng = random.Random(7)

    def prompt() -> list[int] | str:
        ids = [rng.randrange(4, 2048) for _ in range(tokens)]
        return " ".join(f"w{t}" for t in ids) if text else ids

    stored = {f"p{i}": prompt() for i in range(prompts)}
    fresh = {f"q{i}": prompt() for i in range(prompts)}  # never stored: the consumer recomputes them
    warm = [{"name": f"warm{i}", "prompt": prompt(), "max_tokens": max_tokens} for i in range(2)]
    store = work / f"store-{block_size}-{tokens}-{'text' if text else 'ids'}"
    extra = {"path": str(store)}
    # vLLM refuses a text prompt of over 5 characters a token of max_model_len: "w1234 " is 6
    base = {"max_model_len": 4096 if text else tokens + max_tokens + 64, "block_size": block_size}

    def req(name: str, p: list[int] | str) -> dict[str, Any]:
        return {"name": name, "prompt": p, "max_tokens": max_tokens}

    def with_busy(groups: list[list[str]]) -> tuple[list[list[str]], list[dict[str, Any]]]:
        """Each timed group also carries a short fresh prompt decoding ``busy`` tokens: forward passes run
        while the load is in flight."""
        if not busy:
            return groups, []
        extra = []
        for i, g in enumerate(groups[len(warm):]):
            ids = [rng.randrange(4, 2048) for _ in range(64)]
            extra.append({"name": f"busy{i}", "prompt": " ".join(f"w{t}" for t in ids) if text else ids, "max_tokens": busy})
            g.insert(0, extra[-1]["name"])
        return groups, extra

    per_request = batch or busy  # TTFT from vLLM's request metrics, not the generate call's wall time
    stats_args = {"disable_log_stats": False} if per_request else {}

    def run(name: str, kv: dict | None, requests: list[dict], multiprocess: bool, **spec: Any) -> dict:
        # the producer: only what the store depends on
        args = base if name == "producer" else {**base, **stats_args, **LAYOUTS[layout_of(name)][1], **(llm_args or {})}
        spec = {"model": str(model), "kv": kv, "requests": requests, "multiprocess": multiprocess, "llm_args": args,
                "text": text, **spec}  # fmt: skip
        done = work / "engines" / f"{name}.out.json"
        if name == "producer" and done.exists() and json.loads((work / "engines" / f"{name}.spec.json").read_text()) == spec:
            return json.loads(done.read_text())["results"]  # this work dir's store holds these prompts already
        return Engine(work / "engines", name, spec).result(timeout=timeout)["results"]

    def layout_of(name: str) -> str:
        return name.rsplit("-", 1)[-1] if "-" in name else "single"

    reference = run("producer", kv_config("kvbridge.FSConnector", "kv_producer", extra), [req(n, p) for n, p in stored.items()], False)
    out: dict[str, Any] = {"reference": reference}
    figures: dict[str, Any] = {"prompt_tokens": tokens, "loaded_tokens": tokens // block_size * block_size, "prompts": prompts,
                               "block_size": block_size, "max_tokens": max_tokens, "batch": batch, "busy": busy, "text": text,
                               "baseline": baseline, "llm_args": llm_args or {}}  # fmt: skip
    consumer = kv_config("kvbridge.FSConnector", "kv_consumer", extra)
    for layout in layouts:
        mp = LAYOUTS[layout][0]
        if baseline == "plain":  # the stored prompts, loaded by the consumer and recomputed by a plain engine
            groups, extra_reqs = with_busy([[w["name"]] for w in warm] + ([list(stored)] if batch else [[n] for n in stored]))
            reqs = warm + [req(n, p) for n, p in stored.items()] + extra_reqs
            loaded = run(f"consumer-{layout}", consumer, reqs, mp, groups=groups)
            recomputed = run(f"plain-{layout}", None, reqs, mp, groups=groups)
        else:  # in one consumer: stored prompts (loaded) and fresh ones (recomputed), alternately
            pairs = [(req(*a), req(*b)) for a, b in zip(stored.items(), fresh.items())]
            if batch:
                groups = [[w["name"]] for w in warm] + [list(stored), list(fresh)]
            else:
                groups = [[w["name"]] for w in warm] + [[r["name"]] for pair in pairs for r in pair]
            groups, extra_reqs = with_busy(groups)
            res = run(f"consumer-{layout}", consumer, warm + [r for pair in pairs for r in pair] + extra_reqs, mp, groups=groups)
            loaded, recomputed = res, res
        loaded = {n: loaded[n] for n in stored}
        recomputed = {n: recomputed[n] for n in (stored if baseline == "plain" else fresh)}
        out[layout] = {"loaded": loaded, "recomputed": recomputed}
        load_ms = [1e3 * r["worker"].get("load_seconds", 0.0) for r in loaded.values() if r.get("worker")]
        figures[layout] = {
            "loaded (fs)": _stats([1e3 * ttft(r) for r in loaded.values()]),
            "recomputed": _stats([1e3 * ttft(r) for r in recomputed.values()]),
            "num_cached_tokens": sorted({r["num_cached_tokens"] for r in loaded.values()}),
            **({"fs_load_ms_median": round(statistics.median(load_ms), 2)} if load_ms else {}),
        }
    out["figures"] = figures
    return out


def ttft(result: dict[str, Any]) -> float:
    """A request's time to first token: vLLM's own figure where it kept one, else its generate call's wall time."""
    return result["ttft_s"] if result.get("ttft_s") is not None else result["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--layout", choices=[*LAYOUTS, "both", "all"], default="both", help="both: single and multi")
    ap.add_argument("--multiprocess", action="store_true", help="the same as --layout multi")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--batch", action="store_true", help="loaded prompts in one generate call, recomputed ones in another")
    ap.add_argument("--busy", type=int, default=0, metavar="N", help="a decoding request (N tokens) beside each timed one")
    ap.add_argument("--text", action="store_true", help="prompts as text (the engine tokenizes them)")
    ap.add_argument("--async-scheduling", choices=["on", "off"], default=None, help="default: vLLM's choice (on)")
    ap.add_argument("--baseline", choices=["miss", "plain"], default="miss")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="environment of the engines (OMP_NUM_THREADS=2, ...)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="also write every result here")
    args = ap.parse_args()
    for kv in args.env:
        k, _, v = kv.partition("=")
        os.environ[k] = v
    named = {"both": ("single", "multi"), "all": tuple(LAYOUTS)}
    layouts = ("multi",) if args.multiprocess else named.get(args.layout, (args.layout,))
    llm_args = {} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling == "on"}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvbridge-ttft-"))
    out = measure(work, tokens=args.tokens, prompts=args.prompts, layouts=layouts, block_size=args.block_size,
                  max_tokens=args.max_tokens, batch=args.batch, busy=args.busy, text=args.text, baseline=args.baseline,
                  llm_args=llm_args)  # fmt: skip
    for layout in layouts:
        loaded = out[layout]["loaded"]
        out["figures"][layout]["loaded_outputs_match"] = all(loaded[n]["tokens"] == out["reference"][n]["tokens"] for n in loaded)
    out["figures"]["env"] = dict(kv.partition("=")[::2] for kv in args.env)
    print(json.dumps(out["figures"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
