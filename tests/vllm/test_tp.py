"""Tensor parallelism in real vLLM engines (tp=2 on this 2-core machine: ``distributed_executor_backend="mp"``,
one OMP thread per rank).

- fs: every rank saves and loads its own shard of the KV (``tp2.0``, ``tp2.1``); a tp=1 consumer finds the
  tp=2 shards and cuts its heads out of both (``kvbridge.layout.reslice``).
- ucx: a tp=2 consumer pulls from a tp=1 producer, each rank cutting its KV head out of the producer's
  blocks (``kvbridge.layout.reslice``); every full block is loaded and the tokens equal a plain engine's.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from pdkit import Engine, gated, kv_config, open_gate
from test_pd_ucx import ucx_problem

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


def _ranks(store: Path) -> set[str]:
    """The rank folders holding objects: ``<store>/<namespace>/<rank>/<xx>/<object>``."""
    return {p.relative_to(store).parts[1] for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")}


@pytest.mark.timeout(900)
def test_tp2_engines_move_every_ranks_shard(tiny_model: Path, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    store = tmp_path / "store"
    rng = random.Random(11)
    requests = [{"name": f"p{i}", "prompt": [rng.randrange(4, 2048) for _ in range(200)], "max_tokens": 4} for i in range(2)]
    extra = {"path": str(store)}

    def start(name: str, role: str, llm_args: dict[str, Any], **more: Any) -> Engine:
        # the engine core in the test's engine process (tp=2: a process per rank's worker beside it): each
        # process more would cost a vLLM import, and the ranks' shards are what is checked here
        spec = {"model": str(tiny_model), "kv": kv_config("kvbridge.FSConnector", role, extra), "requests": requests,
                "llm_args": llm_args, **more}  # fmt: skip
        return Engine(tmp_path / "engines", name, spec)

    # both consumers start beside the producer, and send once its shards are stored (a start is mostly imports)
    gate = tmp_path / "gate.json"
    consumers = {"tp2": start("consumer-tp2", "kv_consumer", TP2, **gated(gate)),
                 "tp1": start("consumer-tp1", "kv_consumer", {}, **gated(gate))}  # fmt: skip
    made = start("producer-tp2", "kv_producer", TP2).result(timeout=600)["results"]
    assert _ranks(store) == {"tp2.0", "tp2.1"}, "each rank saved its own shard"
    open_gate(gate)
    loaded = consumers["tp2"].result(timeout=600)["results"]
    for r in requests:
        assert loaded[r["name"]]["num_cached_tokens"] == 192, "both ranks loaded all 6 full blocks"
        assert loaded[r["name"]]["tokens"] == made[r["name"]]["tokens"]
    other_split = consumers["tp1"].result(timeout=600)["results"]
    for r in requests:
        assert other_split[r["name"]]["num_cached_tokens"] == 192, "a tp=1 rank takes both heads from the tp=2 shards"
        assert other_split[r["name"]]["tokens"] == made[r["name"]]["tokens"]


@pytest.mark.timeout(900)
def test_tp1_producer_hands_off_to_a_tp2_consumer_over_ucx(tiny_model: Path, baseline: dict[str, Any],
                                                           prompts: dict[str, list[int]], tmp_path: Path,
                                                           monkeypatch: Any) -> None:
    problem = ucx_problem()
    if problem:
        pytest.skip(f"ucx backend not usable here: {problem}")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    names = "AB"
    params, done = tmp_path / "params.json", tmp_path / "consumer.done"
    producer = Engine(tmp_path / "engines", "producer-tp1", {
        "model": str(tiny_model), "kv": kv_config("kvbridge.UCXConnector", "kv_producer", {}), "batch": True,
        "requests": [{"name": n, "prompt": prompts[n], "max_tokens": 1} for n in names],
        "publish": str(params), "hold": str(done)})  # fmt: skip
    consumer = Engine(tmp_path / "engines", "consumer-tp2", {
        "model": str(tiny_model), "kv": kv_config("kvbridge.UCXConnector", "kv_consumer", {}),
        "llm_args": TP2, "params_from": str(params), "done": str(done),
        "requests": [{"name": n, "prompt": prompts[n], "max_tokens": 8} for n in names]})  # fmt: skip
    got = consumer.result(timeout=600)["results"]
    producer.result()
    for n in names:
        assert got[n]["num_cached_tokens"] == 192, f"both ranks cut their head out of all 6 blocks: {got[n]}"
        assert got[n]["tokens"] == baseline[n]["tokens"]
