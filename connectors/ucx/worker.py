"""The ``ucx`` worker side: a :class:`~.server.Server` for the KV it holds (producer) and a
:class:`~.puller.Puller` for KV it pulls (consumer).

What happens to a load around the pull (a background thread, the report, a request that ended while its
pull still wrote its blocks) is the core's :class:`~kvbridge.lifecycle.Transfers`; releases and expired
leases, which end a producer's holds, come from the server and join the same report.
"""

from __future__ import annotations

import functools
import time

from kvbridge.connectors.ucx import hugepages
from kvbridge.connectors.ucx import runtime as rtmod
from kvbridge.connectors.ucx.options import UcxOptions, UcxStats
from kvbridge.connectors.ucx.params import PLAN, UcxPlan
from kvbridge.connectors.ucx.puller import LOAD_THREADS, Puller
from kvbridge.connectors.ucx.server import Server
from kvbridge.connectors.ucx.slots import Slots

from kvbridge.contract import BlockLoad, BlockSave, EngineInfo, StepPlan, WorkerReport, WorkerSide
from kvbridge.errors import ProtocolError
from kvbridge.layout import KVLayout
from kvbridge.lifecycle import Transfers
from kvbridge.transfer import Transfer


class UcxWorker(WorkerSide):
    """Worker side: serves pulls of the KV it holds (producer) and/or pulls KV from producers (consumer)."""

    def __init__(self, options: UcxOptions, engine: EngineInfo, stats: UcxStats):
        self.options = options
        self.engine = engine
        self.stats: UcxStats = stats
        self.rt = rtmod.runtime(options.progress_mode, options.ucx_tls)
        self.server: Server | None = None
        self._puller: Puller | None = None
        # a pull mostly waits on its producer: several at once, on threads of that producer's own, so a dead
        # producer's loads never make a healthy one's wait (:mod:`.slots`)
        slots = Slots(f"ucx-{engine.engine_id}", LOAD_THREADS, self._producer)
        self.transfers = Transfers(f"ucx-{engine.engine_id}", pool=slots)

    @property
    def metadata_address(self) -> str | None:
        """Where consumers reach this (producer) worker's metadata server; ``None`` for a consumer."""
        return self.server.address if self.server is not None else None

    def register(self, layout: KVLayout) -> None:
        super().register(layout)
        if self.options.huge_pages and self.options.lane != "two-sided":
            hugepages.back_with_huge_pages(layout)  # before anyone reads it one-sided
        if self.engine.role in ("producer", "both"):
            self.server = Server(self.options, self.engine, layout, self.rt, self.stats)
        if self.engine.role in ("consumer", "both"):
            self._puller = Puller(self.options, self.engine, layout, self.rt, self.stats)

    def _producer(self, op: BlockLoad | BlockSave) -> str:
        """The lane of ``op``'s IO thread: the producer it loads from."""
        return self._puller.producer(op) if self._puller is not None else ""

    def start_step(self, plan: StepPlan) -> None:
        self._require_layout()
        ucx_plan = plan.extra.get(PLAN)
        if self.server is not None and isinstance(ucx_plan, UcxPlan):
            self.server.hold(ucx_plan)
        if plan.loads and self._puller is None:
            raise ProtocolError(f"{self.engine.engine_id} is a {self.engine.role}: it cannot load")
        for op in plan.loads:
            assert self._puller is not None
            # running already on a native thread where it can (no Python thread between the engine and the
            # read), else a pull on an IO thread, due timeout_s from now however long it waits for one
            due = time.monotonic() + self.options.timeout_s
            started = self._puller.start(op) or self.transfers.run(op, functools.partial(self._puller.load, op, due))
            self.transfers.track(started, self._tally)
        self.transfers.hold(plan.held)

    def _tally(self, load: Transfer) -> None:
        failed = load.failed()
        self.stats.add(loads=1, load_failures=int(bool(failed)), failed_blocks=len(failed))

    def finish_step(self) -> None:
        self._require_layout()  # nothing at a step's end: consumers pull a producer's KV, nothing is pushed

    def poll(self) -> WorkerReport:
        self._check_open()
        released = self.server.take_finished() if self.server is not None else ()
        report = self.transfers.poll(also_saved=released)
        if self._puller is not None:
            self._puller.release_reported()
        return report

    def wait_idle(self, timeout: float | None = None) -> bool:
        self._check_open()
        return self.transfers.wait(timeout=timeout)

    def close(self) -> None:
        if not self._closed:
            self.transfers.close()  # loads end by their deadlines
            if self._puller is not None:
                self._puller.close()
            if self.server is not None:
                self.server.close()
        super().close()


__all__ = ["UcxWorker"]
