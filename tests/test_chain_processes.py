"""chain (cpu then fs) across processes: a producer process saves, a separate consumer process loads.

The cpu tier is private to each process, so the consumer's hits come from the shared fs tier and are
promoted into its own cpu tier; the bytes that arrive are compared with the bytes the producer wrote out.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    from kvbridge import registry
    from kvbridge.testing import MiniEngine

    role, options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    engine = MiniEngine(registry.create("chain", options), engine_id=role, role=role, seed=len(role), num_blocks=128)
    common = np.random.default_rng(0).integers(0, 32000, 32).tolist()
    prompts = {f"p{i}": common + np.random.default_rng(1 + i).integers(0, 32000, 16 * (1 + i) + 3).tolist() for i in range(5)}
    results, counts = {}, {}
    for rid, tokens in prompts.items():
        got = engine.prefill(f"{rid}-{role}", tokens)
        n = len(got.keys)
        results[rid] = got.snapshot[:, :n].clone()
        counts[rid] = [len(got.loaded_blocks), len(got.failed_blocks), n]
        assert torch.equal(got.snapshot[:, :n], engine.expected(got.keys))
    torch.save(results, out + ".pt")
    stats = engine.worker.io.stats.as_dict()
    engine.close()
    json.dump({"counts": counts, "promoted": stats.get("promoted_blocks", 0)}, open(out + ".json", "w"))
    """
)


def _run(role: str, options: dict, out: Path) -> dict:
    subprocess.run([sys.executable, "-c", SCRIPT, role, json.dumps(options), str(out)], check=True, timeout=300)
    return json.loads(out.with_suffix(".json").read_text())


def test_producer_process_to_consumer_process_through_chain_is_bit_exact(tmp_path: Path) -> None:
    options = {"tiers": [{"backend": "cpu", "capacity_bytes": 32 << 20}, {"backend": "fs", "path": str(tmp_path / "kv")}]}
    sent = _run("producer", options, tmp_path / "producer")
    got = _run("consumer", options, tmp_path / "consumer")
    left = torch.load(tmp_path / "producer.pt", weights_only=True)
    arrived = torch.load(tmp_path / "consumer.pt", weights_only=True)
    for rid, (loaded, failed, n) in got["counts"].items():
        assert failed == 0 and loaded == n, rid  # every full block came from the producer's process
        assert torch.equal(arrived[rid], left[rid]), rid
    assert all(c[0] == 0 for c in sent["counts"].values())  # the producer computed everything itself
    assert got["promoted"] > 0  # fs hits were promoted into the consumer's own cpu tier
