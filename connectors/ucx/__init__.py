"""``ucx`` — peer-to-peer KV hand-off: the consumer pulls the blocks straight out of the producer's KV cache.

The producer keeps a finished prompt's blocks (``delay_free``) and names them in the transfer params
it hands the consumer; the consumer's worker pulls them over UCX and tells the producer to free
them. Bulk bytes go over UCX (shared memory or ``cma`` between processes of one host, TCP or — with a
site UCX — RDMA between hosts); everything else over the gRPC metadata plane (:mod:`kvbridge.metadata`).

The package, file by file:

- :mod:`.options` — :class:`UcxOptions` (what a user sets) and :class:`UcxStats` (what it counts).
- :mod:`.params` — transfer params (written by a producer, checked field by field on a consumer) and
  the typed plan payloads: :class:`UcxSource` (``BlockLoad.source``), :class:`UcxPlan` and :class:`Hold`.
- :mod:`.addresses` — where a producer's workers listen, published for its scheduler.
- :mod:`.scheduler` — :class:`UcxScheduler`, over the core's :class:`~kvbridge.lifecycle.LoadBook`.
- :mod:`.worker` — :class:`UcxWorker`, over the core's :class:`~kvbridge.lifecycle.Transfers`, with
- :mod:`.server` (a producer's handshakes, pulls served, releases, leases) and
- :mod:`.puller` (a consumer's handshakes, one-sided reads or two-sided pulls, releases).
- :mod:`.onesided` — one-sided reads into the consumer's KV (``cma``, UCX GET) and the grants that guard them.
- :mod:`.wire` and :mod:`.staging` — the two-sided path's control messages and staging buffers.
- :mod:`.runtime` — the process-wide ucxx runtime, transport choice and the ``cma`` safety rule.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from kvbridge.connectors.ucx.options import UcxOptions, UcxStats
from kvbridge.connectors.ucx.params import PARAMS_VERSION, PLAN, Hold, UcxPlan, UcxSource
from kvbridge.connectors.ucx.scheduler import UcxScheduler
from kvbridge.connectors.ucx.wire import CONTROL_BYTES, CONTROL_TAG, WORKER_ADDRESS
from kvbridge.connectors.ucx.worker import UcxWorker

from kvbridge import native
from kvbridge.contract import Backend, EngineInfo
from kvbridge.options import writable_directory


class UcxBackend(Backend):
    """The ``ucx`` backend; ``stats`` (:class:`UcxStats`) counts for every side it made."""

    name: ClassVar[str] = "ucx"
    kind: ClassVar[Literal["store", "peer"]] = "peer"
    options_type: ClassVar[type[Any]] = UcxOptions
    supports_kv_groups: ClassVar[bool] = True  # one-sided reads address each group's layers apart

    def __init__(self, options: UcxOptions):
        writable_directory(str(options.registry), "ucx option 'registry_dir'", mode=0o700)
        super().__init__(options)
        self.stats = UcxStats()

    def scheduler(self, engine: EngineInfo) -> UcxScheduler:
        return UcxScheduler(self.options, engine, self.stats)

    def worker(self, engine: EngineInfo) -> UcxWorker:
        return UcxWorker(self.options, engine, self.stats)


BACKEND = UcxBackend


def describe() -> str:
    """Which data path a consumer takes here (for ``kvbridge backends``)."""
    from kvbridge.connectors.ucx import onesided

    ok, why = onesided.available()
    if not ok:
        return f"data path: two-sided tag sends (one-sided unavailable: {why})"
    return (f"data path: one-sided reads, {native.describe()}: cma on one host, else ucp GET with peer error "
            "handling (lane option)")


__all__ = [
    "BACKEND", "CONTROL_BYTES", "CONTROL_TAG", "PARAMS_VERSION", "PLAN", "WORKER_ADDRESS", "Hold", "UcxBackend",
    "UcxOptions", "UcxPlan", "UcxScheduler", "UcxSource", "UcxStats", "UcxWorker", "describe",
]
