"""Prefill/decode hand-off peer to peer over UCX: the consumer pulls blocks out of the live producer.

Both engines run at once, in separate processes. The producer prefills A, B and D, publishes the
``kv_transfer_params`` vLLM returned for each, and stays up until the consumer is done; the
consumer decodes each prompt with its params. Checks: A equals the single-engine run token for
token and was loaded (6 blocks pulled, counted by vLLM and the connector); D's params were altered
to name blocks outside the producer's KV cache, so its pull is refused, the blocks are reported failed and
recomputed (``kv_load_failure_policy="recompute"``) — still equal; B's held blocks were overwritten
in the producer's KV cache before the pull, a corruption no check can see — its output changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pdkit import BLOCK, PROMPT_LEN, assert_same_output, kv_config, output_differs

FULL_BLOCKS = PROMPT_LEN // BLOCK


def ucx_problem() -> str | None:
    try:
        from kvbridge import registry

        return registry.check("ucx")
    except Exception as exc:  # noqa: BLE001 - any reason the backend cannot be used here
        return f"{type(exc).__name__}: {exc}"


def test_ucx_pd_hand_off(engine: Any, baseline: dict, prompts: dict, tmp_path: Path) -> None:
    problem = ucx_problem()
    if problem:
        pytest.skip(f"ucx backend not usable here: {problem}")
    params, done = tmp_path / "params.json", tmp_path / "consumer.done"
    producer = engine(
        "producer",
        kv=kv_config("kvbridge.UCXConnector", "kv_producer", {}),
        requests=[{"name": n, "prompt": prompts[n], "max_tokens": 1} for n in "ABD"],
        corrupt_held=["B"],
        publish=str(params),
        hold=str(done),
    )
    consumer = engine(
        "consumer",
        kv=kv_config("UCXConnector", "kv_consumer", {}, kv_load_failure_policy="recompute"),
        params_from=str(params),
        done=str(done),
        requests=[
            {"name": "A", "prompt": prompts["A"], "max_tokens": 8},
            {"name": "D", "prompt": prompts["D"], "max_tokens": 8, "params_patch": {"block_ids": list(range(10**6, 10**6 + FULL_BLOCKS))}},
            {"name": "B", "prompt": prompts["B"], "max_tokens": 8},
        ],
    )
    got = consumer.result()["results"]
    served = producer.result()

    for n in "ABD":
        p = served["results"][n]["kv_transfer_params"]
        assert p and len(p["block_ids"]) == FULL_BLOCKS, f"the producer offers each prompt's full blocks: {p}"
    a = got["A"]
    assert_same_output(a, baseline["A"])
    assert a["num_cached_tokens"] == FULL_BLOCKS * BLOCK, a
    assert a["worker"].get("load_blocks") == FULL_BLOCKS and not a["worker"].get("failed_blocks"), a["worker"]
    d = got["D"]
    assert_same_output(d, baseline["D"])
    assert d["worker"].get("failed_blocks") == FULL_BLOCKS and d["worker"].get("load_failures") == 1, d["worker"]
    b = got["B"]
    assert b["worker"].get("load_blocks") == FULL_BLOCKS, b["worker"]
    assert output_differs(b, baseline["B"]), "KV overwritten in the producer must change the consumer's output"
    producer_counts = served["totals"]["worker"]
    assert producer_counts.get("served_pulls") == 2 and producer_counts.get("refused_pulls") == 1, producer_counts
