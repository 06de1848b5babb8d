"""Prefill/decode hand-off peer to peer over UCX: the consumer reads blocks out of the producer's KV cache.

Both engines run at once, in separate processes, one connector naming each (``kvbridge.UCXConnector`` through
the plugin, ``UCXConnector`` with the module path). The producer prefills its prompts in **one** ``LLM.generate``
batch with ``max_tokens=1``, publishes the ``kv_transfer_params`` vLLM returned, and then sits idle — its engine
takes no further step — until the consumer is done, as with vLLM's offline P/D pattern.

- ``test_idle_producer_batch``: every prompt equals the single-engine run token for token and was loaded
  (blocks read one-sided, counted by vLLM and the connector); D's params were altered to name other blocks, so
  its grant no longer matches: a miss, recomputed, still equal; B's held blocks were overwritten in the
  producer's KV before the read, a corruption no check can see — its output changes (so the test can fail).
- ``test_producer_killed_before_the_reads``: the producer is SIGKILLed once it has published; with
  ``kv_load_failure_policy="recompute"`` every prompt is recomputed and equals the single-engine run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pdkit import BLOCK, PROMPT_LEN, assert_same_output, gated, kv_config, open_gate, output_differs

FULL_BLOCKS = PROMPT_LEN // BLOCK


def ucx_problem() -> str | None:
    try:
        from kvbridge import registry

        return registry.check("ucx")
    except Exception as exc:  # noqa: BLE001 - any reason the backend cannot be used here
        return f"{type(exc).__name__}: {exc}"


@pytest.fixture(autouse=True)
def _need_ucx() -> None:
    problem = ucx_problem()
    if problem:
        pytest.skip(f"ucx backend not usable here: {problem}")


def _producer(engine: Any, prompts: dict, tmp_path: Path, names: str, **spec: Any) -> tuple[Any, Path, Path]:
    params, done = tmp_path / "params.json", tmp_path / "consumer.done"
    producer = engine(
        "producer",
        kv=kv_config("kvbridge.UCXConnector", "kv_producer", {}),
        requests=[{"name": n, "prompt": prompts[n], "max_tokens": 1} for n in names],
        batch=True,
        publish=str(params),
        hold=str(done),
        **spec,
    )
    return producer, params, done


def test_idle_producer_batch(engine: Any, baseline: dict, prompts: dict, tmp_path: Path) -> None:
    producer, params, done = _producer(engine, prompts, tmp_path, "ABCD", corrupt_held=["B"])
    consumer = engine(
        "consumer",
        kv=kv_config("UCXConnector", "kv_consumer", {}, kv_load_failure_policy="recompute"),
        params_from=str(params),
        done=str(done),
        requests=[
            {"name": "A", "prompt": prompts["A"], "max_tokens": 8},
            {"name": "C", "prompt": prompts["C"], "max_tokens": 8},
            {"name": "D", "prompt": prompts["D"], "max_tokens": 8, "params_patch": {"block_ids": list(range(FULL_BLOCKS))}},
            {"name": "B", "prompt": prompts["B"], "max_tokens": 8},
        ],
    )
    got = consumer.result()["results"]
    served = producer.result()

    for n in "ABCD":
        p = served["results"][n]["kv_transfer_params"]
        assert p and len(p["block_ids"]) == FULL_BLOCKS and p.get("grant"), f"the producer offers full blocks: {p}"
    for n in "AC":
        assert_same_output(got[n], baseline[n])
        assert got[n]["num_cached_tokens"] == FULL_BLOCKS * BLOCK, got[n]
        assert got[n]["worker"].get("load_blocks") == FULL_BLOCKS and not got[n]["worker"].get("failed_blocks"), got[n]
    d = got["D"]
    assert_same_output(d, baseline["D"])
    assert d["num_cached_tokens"] == 0 and not d["worker"].get("load_blocks"), d  # altered ids: a miss
    b = got["B"]
    assert b["worker"].get("load_blocks") == FULL_BLOCKS, b["worker"]
    assert output_differs(b, baseline["B"]), "KV overwritten in the producer must change the consumer's output"
    producer_counts = served["totals"]["worker"]
    assert producer_counts.get("releases") == 3 and not producer_counts.get("refused_pulls"), producer_counts


def test_producer_killed_before_the_reads(engine: Any, baseline: dict, prompts: dict, tmp_path: Path) -> None:
    producer, params, done = _producer(engine, prompts, tmp_path, "AB")
    import json
    import time

    # the consumer starts beside the producer; it gets the producer's params (and sends) only once that is dead
    gate = tmp_path / "gate.json"
    consumer = engine(
        "consumer",
        kv=kv_config("UCXConnector", "kv_consumer", {"timeout_s": 3}, kv_load_failure_policy="recompute"),
        requests=[{"name": n, "prompt": prompts[n], "max_tokens": 8} for n in "AB"],
        **gated(gate),
    )
    deadline = time.monotonic() + 300
    while not params.exists():
        assert time.monotonic() < deadline and producer.proc.poll() is None, "the producer never published"
        time.sleep(0.1)
    published = json.loads(params.read_text())
    producer.kill()  # SIGKILL: its KV cache, metadata server and UCX worker are gone
    assert all(published[n] for n in "AB"), published
    open_gate(gate, published)
    got = consumer.result()["results"]
    for n in "AB":
        assert_same_output(got[n], baseline[n])
        assert got[n]["worker"].get("failed_blocks") == FULL_BLOCKS and not got[n]["worker"].get("load_blocks"), got[n]
