"""Several KV-cache groups over ucx (vLLM's hybrid KV-cache manager): a full-attention group and a
sliding-window group whose layers share tensors, as vLLM allocates them (one layer of each group per
tensor, their blocks told apart by id), block ids drawn from one pool, and the sliding group's blocks
outside its window given back (``NULL_BLOCK``) as vLLM does.

The consumer reads each group's blocks into that group's layers only; what arrives is compared bit for
bit with the producer's, and what the consumer does not keep (its own dropped window) stays untouched.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

from kvbridge.connectors.ucx import UcxBackend, UcxOptions, onesided  # noqa: E402

from kvbridge.contract import NULL_BLOCK, EngineInfo, KVGroup, RequestInfo, WorkerReport, split_groups  # noqa: E402
from kvbridge.keys import block_keys  # noqa: E402
from kvbridge.layout import KVLayout  # noqa: E402
from kvbridge.testing.engine import fill_pattern  # noqa: E402

if not onesided.available()[0]:
    pytest.skip(f"several KV-cache groups need the one-sided lane: {onesided.available()[1]}", allow_module_level=True)

BS, WINDOW, SLOTS, BLOCKS = 16, 32, 2, 64
GROUPS = (KVGroup(SLOTS), KVGroup(SLOTS, WINDOW))  # full attention, then a 32-token sliding window


class GroupedEngine:
    """One scheduler and one worker over a grouped KV: layer i of each group is a view of tensor i, as
    vLLM shares them (``shared``), or each layer has its own tensor."""

    def __init__(self, backend: UcxBackend, engine_id: str, role: str, seed: int, shared: bool):
        self.base = torch.zeros(SLOTS if shared else 2 * SLOTS, BLOCKS, 2, BS, 16, dtype=torch.bfloat16)
        noise = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, self.base.numel() * 2, dtype=np.uint8))
        self.base.view(-1).view(torch.uint8).copy_(noise)  # stale bytes everywhere: a stray read would show
        kv = {f"{kind}.{i}": self.base[i if shared else g * SLOTS + i]
              for g, kind in enumerate(("full", "swa")) for i in range(SLOTS)}
        self.layout = KVLayout.from_tensors(kv, block_size=BS, groups=[SLOTS, SLOTS])
        self.info = EngineInfo(engine_id, BS, role=role, namespace="mini",  # type: ignore[arg-type]
                               block_bytes=2 * SLOTS * self.layout.block_bytes, kv_groups=GROUPS)
        self.scheduler, self.worker = backend.scheduler(self.info), backend.worker(self.info)
        self.worker.register(self.layout)
        self._free = np.random.default_rng(seed).permutation(np.arange(1, BLOCKS)).tolist()
        self.shared = shared

    def request(self, rid: str, tokens: list[int], params: Any = None) -> RequestInfo:
        return RequestInfo(rid, tuple(tokens), tuple(block_keys(tokens, BS, namespace="mini")), params)

    def allocate(self, positions: int, computed: int) -> list[int]:
        """Group-major ids for ``positions`` blocks; the sliding group's before its window at ``computed``
        tokens are NULL_BLOCK (vLLM's rule)."""
        ids = [self._free.pop() for _ in range(2 * positions)]
        dropped = max(0, computed - WINDOW + 1) // BS
        for p in range(min(dropped, positions)):
            self._free.append(ids[positions + p])
            ids[positions + p] = NULL_BLOCK
        return ids

    def compute(self, ids: list[int], keys: tuple[bytes, ...]) -> None:
        for layers, group in zip(self.layout.groups, split_groups(ids, 2)):
            for b, key in zip(group, keys):
                for layer in layers if b != NULL_BLOCK else ():
                    self.layout.scatter_layer(layer, torch.tensor([b]), fill_pattern(key, layer, self.layout.block_bytes)
                                              .view(1, -1), None)

    def block(self, layer: int, b: int) -> torch.Tensor:
        """The bytes of block ``b`` of one layer."""
        return self.layout.layers[layer][b].contiguous().view(torch.uint8).reshape(-1).clone()

    def step(self) -> WorkerReport:
        """An engine step with nothing scheduled: the plan reaches the worker, its report the scheduler."""
        self.worker.start_step(self.scheduler.plan_step([]))
        self.worker.finish_step()
        report = self.worker.poll()
        self.scheduler.on_report(report)
        return report

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


@pytest.fixture(params=[True, False], ids=["shared-tensors", "own-tensors"])
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    options = UcxOptions(registry_dir=str(tmp_path / "reg"))
    backend = UcxBackend(options)
    producer = GroupedEngine(UcxBackend(options), "p", "producer", 1, request.param)
    consumer = GroupedEngine(backend, "c", "consumer", 2, request.param)
    yield producer, consumer, backend
    producer.close()
    consumer.close()


def _hand_off(producer: GroupedEngine, tokens: list[int]) -> tuple[RequestInfo, list[int], dict[str, Any]]:
    """Prefill ``tokens`` on the producer and end the request as vLLM would: its sliding group has given
    back the blocks before its window."""
    req = producer.request("r", tokens)
    n = -(-len(tokens) // BS)
    ids = producer.allocate(n, 0)
    producer.scheduler.on_allocated(req, ids, 0)
    producer.compute(ids, req.block_keys)
    dropped = max(0, len(tokens) - WINDOW + 1) // BS
    for p in range(dropped):
        producer._free.append(ids[n + p])
        ids[n + p] = NULL_BLOCK
    params = producer.scheduler.on_finished(req, ids).transfer_params
    assert params is not None and params["groups"] == 2
    producer.step()  # the workers learn the hold
    return req, ids, dict(params)


def test_each_group_arrives_in_its_own_layers(pair: Any) -> None:
    producer, consumer, backend = pair
    tokens = np.random.default_rng(3).integers(0, 32000, 6 * BS + 4).tolist()
    req, sent, params = _hand_off(producer, tokens)
    creq = consumer.request("c", tokens, params)
    n_ext = consumer.scheduler.lookup(creq, 0).num_tokens
    assert n_ext == 6 * BS
    ids = consumer.allocate(7, n_ext)  # keeps the sliding group's blocks 4 and 5 (and 6, computed here)
    before = consumer.base.clone()
    consumer.scheduler.on_allocated(creq, ids, n_ext)
    report = consumer.step()
    while "c" not in report.finished_loading:
        report = consumer.step()
    assert not report.failed_blocks
    theirs, ours = split_groups(sent, 2), split_groups(ids, 2)
    for g, layers in enumerate(consumer.layout.groups):
        for p in range(6):
            for layer in layers:
                if ours[g][p] == NULL_BLOCK:
                    continue
                assert theirs[g][p] != NULL_BLOCK
                got, want = consumer.block(layer, ours[g][p]), producer.block(layer, theirs[g][p])
                assert torch.equal(got, want), f"group {g} layer {layer} position {p}"
                assert torch.equal(got, fill_pattern(creq.block_keys[p], layer, consumer.layout.block_bytes))
    for g, layers in enumerate(consumer.layout.groups):  # in each group's layers, only its loaded blocks changed
        mine = set(ours[g][:6])
        for layer in layers:
            others = [b for b in range(BLOCKS) if b not in mine]
            now = consumer.layout.layers[layer][others].contiguous().view(torch.uint8)  # bits: noise holds NaNs
            then = before[_tensor_of(consumer, layer)][others].contiguous().view(torch.uint8)
            if not consumer.shared:
                assert torch.equal(now, then), f"group {g} layer {layer}: a block it did not load changed"
    assert backend.stats.load_bytes == (6 + 2) * SLOTS * consumer.layout.block_bytes  # 6 full, 2 sliding


def _tensor_of(engine: GroupedEngine, layer: int) -> int:
    """Which of ``engine.base``'s tensors layer ``layer`` is a view of."""
    return layer % SLOTS if engine.shared else layer


def test_a_window_the_producer_gave_back_is_a_miss_and_released(pair: Any) -> None:
    """127 tokens: the producer keeps its sliding blocks from position 6 on; a consumer loading 112 tokens
    needs position 5 too. A miss (recomputed), and the producer frees its blocks at once."""
    producer, consumer, backend = pair
    tokens = np.random.default_rng(4).integers(0, 32000, 7 * BS + 15).tolist()
    _, _, params = _hand_off(producer, tokens)
    assert consumer.scheduler.lookup(consumer.request("c", tokens, params), 0).num_tokens == 0
    assert (backend.stats.refused_handoffs, backend.stats.unpulled_handoffs) == (1, 1)
    deadline = time.monotonic() + 10
    while "r" not in producer.step().finished_saving:
        assert time.monotonic() < deadline, "the producer still holds the hand-off"


def test_layers_of_different_groups_may_share_a_tensor_not_within_one() -> None:
    base = torch.zeros(2, 8, 2, BS, 16)
    with pytest.raises(Exception, match="share memory"):
        KVLayout.from_tensors({"a": base[0], "b": base[0]}, groups=[2])
    layout = KVLayout.from_tensors({"a": base[0], "b": base[0]}, groups=[1, 1])
    assert layout.groups == (range(0, 1), range(1, 2)) and layout.fingerprint.kv_format == "blocks_first+groups:1-1"
