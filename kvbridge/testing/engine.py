"""A miniature engine: a real paged KV cache and the contract's call sequence, without a model."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvbridge.contract import (
    Backend,
    EngineInfo,
    FinishDecision,
    RequestInfo,
    Role,
    ScheduledRequest,
    SchedulerSide,
    WorkerReport,
    WorkerSide,
)
from kvbridge.errors import TransferTimeout
from kvbridge.keys import block_keys
from kvbridge.layout import BLOCKS_FIRST, MLA, KVLayout

Corrupt = Callable[["MiniEngine", "MiniEngine", Sequence[bytes]], int]
Vanish = Callable[["MiniEngine", "MiniEngine"], None]
BreakSaves = Callable[["MiniEngine", "MiniEngine"], contextlib.AbstractContextManager[None]]


@dataclasses.dataclass(frozen=True)
class Target:
    """What a backend gives the conformance suite: a producer and a consumer backend, and the faults
    its medium can be put through.

    ``consumer=None`` means one engine plays both roles (a tier private to one engine, like ``cpu``).
    ``cleanup`` runs after the test.

    The fault hooks are optional; each takes the producer and the consumer engine (the same engine
    for a one-engine target), as the suite opened them over this target's backends:

    - ``corrupt(producer, consumer, keys)`` damages every stored copy of the blocks ``keys`` in the way
      the medium's own checks exist to catch (flipped bytes in a file, a slot whose write never
      completed), and returns how many stored objects it damaged.
    - ``vanish(producer, consumer)`` takes the medium away: everything stored is gone (a removed
      directory, a cleared store, a peer that stopped), while the indexes may still claim it.
    - ``break_saves(producer, consumer)`` is a context manager inside which saves fail; leaving it
      gives the medium back.

    A test needing a hook the target lacks is skipped, with the reason from ``absent`` (hook name ->
    why this medium has none) when the target gives one.
    """

    producer: Backend
    consumer: Backend | None = None
    cleanup: Callable[[], None] | None = None
    corrupt: Corrupt | None = None
    vanish: Vanish | None = None
    break_saves: BreakSaves | None = None
    absent: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PrefillResult:
    request_id: str
    block_ids: list[int]
    keys: list[bytes]
    loaded_tokens: int  # tokens whose KV really arrived (a failed block and all after it: recomputed)
    loaded_blocks: list[int]  # blocks that arrived
    failed_blocks: list[int]  # blocks whose load failed (recomputed)
    finish: FinishDecision
    snapshot: torch.Tensor  # the request's blocks after prefill, [num_layers, n, block_bytes]
    reoffered: int = 0  # tokens the backend offered again after this request's load failed (must be 0)
    offered_tokens: int = 0  # what the backend's lookup offered (accepted by the engine)


def fill_pattern(key: bytes, layer: int, nbytes: int) -> torch.Tensor:
    """The bytes the mini engine "computes" for a block: a function of its key and layer only."""
    seed = int.from_bytes(hashlib.sha256(key + layer.to_bytes(4, "little")).digest()[:8], "little")
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


def open_engine(
    backend: Backend, layout: KVLayout, *, engine_id: str, role: Role, namespace: str, rank: int = 0,
    world_size: int = 1, replicated: bool = False,
) -> tuple[EngineInfo, SchedulerSide, WorkerSide]:
    """A backend's two sides for one engine over ``layout`` (registered), as an engine opens them (the
    scheduler only matters on rank 0)."""
    info = EngineInfo(
        engine_id=engine_id,
        block_size=layout.fingerprint.block_size,
        role=role,
        namespace=namespace,
        rank=rank,
        world_size=world_size,
        block_bytes=layout.num_layers * layout.block_bytes,
        kv_replicated=replicated,
    )
    scheduler, worker = backend.scheduler(info), backend.worker(info)
    worker.register(layout)
    return info, scheduler, worker


class Ranks:
    """The workers of one tensor-parallel engine, driven as vLLM drives them: each call goes to every
    rank, and a request is reported loaded or saved once every rank has reported it (what vLLM's KV
    output aggregator does); failed blocks of any rank are failed."""

    def __init__(self, workers: Sequence[WorkerSide]):
        self.workers = list(workers)
        self._reported: dict[tuple[str, str], int] = {}  # (kind, request id) -> ranks that reported it

    def start_step(self, plan: Any) -> None:
        for w in self.workers:
            w.start_step(plan)

    def wait_layer(self, layer: int) -> None:
        for w in self.workers:
            w.wait_layer(layer)

    def save_layer(self, layer: int) -> None:
        for w in self.workers:
            w.save_layer(layer)

    def finish_step(self) -> None:
        for w in self.workers:
            w.finish_step()

    def poll(self) -> WorkerReport:
        reports = [w.poll() for w in self.workers]
        return WorkerReport(self._complete("load", [r.finished_loading for r in reports]),
                            self._complete("save", [r.finished_saving for r in reports]),
                            frozenset().union(*(r.failed_blocks for r in reports)))

    def _complete(self, kind: str, finished: list[frozenset[str]]) -> frozenset[str]:
        done = set()
        for rid in (rid for ids in finished for rid in ids):
            n = self._reported[kind, rid] = self._reported.get((kind, rid), 0) + 1
            if n == len(self.workers):
                del self._reported[kind, rid]
                done.add(rid)
        return frozenset(done)

    def wait_idle(self, timeout: float | None = None) -> bool:
        return all([w.wait_idle(timeout) for w in self.workers])

    def close(self) -> None:
        for w in self.workers:
            w.close()


def idle_step(scheduler: SchedulerSide, worker: WorkerSide) -> WorkerReport:
    """One engine step with nothing scheduled (an engine runs one after a request ends, and while it
    waits on transfers): the plan reaches the worker, the worker's report reaches the scheduler."""
    worker.start_step(scheduler.plan_step([]))
    worker.finish_step()
    report = worker.poll()
    scheduler.on_report(report)
    return report


class MiniEngine:
    """One engine (scheduler + one worker, or ``tp`` of them) over a real KV cache of ``num_blocks`` blocks.

    Blocks are handed out in a shuffled order, so every request's block ids are scattered. With
    ``tp > 1`` the ranks split the ``num_kv_heads`` heads evenly, in order, as vLLM does (each registers
    a view of its heads of the one KV cache, :attr:`layout`, which the engine computes and tests read);
    MLA's ranks each hold a whole copy. :attr:`worker` then drives every rank (:class:`Ranks`).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        engine_id: str = "engine",
        role: Role = "both",
        num_layers: int = 4,
        num_blocks: int = 64,
        num_kv_heads: int = 2,
        head_size: int = 16,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        kv_format: str = BLOCKS_FIRST,
        kv_dtype: str | None = None,
        namespace: str = "mini",
        seed: int = 0,
        device: str | None = None,
        tp: int = 1,
    ):
        # the default is $KVBRIDGE_TEST_DEVICE (else cpu): the whole conformance suite runs on a GPU with
        # KVBRIDGE_TEST_DEVICE=cuda (.ci/gpu-check), every backend's bytes still compared on the host
        device = device or os.environ.get("KVBRIDGE_TEST_DEVICE") or "cpu"
        self.block_size = block_size
        if kv_format == BLOCKS_FIRST:  # one allocation, per-layer [B, H, N, 2D] views (vLLM >= 0.26)
            shape: tuple[int, ...] = (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_size)
        elif kv_format == MLA:  # per-layer [B, N, latent] (``head_size`` is the latent; no heads)
            shape = (num_layers, num_blocks, block_size, head_size)
        else:  # per-layer [2, B, N, H, D] (older vLLM)
            shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_size)
        base = torch.zeros(shape, dtype=dtype, device=device)
        self.kv = {f"model.layers.{i}.self_attn": base[i] for i in range(num_layers)}
        self.layout = KVLayout.from_tensors(self.kv, block_size=block_size, kv_dtype=kv_dtype)
        self.copies = [self.layout]  # what computing a block writes into (one per rank for MLA)
        ranks = [self.layout] if tp == 1 else self._shards(base, tp, kv_format, num_kv_heads, kv_dtype)
        opened = [open_engine(backend, layout, engine_id=engine_id, role=role, namespace=namespace, rank=r,
                              world_size=tp, replicated=kv_format == MLA) for r, layout in enumerate(ranks)]
        self.info, self.scheduler, self.worker = opened[0]
        if tp > 1:
            for _, scheduler, _ in opened[1:]:  # vLLM runs one scheduler, on rank 0
                scheduler.close()
            self.worker = Ranks([worker for _, _, worker in opened])  # type: ignore[assignment]
        self._free = list(np.random.default_rng(seed).permutation(num_blocks).tolist())
        self._held: dict[str, list[int]] = {}  # delay_free requests -> their blocks
        self.freed_late: set[str] = set()

    def _shards(self, base: torch.Tensor, tp: int, kv_format: str, heads: int, kv_dtype: str | None) -> list[KVLayout]:
        """Each rank's KV: its heads of ``base`` (views), or for MLA a copy of its own."""
        if kv_format == MLA:
            copies = [base] + [torch.zeros_like(base) for _ in range(tp - 1)]
            self.copies = [KVLayout.from_tensors({n: c[i] for i, n in enumerate(self.kv)}, kv_dtype=kv_dtype) for c in copies]
            return self.copies
        if kv_format != BLOCKS_FIRST or heads % tp:
            raise ValueError(f"tp={tp} needs {BLOCKS_FIRST} or {MLA} blocks and heads ({heads}) that split evenly")
        per = heads // tp
        return [KVLayout.from_tensors({n: base[i, :, r * per : (r + 1) * per] for i, n in enumerate(self.kv)},
                                      kv_dtype=kv_dtype) for r in range(tp)]

    # ---- helpers -------------------------------------------------------------------------------
    def request(self, request_id: str, tokens: Sequence[int], params: Mapping[str, Any] | None = None) -> RequestInfo:
        keys = block_keys(tokens, self.block_size, namespace=self.info.namespace)
        return RequestInfo(request_id, tuple(int(t) for t in tokens), tuple(keys), params)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"mini engine out of blocks ({n} > {len(self._free)})")
        ids, self._free = self._free[:n], self._free[n:]
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        self._free.extend(block_ids)

    def read(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The bytes of ``block_ids`` in every layer, as ``[num_layers, n, block_bytes]`` (on the CPU)."""
        return self.layout.gather(block_ids).cpu().clone()

    def expected(self, keys: Sequence[bytes]) -> torch.Tensor:
        """What the engine computes for blocks ``keys``: ``[num_layers, n, block_bytes]``."""
        out = torch.empty(self.layout.num_layers, len(keys), self.layout.block_bytes, dtype=torch.uint8)
        for i, key in enumerate(keys):
            for layer in range(self.layout.num_layers):
                out[layer, i] = fill_pattern(key, layer, self.layout.block_bytes)
        return out

    def compute(self, block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """Write the "computed" KV of ``keys`` into ``block_ids`` (a partial last block gets zeros)."""
        full = min(len(block_ids), len(keys))
        for layout in self.copies:
            if full:
                layout.scatter(block_ids[:full], self.expected(keys[:full]).to(layout.device))
            if len(block_ids) > full:
                layout.scatter(block_ids[full:], torch.zeros(layout.num_layers, len(block_ids) - full, layout.block_bytes,
                                                             dtype=torch.uint8, device=layout.device))

    def pump(self) -> WorkerReport:
        """One idle engine step (:func:`idle_step`), then free the held blocks it released."""
        report = idle_step(self.scheduler, self.worker)
        self._free_released(report)
        return report

    def _absorb(self, report: WorkerReport) -> None:
        self.scheduler.on_report(report)
        self._free_released(report)

    def _free_released(self, report: WorkerReport) -> None:
        for rid in report.finished_saving:
            blocks = self._held.pop(rid, None)
            if blocks is not None:
                self.free(blocks)
                self.freed_late.add(rid)

    def wait_for(self, predicate: Callable[[WorkerReport], bool], timeout: float) -> list[WorkerReport]:
        reports = []
        deadline = time.monotonic() + timeout
        while True:
            report = self.pump()
            reports.append(report)
            if predicate(report):
                return reports
            if time.monotonic() > deadline:
                raise TransferTimeout(f"mini engine: no report within {timeout}s")
            time.sleep(0.001)

    # ---- the request life cycle ------------------------------------------------------------------
    def prefill(self, request_id: str, tokens: Sequence[int], params: Mapping[str, Any] | None = None, *,
                timeout: float = 30.0, step_after: bool = True, wait_saves: bool = True,
                before_load: Callable[[], None] | None = None) -> PrefillResult:
        return self.prefill_many([(request_id, tokens, params)], timeout=timeout, step_after=step_after,
                                 wait_saves=wait_saves, before_load=before_load)[0]

    def admit(self, request_id: str, tokens: Sequence[int], params: Mapping[str, Any] | None = None
              ) -> tuple[RequestInfo, list[int], int]:
        """The first half of a request's arrival: ``lookup``, allocation of all its blocks, ``on_allocated``.
        Returns the request, its block ids and the tokens it accepted from the backend."""
        req = self.request(request_id, tokens, params)
        n_ext = self.scheduler.lookup(req, 0).num_tokens
        ids = self.allocate(-(-req.num_prompt_tokens // self.block_size))
        self.scheduler.on_allocated(req, ids, n_ext)
        return req, ids, n_ext

    def finish(self, request: RequestInfo, block_ids: Sequence[int]) -> FinishDecision:
        """The request ended: its blocks are freed now, or held (``delay_free``) until the worker reports
        it in ``finished_saving`` (:attr:`held`)."""
        decision = self.scheduler.on_finished(request, block_ids)
        if decision.delay_free:
            self._held[request.request_id] = list(block_ids)
        else:
            self.free(block_ids)
        return decision

    def prefill_many(
        self, requests: Sequence[tuple[str, Sequence[int], Mapping[str, Any] | None]], *, timeout: float = 30.0,
        step_after: bool = True, wait_saves: bool = True, before_load: Callable[[], None] | None = None,
    ) -> list[PrefillResult]:
        """Prefill several requests in the same steps (their loads share one plan), then finish them.

        A request whose load failed is asked again, as vLLM asks (``lookup`` at its new computed
        count): what the backend offers then is :attr:`PrefillResult.reoffered`, which must be 0.
        ``step_after=False`` models an engine that goes idle once the requests end (vLLM's offline
        ``LLM.generate`` returning, an API server after its last request): no step follows the finish.
        ``wait_saves`` waits, before the requests end, until their saves are durable (a client that
        needs the next request to find them); ``False`` leaves them running in the background.
        ``before_load`` runs once the backend has offered and the engine allocated, before the plan with
        the loads reaches the worker (a fault between a lookup and its load)."""
        bs = self.block_size
        reqs, accepted, blocks = [], {}, {}
        for rid, toks, params in requests:
            req, blocks[rid], accepted[rid] = self.admit(rid, toks, params)
            reqs.append(req)
        if before_load is not None:
            before_load()
        waiting = {rid for rid, n in accepted.items() if n > 0}
        failed: set[int] = set()
        if waiting:
            plan = self.scheduler.plan_step([])
            self.worker.start_step(plan)
            self.worker.finish_step()
            deadline = time.monotonic() + timeout
            while waiting:
                report = self.worker.poll()
                self._absorb(report)
                waiting -= report.finished_loading
                failed |= report.failed_blocks
                if waiting and time.monotonic() > deadline:
                    raise TransferTimeout(f"loads of {sorted(waiting)} not reported within {timeout}s")
                if waiting:
                    time.sleep(0.0005)
        scheduled, loaded, reoffered = [], {}, {}
        for req in reqs:
            ids = blocks[req.request_id]
            n_loaded_blocks = -(-accepted[req.request_id] // bs)
            bad = [i for i, b in enumerate(ids[:n_loaded_blocks]) if b in failed]
            good = bad[0] if bad else n_loaded_blocks  # recompute from the first failed block on
            loaded[req.request_id] = ids[:good]
            computed = good * bs
            if bad:  # the engine asks anew; a backend offering the failed blocks again would fail forever
                reoffered[req.request_id] = self.scheduler.lookup(req, computed).num_tokens
            self.compute(ids[good:], req.block_keys[good:])
            scheduled.append(ScheduledRequest(req.request_id, tuple(ids), computed, req.num_prompt_tokens - computed))
        plan = self.scheduler.plan_step(scheduled)
        self.worker.start_step(plan)
        for layer in range(self.layout.num_layers):
            self.worker.wait_layer(layer)
            self.worker.save_layer(layer)
        self.worker.finish_step()
        if wait_saves and not self.worker.wait_idle(timeout):
            raise TransferTimeout(f"saves not over within {timeout}s")
        self._absorb(self.worker.poll())
        results = []
        for req in reqs:
            ids = blocks[req.request_id]
            snapshot = self.read(ids)
            decision = self.finish(req, ids)
            results.append(
                PrefillResult(
                    req.request_id,
                    ids,
                    list(req.block_keys),
                    min(accepted[req.request_id], len(loaded[req.request_id]) * bs),
                    loaded[req.request_id],
                    sorted(b for b in ids if b in failed),
                    decision,
                    snapshot,
                    reoffered.get(req.request_id, 0),
                    accepted[req.request_id],
                )
            )
        if self._held and step_after:
            self.pump()  # as an engine does: the step after a request ends tells the worker what it holds
        return results

    @property
    def held(self) -> dict[str, list[int]]:
        """Requests whose blocks the backend asked to keep (``delay_free``), not yet released."""
        return dict(self._held)

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()
