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

import os
import struct
from pathlib import Path
from typing import Any

from kvbridge.connectors.fs import _FIXED, FORMAT, object_name
from pdkit import BLOCK, PROMPT_LEN, assert_same_output, gated, kv_config, open_gate, output_differs

from kvbridge import codec
from kvbridge.keys import block_keys
from kvbridge.layout import LayoutFingerprint

FULL_BLOCKS = PROMPT_LEN // BLOCK
_ENTRY = struct.Struct("<IH")  # per block in an fs object's header: checksum, key length (the key follows)


def _blocks(path: str) -> tuple[tuple[Any, ...], list[tuple[int, bytes]], bytes]:
    """An fs object's fixed header fields, its (checksum, key) per block, and its fingerprint (kvbridge.codec.FS)."""
    data = Path(path).read_bytes()
    fixed = _FIXED.unpack_from(data)
    at = _FIXED.size + fixed[5]
    entries = []
    for _ in range(fixed[4]):
        crc, n = _ENTRY.unpack_from(data, at)
        entries.append((crc, data[at + _ENTRY.size : at + _ENTRY.size + n]))
        at += _ENTRY.size + n
    return fixed, entries, data[_FIXED.size : _FIXED.size + fixed[5]]


def block_extent(locator: str, key: bytes) -> tuple[str, int, int]:
    """(object, offset, length) of the block ``key`` whose locator (its object, or a link to it) is ``locator``."""
    obj = os.path.realpath(locator)
    fixed, entries, _ = _blocks(obj)
    pos = [k for _, k in entries].index(key)
    return obj, fixed[3] + pos * fixed[6], fixed[6]


def flip_payload(locator: str, key: bytes) -> None:
    """Flip bytes inside one stored block's payload; the header (and its checksums) stay as they were."""
    obj, off, length = block_extent(locator, key)
    data = bytearray(Path(obj).read_bytes())
    for at in range(off + 100, off + length, 4099):
        data[at] ^= 0xFF
    Path(obj).write_bytes(bytes(data))


def forge(blocks: list[tuple[str, bytes]], payload_from: list[tuple[str, bytes]]) -> None:
    """Give a prompt's stored blocks (``in_block_order``) another prompt's KV, block for block, under correct
    checksums: undetectable."""
    source = {i: block_extent(*b) for i, b in enumerate(payload_from)}
    index = {key: i for i, (_, key) in enumerate(blocks)}
    for obj in dict.fromkeys(os.path.realpath(f) for f, _ in blocks):
        fixed, entries, fp = _blocks(obj)
        data = bytearray(Path(obj).read_bytes())
        for pos, (_, key) in enumerate(entries):
            src, off, n = source[index[key]]
            data[fixed[3] + pos * n : fixed[3] + (pos + 1) * n] = Path(src).read_bytes()[off : off + n]
        sums = [codec.checksum(fixed[2], [data[fixed[3] + i * fixed[6] : fixed[3] + (i + 1) * fixed[6]]]) for i in range(len(entries))]
        header = FORMAT.pack([k for _, k in entries], LayoutFingerprint.from_json(fp), sums, fixed[2])
        Path(obj).write_bytes(header + bytes(data[fixed[3] :]))


def in_block_order(files: list[str], prompt: list[int], namespace: str) -> list[tuple[str, bytes]]:
    """A prompt's stored blocks, block 0 first: (its locator, its key) (locator names are the blocks' keys)."""
    by_name = {Path(f).name: f for f in files}
    return [(by_name[object_name(k)], k) for k in block_keys(prompt, BLOCK, namespace=namespace)]


def run_pd(engine: Any, baseline: dict, prompts: dict, connector: str, extra: dict, consumer_requests: list[dict],
           gate: Path) -> tuple[dict, Any]:
    """Producer prefills A, B and C (saving them); the caller corrupts; returns (producer results, consumer_results).
    The consumer starts beside the producer and sends its requests once ``consumer_results`` is called."""
    consumer = engine(
        "consumer",
        kv=kv_config(connector, "kv_consumer", extra, kv_load_failure_policy="recompute"),
        requests=consumer_requests,
        **gated(gate),
    )
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
        assert len(producer[n]["files"]) == FULL_BLOCKS, "a locator per full prompt block (the chunk's object or a link)"
        producer[n]["files"] = in_block_order(producer[n]["files"], prompts[n], out["namespace"])

    def consumer_results() -> dict:
        open_gate(gate)
        return consumer.result()["results"]

    return producer, consumer_results


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
    producer, consumer_results = run_pd(engine, baseline, prompts, "FSConnector", extra, requests, tmp_path / "gate.json")
    flip_payload(*producer["B"]["files"][2])  # B: block 2 damaged -> 2 blocks load, 4 are recomputed
    files_b = [f for f, _ in producer["B"]["files"]]
    forge(producer["C"]["files"], producer["A"]["files"])  # C: A's KV, valid checksums
    consumer = consumer_results()

    assert_same_output(consumer["A"], baseline["A"])
    check_loaded(consumer["A"])
    check_caught(consumer["B"], baseline["B"], first_bad=2)
    assert not Path(files_b[2]).exists(), "a damaged object is deleted (its links lead nowhere)"
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
    producer, consumer_results = run_pd(engine, baseline, prompts, "kvbridge.ChainConnector", extra, requests,
                                      tmp_path / "gate.json")
    flip_payload(*producer["B"]["files"][0])  # B: its first block damaged -> nothing loads, all recomputed
    forge(producer["C"]["files"], producer["A"]["files"])
    consumer = consumer_results()

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
