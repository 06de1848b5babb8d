"""kvbridge's stores beside vLLM's own connectors, in real engines, on the same prompts and the same hand-off.

    .venv-vllm/bin/python benches/vllm/peers_bench.py [--tokens 1500] [--prompts 4] [--layers 2] [--kv-heads 2]
                                                    [--rounds 3] [--workdir DIR] [--json OUT]

- **Shared storage**: a producer engine prefills every prompt (one token) through the connector into a
  directory, then a consumer engine loads them: ``kvbridge.FSConnector`` against vLLM's ``ExampleConnector``
  (safetensors, one file per layer per request, under ``shared_storage_path``), same directory. Both
  sides are timed: the producer's prefill (a connector that saves inside the forward pass stalls it) and
  the consumer's TTFT; ``hand-off_ms`` is what the hand-off adds to a plain prefill, both sides together.
- **CPU offload**: one engine runs every prompt, then every prompt again; its KV cache holds two prompts,
  so the second run finds nothing of its own and loads from the CPU tier: ``kvbridge.CPUConnector``
  against vLLM's ``OffloadingConnector`` (its CPU spec, ``cpu_bytes_to_use``), same capacity. (vLLM 0.32's
  CPU offloading runs on CUDA and XPU only: on a CPU machine its row says so.)
- **Recompute**: a plain engine on the same prompts in the same order.

TTFT is the wall time of the request's own ``generate`` call (one token), engines in one process (vLLM's
offline ``LLM``), run one after another so they never compete for cores. The default model is tiny (2 KiB
of KV a token: a 1,500-token hand-off is 3 MiB, so engine overhead dominates every row); ``--layers 16
--kv-heads 8`` gives it 64 KiB a token (half of Llama-3-8B's), where the hand-off itself shows. Every loaded output is checked
against the producer's (or the plain engine's) tokens; a loaded request must report cached tokens.

**Rounds** (``--rounds``, default 3): the plain engine and both shared-storage pairs run once a round, in an
order rotated each round, each pair into a directory of its own, and a round's hand-off is taken against
that round's plain prefill. A VM's file writes can swing between regimes for tens of seconds at a time;
run once each, minutes apart, whichever connector saved during a slow stretch would lose. The summary is the median over
rounds of each side's hand-off, every round's figures beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdkit import Engine, kv_config, make_tiny_llama  # noqa: E402


def _vllm(connector: str, role: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A KVTransferConfig dict for one of vLLM's own connectors."""
    return {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}


# the shared-storage pairs: each one's config for a role and a directory
PAIRS = {
    "kvbridge fs": lambda role, folder: kv_config("kvbridge.FSConnector", role, {"path": folder}),
    "vLLM ExampleConnector": lambda role, folder: _vllm("ExampleConnector", role, {"shared_storage_path": folder}),
}
SHARED = tuple(PAIRS)
OFFLOAD = ("kvbridge cpu", "vLLM OffloadingConnector")


def measure(work: Path, *, tokens: int = 1500, prompts: int = 4, layers: int = 2, kv_heads: int = 2,
            rounds: int = 3) -> dict[str, Any]:  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"tiny-llama-{layers}x{kv_heads}"
    if not (model / "config.json").exists():
        make_tiny_llama(model, max_positions=4096, layers=layers, kv_heads=kv_heads)
    per_token = layers * kv_heads * 64 * 2 * 4  # K and V, float32 (the tiny model's dtype)
    kv_bytes = 2 * (tokens + 64) * per_token  # the engine's own KV cache: two prompts
    rng = random.Random(11)
    names = [f"p{i}" for i in range(prompts)]
    text = {n: [rng.randrange(4, 2048) for _ in range(tokens)] for n in names}
    warm = [
        {"name": f"warm{i}", "prompt": [rng.randrange(4, 2048) for _ in range(tokens)], "max_tokens": 1}
        for i in range(2)
    ]
    first = [{"name": n, "prompt": text[n], "max_tokens": 1} for n in names]
    again = [{"name": f"{n}-again", "prompt": text[n], "max_tokens": 1} for n in names]
    base = {"max_model_len": tokens + 64, "block_size": 32}
    cpu_bytes = 2 * prompts * tokens * per_token  # every prompt's KV twice over

    def run(name: str, kv: dict[str, Any] | None, requests: list[dict[str, Any]]) -> dict[str, Any]:
        spec = {"model": str(model), "kv": kv, "requests": requests, "llm_args": base, "kv_bytes": kv_bytes}
        return Engine(work / "engines", name, spec).result(timeout=900)["results"]

    def pair(label: str, r: int) -> dict[str, Any]:
        """One shared-storage pair of round ``r``: its producer, then its consumer, in a directory of their own."""
        tag = f"{label}-r{r}".replace(" ", "_")
        made, read = (PAIRS[label](role, str(work / tag)) for role in ("kv_producer", "kv_consumer"))
        return {
            "producer": run(f"{tag}-producer", made, warm + first),
            "consumer": run(f"{tag}-consumer", read, warm + first),
        }

    runs: list[dict[str, Any]] = []
    jobs = ["plain", *SHARED]
    for r in range(rounds):
        got: dict[str, Any] = {}
        for job in jobs[r % len(jobs) :] + jobs[: r % len(jobs)]:  # rotated: no connector always runs first
            got[job] = run(f"plain-r{r}", None, warm + first + again) if job == "plain" else pair(job, r)
        runs.append(got)
    offload: dict[str, Any] = {}
    for label, kv in zip(OFFLOAD, [
        kv_config("kvbridge.CPUConnector", "kv_both", {"capacity_bytes": cpu_bytes}),
        _vllm("OffloadingConnector", "kv_both", {"cpu_bytes_to_use": cpu_bytes}),
    ]):  # fmt: skip
        try:
            offload[label] = run(label.replace(" ", "_"), kv, warm + first + again)
        except BaseException as exc:  # noqa: BLE001 - an engine that cannot start here (pytest's fail is one)
            if isinstance(exc, KeyboardInterrupt):
                raise
            offload[label] = {"error": str(exc).strip().splitlines()[-1][:300]}
    out = {"rounds": runs, "offload": offload}
    return {"results": out, "figures": {"kv_bytes_per_token": per_token, **figures(out, names, tokens)}}


def _ms(results: dict[str, Any], names: list[str]) -> dict[str, float]:
    ms = [1e3 * results[n]["wall_s"] for n in names]
    return {"median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2)}


def _median(values: Iterable[float]) -> float:
    return round(statistics.median(values), 2)


def _round(got: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """One round's figures: the plain prefill, and per pair its consumer's TTFT, its producer's prefill and
    the hand-off (what the pair adds to that round's plain prefill: the producer's excess plus the consumer)."""
    plain = got["plain"]
    rows: dict[str, Any] = {
        "recomputed": _ms(plain, names),
        "recomputed (second run)": _ms(plain, [f"{n}-again" for n in names]),
    }
    for label in SHARED:
        consumer, producer = got[label]["consumer"], got[label]["producer"]
        row = {**_ms(consumer, names), "cached_tokens": sorted({consumer[n]["num_cached_tokens"] for n in names}),
               "outputs_match": all(consumer[n]["tokens"] == plain[n]["tokens"] for n in names),
               "producer": _ms(producer, names)}  # fmt: skip
        row["hand-off_ms"] = round(row["producer"]["median_ms"] - rows["recomputed"]["median_ms"] + row["median_ms"], 2)
        rows[label] = row
    return rows


def figures(out: dict[str, Any], names: list[str], tokens: int) -> dict[str, Any]:
    per_round = [_round(got, names) for got in out["rounds"]]
    summary: dict[str, Any] = {}
    for label in SHARED:
        each = [r[label] for r in per_round]
        summary[label] = {
            "consumer TTFT_ms": _median(x["median_ms"] for x in each),
            "producer prefill_ms": _median(x["producer"]["median_ms"] for x in each),
            "hand-off_ms": _median(x["hand-off_ms"] for x in each),
            "outputs_match": all(x["outputs_match"] for x in each),
        }
    summary["recomputed_ms"] = _median(r["recomputed"]["median_ms"] for r in per_round)
    fs, example = (summary[label]["hand-off_ms"] for label in SHARED)
    summary["fs gains (ExampleConnector hand-off / fs hand-off)"] = round(example / fs, 2) if fs > 0 else None
    rows: dict[str, Any] = {"prompt_tokens": tokens, "prompts": len(names), "rounds": len(per_round),
                            "median over rounds": summary, "per round": per_round}  # fmt: skip
    plain_again = out["rounds"][0]["plain"]
    for label in OFFLOAD:
        got = out["offload"][label]
        if "error" in got:
            rows[label] = {"not measured": got["error"]}
            continue
        again = [f"{n}-again" for n in names]
        rows[label] = {**_ms(got, again), "cached_tokens": sorted({got[n]["num_cached_tokens"] for n in again}),
                       "outputs_match": all(got[f"{n}-again"]["tokens"] == plain_again[n]["tokens"] for n in names)}  # fmt: skip
    rows["plain engine's own cache on the second run"] = sorted(
        {r["plain"][f"{n}-again"]["num_cached_tokens"] for r in out["rounds"] for n in names}
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2, help="the model's layers (KV grows with them)")
    ap.add_argument("--kv-heads", type=int, default=2, help="the model's KV heads (KV grows with them)")
    ap.add_argument("--rounds", type=int, default=3, help="plain, fs and Example runs, interleaved, this many times")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="also write every result here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvbridge-peers-"))
    out = measure(
        work, tokens=args.tokens, prompts=args.prompts, layers=args.layers, kv_heads=args.kv_heads, rounds=args.rounds
    )
    print(json.dumps(out["figures"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
