"""Prefill/decode hand-off through the store backends, a producer and a consumer engine in separate processes.

Per backend, one producer run (prefill only, ``max_tokens=1``) and one consumer run check that:

- the consumer's greedy tokens and logprobs equal a single plain engine's, token for token;
- the consumer really loaded the KV: vLLM counted the prompt's full blocks as cached
  (``num_cached_tokens``) and the connector counted the loaded blocks and bytes;
- a stored object with flipped bytes is caught (checksum), counted, and recomputed
  (``kv_load_failure_policy="recompute"``): the output still equals the baseline;
- an object rewritten with a *valid* checksum over the wrong KV is loaded and changes the output —
  the proof that the equality checks above can fail.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from kvbridge.connectors.fs import _FIXED, HEADER_BYTES, object_name
from pdkit import BLOCK, PROMPT_LEN, assert_same_output, kv_config, output_differs

from kvbridge.keys import block_keys

FULL_BLOCKS = PROMPT_LEN // BLOCK


def flip_payload(path: str) -> None:
    """Flip bytes inside a stored object's payload; its header (and checksum) stay as they were."""
    data = bytearray(Path(path).read_bytes())
    for off in range(HEADER_BYTES + 100, len(data), 4099):
        data[off] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def forge(path: str, payload_from: str) -> None:
    """Give the object at ``path`` another object's payload under a correct checksum: undetectable."""
    data = bytearray(Path(path).read_bytes())
    payload = Path(payload_from).read_bytes()[HEADER_BYTES:]
    assert len(payload) == len(data) - HEADER_BYTES
    fields = list(_FIXED.unpack_from(data))
    assert fields[2] == 1, "expects crc32 objects"
    fields[-1] = zlib.crc32(payload)
    data[: _FIXED.size] = _FIXED.pack(*fields)
    data[HEADER_BYTES:] = payload
    Path(path).write_bytes(bytes(data))


def in_block_order(files: list[str], prompt: list[int], namespace: str) -> list[str]:
    """A prompt's stored objects, block 0 first (file names are the blocks' keys)."""
    by_name = {Path(f).name: f for f in files}
    return [by_name[object_name(k)] for k in block_keys(prompt, BLOCK, namespace=namespace)]


def run_pd(engine: Any, baseline: dict, prompts: dict, connector: str, extra: dict, consumer_requests: list[dict]) -> tuple[dict, Any]:
    """Producer prefills A, B and C (saving them); the caller corrupts; returns (producer results, start_consumer)."""
    out = engine(
        "producer",
        kv=kv_config(connector, "kv_producer", extra),
        watch=extra.get("path") or extra["tiers"][-1]["path"],
        requests=[{"name": n, "prompt": prompts[n], "max_tokens": 1} for n in "ABC"],
    ).result()
    producer = out["results"]
    for n in "ABC":
        assert producer[n]["tokens"] == baseline[n]["tokens"][:1]
        assert producer[n]["worker"]["save_blocks"] == FULL_BLOCKS, producer[n]["worker"]
        assert len(producer[n]["files"]) == FULL_BLOCKS, "one stored object per full prompt block"
        producer[n]["files"] = in_block_order(producer[n]["files"], prompts[n], out["namespace"])

    def start_consumer() -> dict:
        eng = engine(
            "consumer",
            kv=kv_config(connector, "kv_consumer", extra, kv_load_failure_policy="recompute"),
            requests=consumer_requests,
        )
        return eng.result()["results"]

    return producer, start_consumer


def check_loaded(result: dict, blocks: int = FULL_BLOCKS) -> None:
    assert result["num_cached_tokens"] == blocks * BLOCK, f"vLLM did not count the prompt as loaded: {result}"
    assert result["worker"].get("load_blocks") == blocks, result["worker"]
    assert result["worker"].get("load_bytes", 0) > 0 and result["worker"].get("failed_blocks", 0) == 0, result["worker"]


def check_caught(result: dict, baseline: dict, first_bad: int) -> None:
    """A damaged object at block ``first_bad``: the blocks before it load, the rest are recomputed."""
    assert_same_output(result, baseline)
    w = result["worker"]
    assert w.get("corrupt") == 1, f"the damaged object was not caught: {w}"
    assert w.get("failed_blocks") == FULL_BLOCKS - first_bad and w.get("load_failures") == 1, w
    assert w.get("load_blocks") == first_bad, w


def test_fs_pd_hand_off(engine: Any, baseline: dict, prompts: dict, tmp_path: Path) -> None:
    """FSConnector named by class + kv_connector_module_path="kvbridge" (no plugin needed)."""
    extra = {"path": str(tmp_path / "store")}
    requests = [{"name": n, "prompt": prompts[n], "max_tokens": 8} for n in "ABC"]
    producer, start_consumer = run_pd(engine, baseline, prompts, "FSConnector", extra, requests)
    flip_payload(producer["B"]["files"][2])  # B: block 2 damaged -> 2 blocks load, 4 are recomputed
    files_b = producer["B"]["files"]
    for forged, source in zip(producer["C"]["files"], producer["A"]["files"]):  # C: A's KV, valid checksums
        forge(forged, source)
    consumer = start_consumer()

    assert_same_output(consumer["A"], baseline["A"])
    check_loaded(consumer["A"])
    check_caught(consumer["B"], baseline["B"], first_bad=2)
    assert not Path(files_b[2]).exists(), "a damaged object is deleted"
    check_loaded(consumer["C"])  # the forged KV was loaded...
    assert output_differs(consumer["C"], baseline["C"]), "...and must change the output, or these checks prove nothing"


def test_chain_pd_hand_off(engine: Any, baseline: dict, prompts: dict, tmp_path: Path) -> None:
    """ChainConnector (cpu then fs) named ``kvbridge.ChainConnector`` through the vLLM plugin.

    The consumer's cpu tier starts empty (another process): A comes from fs and is promoted into
    cpu; after ``reset_prefix_cache`` A loads again, now from the cpu tier. B's fs object is damaged.
    """
    extra = {"tiers": [{"backend": "cpu", "capacity_bytes": 16 << 20}, {"backend": "fs", "path": str(tmp_path / "store")}]}
    requests = [
        {"name": "A", "prompt": prompts["A"], "max_tokens": 8},
        {"name": "A_again", "prompt": prompts["A"], "max_tokens": 8, "reset_cache": True},
        {"name": "B", "prompt": prompts["B"], "max_tokens": 8},
        {"name": "C", "prompt": prompts["C"], "max_tokens": 8},
    ]
    producer, start_consumer = run_pd(engine, baseline, prompts, "kvbridge.ChainConnector", extra, requests)
    flip_payload(producer["B"]["files"][0])  # B: its first block damaged -> nothing loads, all recomputed
    for forged, source in zip(producer["C"]["files"], producer["A"]["files"]):
        forge(forged, source)
    consumer = start_consumer()

    assert_same_output(consumer["A"], baseline["A"])
    check_loaded(consumer["A"])
    assert consumer["A"]["worker"].get("promoted_blocks") == FULL_BLOCKS, consumer["A"]["worker"]
    assert_same_output(consumer["A_again"], baseline["A"])
    check_loaded(consumer["A_again"])
    assert not consumer["A_again"]["worker"].get("promoted_blocks"), "the second load came from the cpu tier"
    b = consumer["B"]
    assert_same_output(b, baseline["B"])
    assert b["worker"].get("failed_blocks") == FULL_BLOCKS and b["worker"].get("load_failures") == 1, b["worker"]
    check_loaded(consumer["C"])
    assert output_differs(consumer["C"], baseline["C"])
