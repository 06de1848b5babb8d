"""kvbridge's store tiers on vLLM's KV-cache event stream (:mod:`kvbridge.vllm.events`), from a real server.

One ``api_server`` with ``kvbridge.CPUConnector`` (a cpu tier of 12 blocks) and ``--kv-events-config``
(vLLM's ZMQ publisher); a subscriber in the test decodes the stream with vLLM's own ``KVEventBatch``.
Checked: after prompt A, the stream carries vLLM's own ``BlockStored`` for A's blocks (its GPU cache) and
kvbridge's ``BlockStored`` with medium ``CPU`` for the same hashes, parent hash and token ids (so an
indexer matches them); once two more prompts have pushed A out of the cpu tier, a ``BlockRemoved`` with
medium ``CPU`` for A's hashes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pdkit import BLOCK, PROMPT_LEN, engine_env
from test_api_server import SERVER_START_S, call, free_port, stop_all, text_of, wait_healthy

BLOCK_BYTES = BLOCK * 2 * 2 * 64 * 2 * 4  # the tiny model's KV of one block (2 layers, 2 KV heads, fp32)
FULL = PROMPT_LEN // BLOCK


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


@pytest.fixture
def server(tiny_model: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    port, events_port = free_port(), free_port()
    kv = {"kv_connector": "kvbridge.CPUConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"capacity_bytes": 12 * BLOCK_BYTES}}  # fmt: skip
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}", "topic": "kv"}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
        "--served-model-name", "tiny", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "512",
        "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0", "--host", "127.0.0.1",
        "--port", str(port), "--kv-transfer-config", json.dumps(kv), "--kv-events-config", json.dumps(events),
    ]  # fmt: skip
    log = tmp_path / "server.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(env, VLLM_CPU_OMP_THREADS_BIND="0", OMP_NUM_THREADS="1"))
    sub = None
    try:
        wait_healthy(port, proc, log, time.monotonic() + SERVER_START_S)
        sub = Subscriber(f"tcp://127.0.0.1:{events_port}")
        time.sleep(1.0)  # the subscription reaches the publisher (ZMQ drops what is sent before)
        yield {"port": port, "sub": sub, "log": log}
    finally:
        if sub is not None:
            sub.close()
        stop_all([proc])


def _complete(port: int, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": text_of(prompt), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, data = call(port, "POST", "/v1/completions", body)
    assert status == 200, data[:1000]


def test_a_cpu_tier_is_on_vllms_event_stream(server: dict[str, Any], prompts: dict) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    sub, port = server["sub"], server["port"]
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
