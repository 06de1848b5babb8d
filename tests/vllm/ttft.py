"""Measure time to first token of a consumer that loads the prompt's KV (fs) vs one that recomputes it.

    .venv-vllm/bin/python tests/vllm/ttft.py [--prompts 8] [--tokens 400] [--workdir DIR] [--multiprocess]

A producer engine prefills every prompt into an fs store; then, one engine after the other (never
two at once, so they do not compete for cores), a consumer engine with the fs connector and a plain
engine run each prompt with ``max_tokens=1`` after two warm-up requests. TTFT is the wall time of
that one-token ``generate`` (a single request, so nothing else queues in front of it).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdkit import Engine, kv_config, make_tiny_llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--multiprocess", action="store_true", help="engine core and worker in their own processes")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvbridge-ttft-"))
    model = make_tiny_llama(work / "tiny-llama") if not (work / "tiny-llama" / "config.json").exists() else work / "tiny-llama"
    rng = random.Random(7)
    prompts = {f"p{i}": [rng.randrange(4, 2048) for _ in range(args.tokens)] for i in range(args.prompts)}
    warm = [{"name": f"warm{i}", "prompt": [rng.randrange(4, 2048) for _ in range(args.tokens)], "max_tokens": 1} for i in range(2)]
    timed = [{"name": n, "prompt": p, "max_tokens": 1} for n, p in prompts.items()]
    extra = {"path": str(work / "store")}

    def run(name: str, kv: dict | None, requests: list[dict]) -> dict:
        spec = {"model": str(model), "kv": kv, "requests": requests, "multiprocess": args.multiprocess}
        return Engine(work / "engines", name, spec).result(timeout=900)["results"]

    run("producer", kv_config("kvbridge.FSConnector", "kv_producer", extra), timed)
    loaded = run("consumer", kv_config("kvbridge.FSConnector", "kv_consumer", extra), warm + timed)
    plain = run("recompute", None, warm + timed)
    assert all(loaded[n]["num_cached_tokens"] == args.tokens // 32 * 32 for n in prompts), "every prompt must load"
    assert all(loaded[n]["tokens"] == plain[n]["tokens"] for n in prompts)
    rows = {}
    for label, res in (("loaded (fs)", loaded), ("recomputed", plain)):
        ms = [1e3 * res[n]["wall_s"] for n in prompts]
        rows[label] = {"median_ms": round(statistics.median(ms), 2), "mean_ms": round(statistics.mean(ms), 2),
                       "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2)}  # fmt: skip
    load_ms = [1e3 * loaded[n]["worker"].get("load_seconds", 0.0) for n in prompts]
    print(json.dumps({"multiprocess": args.multiprocess, "prompt_tokens": args.tokens, "loaded_tokens": args.tokens // 32 * 32, "prompts": args.prompts,
                      "ttft": rows, "fs_load_ms_median": round(statistics.median(load_ms), 2)}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
