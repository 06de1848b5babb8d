"""kvbridge's store tiers on vLLM's KV-cache event stream (:mod:`kvbridge.vllm.events`), from a real server.

An ``api_server`` with ``kvbridge.CPUConnector`` (a cpu tier of 12 blocks) and ``--kv-events-config``
(vLLM's ZMQ publisher): replica ``a`` of ``test_routing.py``, whose first test runs
:func:`check_cpu_tier_on_the_stream` here on it before any other request (a server costs a minute to
start; the two tests would start the same one). A subscriber in the test decodes the stream with vLLM's
own ``KVEventBatch``. Checked: after prompt A, the stream carries vLLM's own ``BlockStored`` for A's blocks
(its GPU cache) and kvbridge's ``BlockStored`` with medium ``CPU`` for the same hashes, parent hash and token
ids (so an indexer matches them); once two more prompts have pushed A out of the cpu tier, a
``BlockRemoved`` with medium ``CPU`` for A's hashes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pdkit import BLOCK, PROMPT_LEN
from test_api_server import call, text_of

BLOCK_BYTES = BLOCK * 2 * 2 * 64 * 2 * 4  # the tiny model's KV of one block (2 layers, 2 KV heads, fp32)
FULL = PROMPT_LEN // BLOCK
TIER_BLOCKS = 12  # the cpu tier's size: two prompts after A (6 full blocks each) push A out of it


class Subscriber:
    """vLLM's KV-event stream, decoded with vLLM's own types, collected on a thread."""

    def __init__(self, endpoint: str, topic: str = "kv"):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.events: list[Any] = []
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sock.connect(endpoint)
        self._again, self._stop = zmq.Again, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                parts = self._sock.recv_multipart()
            except self._again:
                continue
            self.events.extend(self._decoder.decode(parts[-1]).events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


def _complete(port: int, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": text_of(prompt), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, data = call(port, "POST", "/v1/completions", body)
    assert status == 200, data[:1000]


def check_cpu_tier_on_the_stream(port: int, events_port: int, prompts: dict[str, list[int]]) -> None:
    """The module's checks, on the server at ``port`` (cpu tier of :data:`TIER_BLOCKS`, vLLM's events on
    ``events_port``, topic ``kv``), with ``prompts`` A to D that it has never seen."""
    sub = Subscriber(f"tcp://127.0.0.1:{events_port}")
    try:
        time.sleep(1.0)  # the subscription reaches the publisher (ZMQ drops what is sent before)
        _check(port, sub, prompts)
    finally:
        sub.close()


def _check(port: int, sub: Subscriber, prompts: dict[str, list[int]]) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    _complete(port, prompts["A"])

    def stored(medium: str | None) -> list[Any]:
        return [e for e in list(sub.events) if isinstance(e, BlockStored) and e.medium == medium]

    deadline = time.monotonic() + 60
    while not any(e.token_ids[:BLOCK] == prompts["A"][:BLOCK] for e in stored("CPU")):
        assert time.monotonic() < deadline, f"no CPU BlockStored for A; events: {sub.events[:20]}"
        _complete(port, prompts["D"])  # the engine steps (and publishes) only while it has requests
        time.sleep(0.2)
    vllm_own = next(e for e in list(sub.events) if isinstance(e, BlockStored) and e.medium != "CPU"
                    and e.token_ids[:BLOCK] == prompts["A"][:BLOCK])  # fmt: skip
    ours = [e for e in stored("CPU") if e.token_ids[:BLOCK] == prompts["A"][:BLOCK]]
    assert len(ours) == 1, ours
    (cpu,) = ours
    assert cpu.block_hashes == vllm_own.block_hashes[:FULL] and len(cpu.block_hashes) == FULL, (cpu, vllm_own)
    assert cpu.parent_block_hash is None and cpu.block_size == BLOCK
    assert cpu.token_ids == prompts["A"][: FULL * BLOCK]

    for name in "BC":  # 12 more blocks: A's are the least recently used, evicted from the 12-block tier
        _complete(port, prompts[name])
    deadline = time.monotonic() + 60
    a_hashes = set(cpu.block_hashes)

    def removed() -> set[Any]:
        return {h for e in list(sub.events) if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes}

    while not a_hashes <= removed():
        assert time.monotonic() < deadline, f"A's CPU blocks never removed: {removed()} vs {a_hashes}"
        _complete(port, prompts["D"])
        time.sleep(0.2)
    counts = {m: len(stored(m)) for m in ("CPU", vllm_own.medium)}
    print(f"events: BlockStored by medium {counts}, CPU BlockRemoved hashes {len(removed())}")
