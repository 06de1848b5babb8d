"""The cpu tier's layerwise (synchronous) loads in a real vLLM engine: the same output as recomputing, and
the time to first token with and without layer pipelining.

One engine (``kv_both``, the cpu tier is private to it) computes each prompt, forgets it from vLLM's own
prefix cache (``reset_prefix_cache``), then serves it again from the cpu tier: asynchronously (the request
waits a step for its load) or layerwise (loaded inside the step, ``wait_for_layer_load`` per layer).
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

import pytest
from pdkit import Engine, gated, kv_config, open_gate

TOKENS = 1500
FULL = TOKENS // 32 * 32


@pytest.mark.timeout(900)
def test_layerwise_cpu_loads_in_a_real_engine(tiny_model: Path, tmp_path: Path) -> None:
    model = tiny_model  # it takes 2,048 positions and more
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 2048) for _ in range(TOKENS)] for _ in range(4)]
    requests: list[dict[str, Any]] = [{"name": f"warm{i}", "prompt": [rng.randrange(4, 2048) for _ in range(TOKENS)],
                                       "max_tokens": 1} for i in range(2)]  # fmt: skip
    for i, p in enumerate(prompts):
        # a save holds its request's blocks until the engine's next step reports it over; an offline LLM
        # steps only inside generate(), so a short request lets those blocks go before the cache reset
        requests += [{"name": f"computed{i}", "prompt": p, "max_tokens": 1},
                     {"name": f"step{i}", "prompt": [1, 2, 3], "max_tokens": 1},
                     {"name": f"loaded{i}", "prompt": p, "max_tokens": 1, "reset_cache": True}]  # fmt: skip
    ttft = {}
    # both engines start at once (a start is mostly importing vLLM, on one core); the layerwise one sends its
    # requests once the other is done, so that neither's time to first token counts the other's work
    gate = tmp_path / "gate.json"
    engines = {}
    for layerwise in (False, True):
        extra = {"capacity_bytes": 256 << 20, "layerwise": layerwise}
        spec = {"model": str(model), "kv": kv_config("kvbridge.CPUConnector", "kv_both", extra), "requests": requests,
                "kv_bytes": 128 << 20, "llm_args": {"max_model_len": 2048}, **(gated(gate) if layerwise else {})}  # fmt: skip
        engines[layerwise] = Engine(tmp_path / "engines", f"cpu-layerwise-{layerwise}", spec)
    for layerwise in (False, True):
        res = engines[layerwise].result(timeout=600)["results"]
        open_gate(gate)
        for i in range(len(prompts)):
            loaded, computed = res[f"loaded{i}"], res[f"computed{i}"]
            assert loaded["worker"].get("load_blocks") == FULL // 32, (layerwise, loaded["worker"])
            assert loaded["tokens"] == computed["tokens"]
        ttft[layerwise] = {k: round(1e3 * statistics.median(res[f"{k}{i}"]["wall_s"] for i in range(len(prompts))), 1)
                           for k in ("loaded", "computed")}  # fmt: skip
    # figures only: whether layer pipelining pays is the bench's question (benches/vllm/ttft.py), not a test's
    print(f"TTFT median ms, {TOKENS}-token prompt, cpu tier: async {ttft[False]}, layerwise {ttft[True]}")
