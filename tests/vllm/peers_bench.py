"""kvbridge's stores beside vLLM's own connectors, in real engines, on the same prompts and the same hand-off.

    .venv-vllm/bin/python tests/vllm/peers_bench.py [--tokens 1500] [--prompts 4] [--layers 2] [--kv-heads 2]
                                                    [--workdir DIR] [--json OUT]

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
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdkit import Engine, kv_config, make_tiny_llama  # noqa: E402


def _vllm(connector: str, role: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A KVTransferConfig dict for one of vLLM's own connectors."""
    return {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}


def measure(work: Path, *, tokens: int = 1500, prompts: int = 4, layers: int = 2, kv_heads: int = 2) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"tiny-llama-{layers}x{kv_heads}"
    if not (model / "config.json").exists():
        make_tiny_llama(model, max_positions=4096, layers=layers, kv_heads=kv_heads)
    per_token = layers * kv_heads * 64 * 2 * 4  # K and V, float32 (the tiny model's dtype)
    kv_bytes = 2 * (tokens + 64) * per_token  # the engine's own KV cache: two prompts
    rng = random.Random(11)
    names = [f"p{i}" for i in range(prompts)]
    text = {n: [rng.randrange(4, 2048) for _ in range(tokens)] for n in names}
    warm = [{"name": f"warm{i}", "prompt": [rng.randrange(4, 2048) for _ in range(tokens)], "max_tokens": 1} for i in range(2)]
    first = [{"name": n, "prompt": text[n], "max_tokens": 1} for n in names]
    again = [{"name": f"{n}-again", "prompt": text[n], "max_tokens": 1} for n in names]
    base = {"max_model_len": tokens + 64, "block_size": 32}
    cpu_bytes = 2 * prompts * tokens * per_token  # every prompt's KV twice over

    def run(name: str, kv: dict[str, Any] | None, requests: list[dict[str, Any]]) -> dict[str, Any]:
        spec = {"model": str(model), "kv": kv, "requests": requests, "llm_args": base, "kv_bytes": kv_bytes}
        return Engine(work / "engines", name, spec).result(timeout=900)["results"]

    out: dict[str, Any] = {"plain": run("plain", None, warm + first + again)}
    for label, producer, consumer in [
        ("kvbridge fs", kv_config("kvbridge.FSConnector", "kv_producer", {"path": str(work / "fs")}),
         kv_config("kvbridge.FSConnector", "kv_consumer", {"path": str(work / "fs")})),
        ("vLLM ExampleConnector", _vllm("ExampleConnector", "kv_producer", {"shared_storage_path": str(work / "example")}),
         _vllm("ExampleConnector", "kv_consumer", {"shared_storage_path": str(work / "example")})),
    ]:
        out[f"{label} (producer)"] = run(f"{label}-producer".replace(" ", "_"), producer, warm + first)
        out[label] = run(f"{label}-consumer".replace(" ", "_"), consumer, warm + first)
    for label, kv in [
        ("kvbridge cpu", kv_config("kvbridge.CPUConnector", "kv_both", {"capacity_bytes": cpu_bytes})),
        ("vLLM OffloadingConnector", _vllm("OffloadingConnector", "kv_both", {"cpu_bytes_to_use": cpu_bytes})),
    ]:
        try:
            out[label] = run(label.replace(" ", "_"), kv, warm + first + again)
        except BaseException as exc:  # noqa: BLE001 - an engine that cannot start here (pytest's fail is one)
            if isinstance(exc, KeyboardInterrupt):
                raise
            out[label] = {"error": str(exc).strip().splitlines()[-1][:300]}
    return {"results": out, "figures": {"kv_bytes_per_token": per_token, **figures(out, names, tokens)}}


def _ms(results: dict[str, Any], names: list[str]) -> dict[str, float]:
    ms = [1e3 * results[n]["wall_s"] for n in names]
    return {"median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2)}


def figures(out: dict[str, Any], names: list[str], tokens: int) -> dict[str, Any]:
    plain = out["plain"]
    again = [f"{n}-again" for n in names]
    rows: dict[str, Any] = {"prompt_tokens": tokens, "prompts": len(names),
                            "recomputed": _ms(plain, names), "recomputed (second run)": _ms(plain, again)}  # fmt: skip
    for label in ("kvbridge fs", "vLLM ExampleConnector"):
        got, made = out[label], out[f"{label} (producer)"]
        rows[label] = {**_ms(got, names), "cached_tokens": sorted({got[n]["num_cached_tokens"] for n in names}),
                       "outputs_match": all(got[n]["tokens"] == plain[n]["tokens"] for n in names),
                       # the producer's own prefill, saves included (a save in the forward pass stalls it)
                       "producer": _ms(made, names)}  # fmt: skip
        rows[label]["hand-off_ms"] = round(  # what the hand-off adds: producer over a plain prefill, plus the consumer
            rows[label]["producer"]["median_ms"] - rows["recomputed"]["median_ms"] + rows[label]["median_ms"], 2)
    for label in ("kvbridge cpu", "vLLM OffloadingConnector"):
        got = out[label]
        if "error" in got:
            rows[label] = {"not measured": got["error"]}
            continue
        rows[label] = {**_ms(got, again), "cached_tokens": sorted({got[n]["num_cached_tokens"] for n in again}),
                       "outputs_match": all(got[f"{n}-again"]["tokens"] == plain[n]["tokens"] for n in names)}  # fmt: skip
    rows["plain engine's own cache on the second run"] = sorted({plain[n]["num_cached_tokens"] for n in again})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2, help="the model's layers (KV grows with them)")
    ap.add_argument("--kv-heads", type=int, default=2, help="the model's KV heads (KV grows with them)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="also write every result here")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvbridge-peers-"))
    out = measure(work, tokens=args.tokens, prompts=args.prompts, layers=args.layers, kv_heads=args.kv_heads)
    print(json.dumps(out["figures"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
