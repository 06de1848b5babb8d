"""The ``ucx`` scheduler side: a consumer admits what transfer params name and plans the pulls; a producer
holds finished prompts' blocks for a consumer and says where to pull them from.

The load's life (planned, in flight, failed and never offered again, held at the request's end while a
pull still writes its blocks) is the core's :class:`~kvbridge.lifecycle.LoadBook`; what is ucx's own is
admitting params, the hand-off (grants, leases) and the :class:`UcxPlan` to the workers. A hand-off the
consumer decides not to pull is released from here (:mod:`.releaser`), so its producer frees the blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvbridge.connectors.ucx import addresses, onesided
from kvbridge.connectors.ucx.options import UcxOptions, UcxStats
from kvbridge.connectors.ucx.params import PLAN, Hold, UcxPlan, UcxSource, check_params, handoff_params
from kvbridge.connectors.ucx.releaser import Releaser

from kvbridge.contract import (
    NULL_BLOCK,
    BlockLoad,
    EngineInfo,
    FinishDecision,
    KVGroup,
    Lookup,
    RequestInfo,
    ScheduledRequest,
    SchedulerSide,
    StepPlan,
    WorkerReport,
    split_groups,
)
from kvbridge.lifecycle import Ending, LoadBook

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Incoming:
    """A consumer's request whose params passed :func:`check_params`, as of its last lookup."""

    params: Mapping[str, Any]
    num_computed: int = 0


def _wants_remote_decode(role: str, request: RequestInfo) -> bool:
    """Hold a finished request's blocks for a consumer? Always on a pure producer; on an engine that
    does both, only when the client asked (vLLM's ``do_remote_decode``), so ordinary requests free at once."""
    params = request.transfer_params or {}
    return role == "producer" or bool(params.get("do_remote_decode"))


class UcxScheduler(SchedulerSide):
    """Scheduler side. As a consumer: admits what the transfer params name and plans the pulls. As a
    producer: holds finished prompts' full blocks for a consumer and says where to pull them from."""

    def __init__(self, options: UcxOptions, engine: EngineInfo, stats: UcxStats | None = None):
        self.options = options
        self.engine = engine
        self.stats: UcxStats = stats if stats is not None else UcxStats()
        self._refused: set[str] = set()  # live requests whose params were refused (logged once each)
        self.loads = LoadBook()
        self._incoming: dict[str, _Incoming] = {}
        self._holds: list[Hold] = []  # handed off since the last plan: the workers learn them from it
        self._grant_key = onesided.new_key()  # a new engine, a new key: grants of a previous one fail
        self._handoffs = 0  # hand-offs so far: the next one's seal slot
        self._releaser = Releaser(options, engine.engine_id)
        self._resliced: dict[str, UcxSource] = {}  # loads from another TP size: released here once they end

    # ---- consumer ----
    def lookup(self, request: RequestInfo, num_computed_tokens: int) -> Lookup:
        self._check_open()
        if self.engine.role == "producer" or self.loads.failed_before(request.request_id):
            return Lookup(0)  # a failed pull is not offered again: the engine recomputes the prompt
        params, why = check_params(request.transfer_params)
        if params is None:
            self._refuse(request.request_id, why)
            return Lookup(0)
        if params["engine_id"] == self.engine.engine_id:
            return Lookup(0)
        groups = self._groups
        if params.get("groups", 1) != len(groups):
            self._refuse(request.request_id, f"the producer has {params.get('groups', 1)} KV-cache groups, "
                         f"this engine {len(groups)}")
            return Lookup(0)
        remote = split_groups(params["block_ids"], len(groups))
        # never more than the named blocks hold: the engine would take the rest as loaded
        loadable = min(params["num_tokens"], len(remote[0]) * self.engine.block_size, request.num_prompt_tokens - 1)
        if loadable > num_computed_tokens and not self._windows_kept(remote, num_computed_tokens, loadable):
            if request.request_id not in self._refused:
                self._let_go(request.request_id, UcxSource.of(params, ()), "its window is gone")
            self._refuse(request.request_id, "the producer no longer keeps the sliding-window blocks this prompt needs")
            return Lookup(0)
        self._incoming[request.request_id] = _Incoming(params, num_computed_tokens)
        return Lookup(max(0, loadable - num_computed_tokens), is_async=True)

    @property
    def _groups(self) -> tuple[KVGroup, ...]:
        return self.engine.kv_groups or (KVGroup(0),)

    def _windows_kept(self, remote: list[tuple[int, ...]], computed: int, total: int) -> bool:
        """Whether each sliding-window group of the producer still holds the blocks this engine will load
        for it: those from ``computed`` to ``total`` tokens that the window at ``total`` covers (vLLM
        nulls a sliding group's blocks before token ``total - window + 1``)."""
        bs = self.engine.block_size
        return not any(NULL_BLOCK in ids[kept.start : kept.stop]
                       for group, ids in zip(self._groups, remote) if (kept := group.loaded(computed, total, bs)))

    def _refuse(self, request_id: str, why: str) -> None:
        """A hand-off that cannot be used is a miss (the engine recomputes), said once per request."""
        if not why or request_id in self._refused:
            return
        self._refused.add(request_id)
        self.stats.add(refused_handoffs=1)
        log.warning("%s: hand-off of %s refused, recomputing its prompt: %s", self.engine.engine_id, request_id, why)

    def on_allocated(self, request: RequestInfo, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Plan the pull, which releases the hand-off when it ends; or, with nothing to pull (the
        engine's own cache holds it all), release the hand-off now."""
        self._check_open()
        incoming = self._incoming.pop(request.request_id, None)
        if incoming is None:
            return
        bs, n = self.engine.block_size, len(self._groups)
        remote, mine = split_groups(incoming.params["block_ids"], n), split_groups(block_ids, n)
        first = incoming.num_computed // bs
        last = min(-(-(incoming.num_computed + num_external_tokens) // bs), len(remote[0]), len(mine[0]))
        if num_external_tokens <= 0 or last <= first:
            self._let_go(request.request_id, UcxSource.of(incoming.params, ()), "cached here")
            return
        # per group, the positions this engine keeps a block at (a sliding window nulls the others); a
        # NULL_BLOCK of the producer's among them fails the read, and the engine recomputes
        pairs = [[(r, m) for r, m in zip(theirs[first:last], ours[first:last]) if m != NULL_BLOCK]
                 for theirs, ours in zip(remote, mine)]
        source = UcxSource.of(incoming.params, tuple(r for group in pairs for r, _ in group),
                              tuple(len(group) for group in pairs) if n > 1 else ())
        local = tuple(m for group in pairs for _, m in group)
        self.loads.plan(BlockLoad(request.request_id, local, source=source))
        if source.resliced(self.engine.world_size):  # our ranks do not release: several may read one of theirs
            self._resliced[request.request_id] = source

    def _let_go(self, request_id: str, src: UcxSource, why: str) -> None:
        """Tell every producer rank that ``request_id`` will not pull ``src`` (see :mod:`.releaser`)."""
        log.debug("%s: %s will not pull %s from %s (%s): releasing it", self.engine.engine_id, request_id,
                  src.remote_request_id, src.engine_id, why)
        self.stats.add(unpulled_handoffs=1)
        self._releaser.release(src.addresses, src, aborted=True)

    def on_report(self, report: WorkerReport) -> None:
        self._check_open()
        self.loads.report(report)  # a pull reserves nothing here: the results only end the loads' tracking
        for rid in report.finished_loading & self._resliced.keys():  # every rank of ours has read: free theirs
            src = self._resliced.pop(rid)
            self._releaser.release(src.addresses, src, aborted=False)

    # ---- both ----
    def plan_step(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        self._check_open()
        loads, held = self.loads.take()
        extra = {PLAN: UcxPlan(self._grant_key, tuple(self._holds))} if self.engine.role != "consumer" else {}
        self._holds = []
        return StepPlan(loads=loads, held=held, extra=extra)

    def on_finished(self, request: RequestInfo, block_ids: Sequence[int]) -> FinishDecision:
        self._check_open()
        incoming = self._incoming.pop(request.request_id, None)
        if incoming is not None:  # ended before it was scheduled: its producer still holds the blocks
            self._let_go(request.request_id, UcxSource.of(incoming.params, ()), "ended unscheduled")
        self._refused.discard(request.request_id)
        ending, op = self.loads.finish(request.request_id)
        if ending is Ending.IN_FLIGHT:  # a pull still writes into its blocks: freed once the worker reports it
            return FinishDecision(delay_free=True)
        if ending is Ending.DROPPED:  # the pull never started: nothing arrived; the producer may free its blocks
            self._resliced.pop(request.request_id, None)
            if op is not None and isinstance(op.source, UcxSource):
                self._let_go(request.request_id, op.source, "ended before its pull")
            return FinishDecision()
        if self.engine.role == "consumer" or not _wants_remote_decode(self.engine.role, request):
            return FinishDecision()
        return self._offer(request, block_ids)

    def close(self) -> None:
        if not self._closed:
            self._releaser.close()
        super().close()

    # ---- producer ----
    def _offer(self, request: RequestInfo, block_ids: Sequence[int]) -> FinishDecision:
        """Hold the request's full prompt blocks for a consumer and name them in the transfer params."""
        groups = split_groups(block_ids, len(self._groups))
        full = min(request.num_prompt_tokens // self.engine.block_size, len(groups[0]))
        found = [addresses.lookup(self.options, self.engine.engine_id, r) for r in range(self.engine.world_size)]
        if not full or found[0] is None:
            if full:
                log.warning("%s: no published metadata address (worker not started?); %s not offered",
                            self.engine.engine_id, request.request_id)
            return FinishDecision()
        ids = tuple(int(i) for group in groups for i in group[:full])  # group-major, as the consumer reads them
        expires_at = time.time() + self.options.lease_s
        seal = onesided.new_seal(self._handoffs)
        self._handoffs += 1
        self._holds.append(Hold(request.request_id, ids, expires_at, seal))
        params = handoff_params(self.engine.engine_id, request.request_id, ids, full * self.engine.block_size,
                                expires_at, self._grant_key, found, seal, groups=len(groups))
        return FinishDecision(delay_free=True, transfer_params=params)


__all__ = ["UcxScheduler"]
