"""Several KV-cache groups through every store (vLLM's hybrid KV-cache manager: a full-attention group and a
32-token sliding-window group — or a Mamba state group — one layer of each sharing each tensor, block ids
from one pool).

The engine here runs a prompt in chunks as vLLM does: after each chunk the sliding group gives back the
blocks its window left, and another request writes into them at once (so a save still reading them
would store that request's bytes; the next plan flushes such saves). Each group's blocks are stored under
their own keys; a consumer loads the full group's prefix and, of the sliding group, what its window at
the hit covers. Every loaded block is compared bit for bit with what the producer computed.

A state group (Mamba in vLLM's align mode) keeps, as vLLM does, one block per position only where a step
ended on a block boundary (the state after that block), and only the latest: the one before goes back
and is overwritten by another request. A consumer resumes at the longest shared boundary whose state
was stored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvbridge import registry
from kvbridge.contract import NULL_BLOCK, EngineInfo, KVGroup, RequestInfo, ScheduledRequest, WorkerReport, split_groups
from kvbridge.keys import block_keys
from kvbridge.layout import KVLayout
from kvbridge.testing.engine import fill_pattern
from kvbridge.testing.targets import target_for

BS, WINDOW, SLOTS, BLOCKS = 16, 32, 2, 96
GROUPS = (KVGroup(SLOTS), KVGroup(SLOTS, WINDOW))
MAMBA = (KVGroup(SLOTS), KVGroup(SLOTS, state=True))
STORES = sorted(n for n in registry.available() if n != "ucx")  # the stores (ucx: tests/test_ucx_groups.py)


class Engine:
    """A scheduler and worker over a grouped KV whose worker registers each shared tensor once."""

    def __init__(self, backend: Any, engine_id: str, role: str, seed: int, groups: tuple[KVGroup, ...] = GROUPS):
        self.base = torch.zeros(SLOTS, BLOCKS, 2, BS, 16, dtype=torch.bfloat16)
        self.base.view(torch.uint8).copy_(torch.from_numpy(
            np.random.default_rng(seed).integers(0, 256, self.base.numel() * 2, dtype=np.uint8)).view(self.base.view(torch.uint8).shape))
        # the grouped view (the test reads through it); the store sees each tensor once
        self.view = KVLayout.from_tensors({f"{k}.{i}": self.base[i] for k in ("full", "swa") for i in range(SLOTS)},
                                          groups=[SLOTS, SLOTS])
        tensors = KVLayout.from_tensors({f"t{i}": self.base[i] for i in range(SLOTS)}, block_size=BS)
        self.info = EngineInfo(engine_id, BS, role=role, namespace="mini",  # type: ignore[arg-type]
                               block_bytes=SLOTS * tensors.block_bytes, kv_groups=groups)
        self.state = groups[1].state
        self.scheduler, self.worker = backend.scheduler(self.info), backend.worker(self.info)
        self.worker.register(tensors)
        self.layers = tensors.num_layers
        self._free = np.random.default_rng(seed).permutation(np.arange(1, BLOCKS)).tolist()
        self.flushed: list[tuple[str, ...]] = []
        self._reused: list[int] = []  # sliding blocks given back: another request writes them next step

    def _step(self, scheduled: list[ScheduledRequest], compute: Any = None) -> WorkerReport:
        plan = self.scheduler.plan_step(scheduled)
        self.flushed.append(plan.flush)
        self.worker.start_step(plan)  # (waits for the saves the plan flushes)
        for block in self._reused:  # the forward pass of the request that took them writes them now
            self._write(1, block, None)
        self._reused = []
        if compute is not None:
            compute()
        for layer in range(self.layers):
            self.worker.wait_layer(layer)
            self.worker.save_layer(layer)
        self.worker.finish_step()
        report = self.worker.poll()
        self.scheduler.on_report(report)
        return report

    def _write(self, group: int, block: int, key: bytes | None) -> None:
        """A group's block as computed for ``key`` (``None``: another request's bytes)."""
        for layer in self.view.groups[group]:
            data = (fill_pattern(key, layer, self.view.block_bytes) if key is not None
                    else torch.randint(0, 256, (self.view.block_bytes,), dtype=torch.uint8))
            self.view.scatter_layer(layer, torch.tensor([block]), data.view(1, -1), None)

    def prefill(self, rid: str, tokens: list[int], chunk: int = 48,
                after_load: Any = None) -> tuple[RequestInfo, list[int], int]:
        """One request as vLLM runs it (``after_load(request, ids)`` once its load is in, before it computes);
        returns it, its ids at its end, and the tokens it loaded."""
        req = RequestInfo(rid, tuple(tokens), tuple(block_keys(tokens, BS, namespace="mini")))
        n_ext = self.scheduler.lookup(req, 0).num_tokens
        positions = -(-len(tokens) // BS)
        ids = [self._free.pop() for _ in range(2 * positions)]
        self._drop(ids, positions, n_ext, n_ext)
        self.scheduler.on_allocated(req, ids, n_ext)
        if n_ext:
            report = self._step([])
            while rid not in report.finished_loading:
                report = self._step([])
            assert not report.failed_blocks
        if after_load is not None:
            after_load(req, list(ids))
        for a in range(n_ext, len(tokens), chunk):
            b = min(a + chunk, len(tokens))
            self._drop(ids, positions, a, b)

            def compute(a: int = a, b: int = b) -> None:
                for g, group in enumerate(split_groups(ids, 2)):
                    for p in range(a // BS, -(-b // BS)):
                        if group[p] != NULL_BLOCK:
                            self._write(g, group[p], req.block_keys[p] if p < len(req.block_keys) else None)

            self._step([ScheduledRequest(rid, tuple(ids), a, b - a)], compute)
            self._drop(ids, positions, b, b)
        decision = self.scheduler.on_finished(req, ids)
        while decision.delay_free and rid not in self._step([]).finished_saving:
            pass
        return req, ids, n_ext

    def _drop(self, ids: list[int], positions: int, computed: int, upto: int) -> None:
        """What vLLM gives back of the second group before a step from ``computed`` to ``upto`` tokens (and
        after one, both at its end), to another request that writes them in the next step: a sliding
        window's blocks before token ``computed - window + 1``; a state group's blocks before the one
        holding the state at ``upto`` (a step's state lands only where it ends, the one before it is
        superseded)."""
        keep = range(min(positions, max(0, computed - WINDOW + 1) // BS), positions)
        if self.state:
            keep = range(-(-upto // BS) - 1, positions)
        for p in range(positions):
            if p not in keep and ids[positions + p] != NULL_BLOCK:
                self._reused.append(ids[positions + p])
                self._free.insert(0, ids[positions + p])
                ids[positions + p] = NULL_BLOCK

    def block(self, layer: int, b: int) -> torch.Tensor:
        return self.view.layers[layer][b].contiguous().view(torch.uint8).reshape(-1)

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


@pytest.mark.parametrize("name", STORES)
def test_every_store_moves_both_groups_and_only_inside_the_window(name: str, tmp_path: Path) -> None:
    try:
        target = target_for(name, tmp_path)
    except ImportError as exc:
        pytest.skip(f"{name} cannot run here: {exc}")
    producer = Engine(target.producer, "p", "producer" if target.consumer else "both", 1)
    consumer = Engine(target.consumer, "c", "consumer", 2) if target.consumer else producer
    try:
        tokens = np.random.default_rng(5).integers(0, 32000, 7 * BS + 5).tolist()
        producer.prefill("a", tokens)
        assert any("a" in f for f in producer.flushed), "a sliding window's saves are flushed before the next step"
        prefix = tokens[: 3 * BS] + np.random.default_rng(6).integers(0, 32000, 2 * BS).tolist()
        checked: list[int] = []

        def check(req: RequestInfo, ids: list[int]) -> None:
            full, swa = split_groups(ids, 2)
            assert [p for p in range(3) if swa[p] != NULL_BLOCK] == [1, 2], "a window of 32 tokens at 48: blocks 1, 2"
            for g, mine in ((0, full), (1, swa)):
                for p in (p for p in range(3) if mine[p] != NULL_BLOCK):
                    for layer in consumer.view.groups[g]:
                        want = fill_pattern(req.block_keys[p], layer, consumer.view.block_bytes)
                        assert torch.equal(consumer.block(layer, mine[p]), want), f"group {g} position {p} layer {layer}"
                        checked.append(layer)

        _, _, loaded = consumer.prefill("b", prefix, after_load=check)
        assert loaded == 3 * BS, "the shared 3 blocks: all of the full group, the window's of the sliding one"
        assert len(checked) == (3 + 2) * SLOTS
    finally:
        producer.close()
        if consumer is not producer:
            consumer.close()


@pytest.mark.parametrize("chunk", [BS, 48])
@pytest.mark.parametrize("name", STORES)
def test_every_store_moves_mamba_state_at_the_longest_stored_boundary(name: str, chunk: int, tmp_path: Path) -> None:
    """A Mamba state group: the producer's steps of ``chunk`` tokens store a state at each step's end (every
    block with one-block steps; at 48 and 96 tokens with 48-token steps); a consumer sharing 5 blocks
    resumes where a state is stored (5 blocks, or 3), with every full block before it and that state."""
    try:
        target = target_for(name, tmp_path)
    except ImportError as exc:
        pytest.skip(f"{name} cannot run here: {exc}")
    producer = Engine(target.producer, "p", "producer" if target.consumer else "both", 1, MAMBA)
    consumer = Engine(target.consumer, "c", "consumer", 2, MAMBA) if target.consumer else producer
    want_blocks = 5 if chunk == BS else 3
    try:
        tokens = np.random.default_rng(5).integers(0, 32000, 7 * BS + 5).tolist()
        producer.prefill("a", tokens, chunk=chunk)
        assert any("a" in f for f in producer.flushed), "a state group's saves are flushed before the next step"
        prefix = tokens[: 5 * BS] + np.random.default_rng(6).integers(0, 32000, 2 * BS).tolist()
        checked: list[tuple[int, int]] = []

        def check(req: RequestInfo, ids: list[int]) -> None:
            full, state = split_groups(ids, 2)
            for g, positions in ((0, range(want_blocks)), (1, [want_blocks - 1])):
                mine = (full, state)[g]
                for p in positions:
                    for layer in consumer.view.groups[g]:
                        want = fill_pattern(req.block_keys[p], layer, consumer.view.block_bytes)
                        assert torch.equal(consumer.block(layer, mine[p]), want), f"group {g} position {p} layer {layer}"
                        checked.append((g, p))

        _, _, loaded = consumer.prefill("b", prefix, chunk=chunk, after_load=check)
        assert loaded == want_blocks * BS, "resumed at the longest shared block boundary with a stored state"
        assert len(checked) == (want_blocks + 1) * SLOTS
    finally:
        producer.close()
        if consumer is not producer:
            consumer.close()
