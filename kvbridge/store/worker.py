"""Worker side of every store: :class:`StoreWorker` runs a :class:`~kvbridge.store.base.StoreIO`'s loads
and saves on the IO thread (layerwise loads on their own), never in the forward pass."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvbridge.contract import BlockLoad, BlockSave, EngineInfo, StepPlan, WorkerReport, WorkerSide
from kvbridge.layout import KVLayout
from kvbridge.lifecycle import Transfers
from kvbridge.stats import TransferStats
from kvbridge.store.base import LayerwiseIO, StoreIO
from kvbridge.transfer import Transfer

log = logging.getLogger(__name__)


class StoreWorker(WorkerSide):
    """Worker side of every store: loads and saves on the IO thread (:class:`Transfers`), never in the
    forward pass."""

    def __init__(self, io: StoreIO, engine: EngineInfo):
        self.io = io
        self.engine = engine
        self.stats: TransferStats = io.stats
        self.transfers = Transfers(f"{engine.engine_id}-io")
        # layerwise loads get their own thread: behind a save on the IO thread, the forward pass would wait
        self.layer_transfers = Transfers(f"{engine.engine_id}-layers") if isinstance(io, LayerwiseIO) else None
        self._layers: list[list[threading.Event]] = []  # per layerwise load of this step: a flag per layer
        self._saves: tuple[BlockSave, ...] = ()

    def register(self, layout: KVLayout) -> None:
        super().register(layout)
        self.io.attach(layout)

    def start_step(self, plan: StepPlan) -> None:
        layout = self._require_layout()
        if plan.flush:  # preempted requests: their blocks may be overwritten by this step's forward pass
            self.transfers.wait(plan.flush)
        self._saves = plan.saves
        self._layers = []
        for op in plan.loads:
            if op.layerwise and self.layer_transfers is not None:
                self.layer_transfers.track(self._begin_layerwise(op, layout, self.layer_transfers),
                                           functools.partial(self._loaded, layout))
            else:
                started = self._started(self.io.start_load, op, layout)
                self.transfers.track(started or self.transfers.run(op, functools.partial(self.io.load, op, layout)),
                                     functools.partial(self._loaded, layout))
        self.transfers.hold(plan.held)

    def _begin_layerwise(self, op: BlockLoad, layout: KVLayout, transfers: Transfers) -> Transfer:
        """Check the load, then copy it layer by layer, on its own thread; ``wait_layer(i)`` waits for layer i."""
        assert isinstance(self.io, LayerwiseIO)
        io = self.io
        flags = [threading.Event() for _ in range(layout.num_layers)]
        self._layers.append(flags)

        def run() -> Sequence[int]:
            try:
                valid, copy = io.load_layers(op, layout)
                for layer, flag in enumerate(flags):
                    copy(layer)
                    flag.set()
            finally:
                for flag in flags:  # never leave the forward pass waiting (a raise fails every block)
                    flag.set()
            return op.block_ids[valid:]

        return transfers.run(op, run)

    def _started(self, start: Callable[[Any, KVLayout], Transfer | None], op: BlockLoad | BlockSave,
                 layout: KVLayout) -> Transfer | None:
        """``start(op, layout)`` (:meth:`StoreIO.start_load` or ``start_save``): the handle of what the store
        started on its native threads, or ``None`` for the IO thread to do it — always when something is
        queued there (a started transfer must not overtake it), or when starting failed (the IO thread then
        reports what fails, the ordinary way). No hand-off to the IO thread and back: a large share of a small
        move (``kvbridge bench --backends cpu --ops load``, its 8 MiB rows)."""
        if self.transfers.queued():
            return None
        try:
            return start(op, layout)
        except Exception as exc:
            log.debug("native start of %s failed (%s): the IO thread moves it", op.request_id, exc)
            return None

    def wait_layer(self, layer: int) -> None:
        self._check_open()
        for flags in self._layers:
            flags[layer].wait()

    def _loaded(self, layout: KVLayout, transfer: Transfer) -> None:
        """A load is over, however it ran: counted, and its write-back (a chain's promotion) kept to run once
        the load is reported (the request held until that is over)."""
        op = transfer.op
        assert isinstance(op, BlockLoad)
        failed = transfer.failed()
        self._count_load(op, layout, len(failed), transfer.seconds)
        if getattr(op.source, "writes_back", False) and len(failed) < len(op.block_ids):
            back = BlockSave(op.request_id, op.block_ids, op.keys)
            self.transfers.after_load(back, functools.partial(self.io.write_back, op, layout, sorted(failed)),
                                      self._written_back)

    def _count_load(self, op: BlockLoad, layout: KVLayout, failed: int, seconds: float) -> None:
        ok = len(op.block_ids) - failed
        self.stats.add(
            loads=1,
            load_blocks=ok,
            load_bytes=ok * layout.num_layers * layout.block_bytes,
            load_seconds=seconds,
            load_failures=int(bool(failed)),
            failed_blocks=failed,
        )

    def finish_step(self) -> None:
        layout = self._require_layout()
        self._layers = []  # every layer was waited for by now (an engine that skipped some wants none)
        saves, self._saves = self._saves, ()
        if not saves:
            return
        ready = _forward_done(layout)
        for op in saves:
            started = self._started(self.io.start_save, op, layout) if ready is None else None
            if started is None:
                started = self.transfers.run(op, functools.partial(self.io.save, op, layout),
                                             before=None if ready is None else ready.synchronize)
            self.transfers.track(started, functools.partial(self._saved, layout))

    def _saved(self, layout: KVLayout, transfer: Transfer) -> None:
        """A save is over, however it ran: counted (a failed one loses a cache entry, never the request)."""
        if transfer.failed() or transfer.error is not None:
            self.stats.add(save_failures=1)
            return
        n = len(transfer.op.block_ids)
        self.stats.add(saves=1, save_blocks=n, save_bytes=n * layout.num_layers * layout.block_bytes,
                       save_seconds=transfer.seconds)

    def _written_back(self, transfer: Transfer) -> None:
        if transfer.error is not None:
            self.stats.add(save_failures=1)

    def poll(self) -> WorkerReport:
        self._check_open()
        report = self.transfers.poll()
        if self.layer_transfers is not None:
            report = WorkerReport.merge([report, self.layer_transfers.poll()])
        return report

    def wait_idle(self, timeout: float | None = None) -> bool:
        self._check_open()
        idle = self.layer_transfers is None or self.layer_transfers.wait(timeout=timeout)
        return self.transfers.wait(timeout=timeout) and idle

    def close(self) -> None:
        if not self._closed:
            if self.layer_transfers is not None:
                self.layer_transfers.close()
            self.transfers.close()
            self.io.close()
        super().close()


def _forward_done(layout: KVLayout) -> Any:
    """An event the IO thread waits on before reading KV the forward pass wrote (``None`` on the CPU,
    where the forward pass is over when ``finish_step`` runs)."""
    if layout.device_type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(layout.device))
    return event


__all__ = ["StoreWorker"]
