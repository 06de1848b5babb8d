"""vLLM connectors: thin adapters from vLLM's ``KVConnectorBase_V1`` to a kvbridge backend.

vLLM builds one connector instance per role: a SCHEDULER instance in the engine-core process and a
WORKER instance in every worker process. Each instance here builds the backend named in the config
and keeps only that role's half of it (:class:`SchedulerAdapter` over a
:class:`~kvbridge.contract.SchedulerSide`, or :class:`WorkerAdapter` over a
:class:`~kvbridge.contract.WorkerSide`); calling a method of the other role raises a clear
:class:`RuntimeError`. Everything the adapter does is translation — vLLM objects to kvbridge's plain
types and back — so a backend behaves the same under vLLM as under :class:`~kvbridge.testing.MiniEngine`.

Configuration (``--kv-transfer-config``)::

    {"kv_connector": "kvbridge.FSConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"path": "/mnt/kv"}}

``kv_connector_extra_config`` holds the backend's options (validated at start-up by
:func:`kvbridge.registry.create`; a misspelt option fails there), plus two keys of the adapter's own:
``backend`` (only for :class:`KVBridgeConnector`: the registry name), ``namespace`` (replaces the
default namespace derived from the model, e.g. for engines loading one model from different paths),
and ``directory`` / ``advertise_url`` / ``directory_ttl_s`` (publish the engine's prefix cache for a
cache-aware router: :mod:`kvbridge.serving.publishing`).

Mapping, in vLLM's call order:

- ``get_num_new_matched_tokens`` -> ``lookup`` (the request's :func:`~kvbridge.keys.block_keys` over
  its prompt, computed once per request; stable in every process, whatever ``PYTHONHASHSEED``);
- ``update_state_after_alloc`` -> ``on_allocated`` (again with 0 tokens once an async load is over);
- ``build_connector_meta`` -> ``plan_step``; the :class:`~kvbridge.contract.StepPlan` travels to the
  workers inside :class:`KVBridgeMetadata`;
- worker: the first of ``bind_connector_metadata`` / ``wait_for_layer_load`` / ``save_kv_layer`` /
  ``start_load_kv`` in a step -> ``start_step`` (vLLM calls ``start_load_kv`` *after* the forward
  unless the step has synchronous loads); ``wait_for_save`` -> ``finish_step``; ``get_finished`` ->
  ``poll`` (failed blocks are kept for ``get_block_ids_with_load_errors``, so vLLM recomputes them);
- ``update_connector_output`` -> ``on_report``; ``request_finished`` -> ``on_finished``.

KV-cache groups (vLLM's hybrid manager: sliding-window, full-attention and Mamba layers apart): every
connector here is ``SupportsHMA``, so vLLM keeps the hybrid manager on; the backend gets every group
(``EngineInfo.kv_groups``, group-major block ids, vLLM's null block as ``NULL_BLOCK``) if it declares
``supports_kv_groups`` (ucx and every store), and Mamba state groups (``KVGroup.state``) only if it
declares ``supports_state_groups`` (every store), else start-up fails naming it. A store's worker sees
each shared tensor once (:func:`shared_tensors`); ucx's sees each group's layers.

One guard keeps a backend's answers from confusing vLLM: a request that ends during its async load
keeps only vLLM's own hold on its blocks (see :meth:`SchedulerAdapter.request_finished`). (That a
request whose load failed is never offered a load again is the backends' own rule, kept by the
core's :class:`~kvbridge.lifecycle.LoadBook`, so every engine gets it, not only vLLM.)
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from kvbridge import registry
from kvbridge.errors import ConfigError
from kvbridge.serving.publishing import CachePublisher, PublishOptions
from kvbridge.vllm.adapters import OtherRole, SchedulerAdapter, WorkerAdapter
from kvbridge.vllm.compat import KVConnectorBase_V1, KVConnectorFactory, KVConnectorRole, SupportsHMA
from kvbridge.vllm.config import (
    engine_info,
    engine_namespace,
    group_layers,
    hit_source,
    kv_cache_dtype,
    kv_events_on,
    split_extra_config,
)
from kvbridge.vllm.events import TierEvents, tiers_of
from kvbridge.vllm.messages import KVBridgeMetadata, KVBridgeStats
from kvbridge.vllm.prom import KVBridgePromMetrics

log = logging.getLogger(__name__)

# ---- the connector classes ---------------------------------------------------------------------


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A kvbridge backend as a vLLM KV connector; ``kv_connector_extra_config["backend"]`` names it.

    The subclasses fix the backend: :class:`UCXConnector`, :class:`FSConnector`,
    :class:`CPUConnector`, :class:`ChainConnector`. Each moves every KV-cache group (full attention,
    sliding windows: ``SupportsHMA``), so vLLM keeps its hybrid KV-cache manager on.
    """

    backend_name: ClassVar[str | None] = None
    _scheduler: Any  # SchedulerAdapter, or OtherRole on a worker
    _worker: Any  # WorkerAdapter, or OtherRole on the scheduler
    _side: SchedulerAdapter | WorkerAdapter

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        name, options, namespace = split_extra_config(self.backend_name, ktc.kv_connector_extra_config)
        publish = PublishOptions.pop(options)  # checked on every role; used by the scheduler's
        backend = registry.create(name, options)
        worker = role == KVConnectorRole.WORKER
        engine = engine_info(vllm_config, kv_cache_config, worker=worker, namespace=namespace)
        if engine.kv_groups and not backend.supports_kv_groups:
            raise ConfigError(f"the {name} backend moves one KV-cache group; this model has {len(engine.kv_groups)} "
                              "(turn vLLM's hybrid KV-cache manager off: --disable-hybrid-kv-cache-manager)")
        if any(g.state for g in engine.kv_groups) and not backend.supports_state_groups:
            raise ConfigError(f"the {name} backend moves no Mamba state (a {backend.kind} reads a producer's finished "
                              "request, which keeps only its last state, not one at a block boundary a consumer can "
                              "resume from); use a store: "
                              "fs, cpu, lmcache or chain")
        self.engine = engine
        self.backend_kind = backend.kind
        self._cache_hit_source = hit_source(name)
        if worker:
            self._worker = WorkerAdapter(backend.worker(engine), engine, kv_cache_dtype(vllm_config),
                                         group_layers(kv_cache_config), per_tensor=backend.kind == "store")
            self._scheduler = OtherRole("WORKER", "scheduler")
            self._side = self._worker
        else:
            publisher = None
            if publish is not None:
                publisher = CachePublisher(publish, vllm_config, engine.block_size, int(getattr(kv_cache_config, "num_blocks", 0) or 0))
            side = backend.scheduler(engine)
            events = None
            if kv_events_on(vllm_config) and hasattr(side, "index"):
                events = TierEvents(tiers_of(side.index, name), engine.block_size)
            self._scheduler = SchedulerAdapter(side, engine, publisher, events)
            self._worker = OtherRole("SCHEDULER", "worker")
            self._side = self._scheduler
        log.info("kvbridge %s connector (%s, %s) for engine %s", name, role.name, engine.role, engine.engine_id)

    # ---- worker role -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.begin(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.begin(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(self._connector_metadata, layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(self._connector_metadata, layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # ---- scheduler role ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, self._scheduler.flat((block_ids,)))

    def take_events(self) -> list[Any]:
        """What kvbridge's store tiers newly hold or dropped, as vLLM KV-cache events (:mod:`kvbridge.vllm.events`)."""
        events = self._scheduler.events
        return events.take() if events is not None else []

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, self._scheduler.flat(block_ids))

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """ucx: every KV-cache group (it reads the producer's own blocks of each group); a store: vLLM's
        default, the prefix-cacheable groups (what a hash-addressed store holds)."""
        if self.backend_kind == "store":
            return tuple(super().get_loaded_kv_cache_group_ids(request))
        return tuple(range(len(getattr(self._kv_cache_config, "kv_cache_groups", None) or ()) or 1))

    @property
    def requires_kv_delivery(self) -> bool:
        """Only ucx hands off KV a consumer must receive; a store's save is best effort (a dropped one is a
        later miss), so a preempted request need not be recomputed for it (vLLM's default: any producer)."""
        return self.backend_kind != "store" and bool(self._kv_transfer_config.is_kv_producer)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33's hook; its default says yes): kvbridge's backends hold the KV tensors' addresses
        (ucx exports them to its peers, the stores copy from them on their own threads), which sleep mode
        frees and remaps."""
        return False

    # ---- both roles --------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        return self._side.counters.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVBridgePromMetrics:
        """kvbridge's series on vLLM's ``/metrics`` (:mod:`kvbridge.vllm.prom`)."""
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        backend = str(cls.backend_name or extra.get("backend") or "unknown")
        lane = str(extra.get("lane", "auto")) if backend == "ucx" else None
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, backend=backend, lane=lane)

    def totals(self) -> dict[str, Any]:
        """Lifetime :class:`~kvbridge.stats.TransferStats` counters of this instance's side."""
        return self._side.counters.totals()

    def shutdown(self) -> None:
        self._side.close()


class UCXConnector(KVBridgeConnector):
    """Peer-to-peer pulls over UCX (``ucx`` backend); no options needed on one host."""

    backend_name = "ucx"


class FSConnector(KVBridgeConnector):
    """Shared-filesystem store (``fs`` backend); option ``path`` (required)."""

    backend_name = "fs"


class CPUConnector(KVBridgeConnector):
    """Bounded host-memory offload tier (``cpu`` backend); option ``capacity_bytes`` (required)."""

    backend_name = "cpu"


class ChainConnector(KVBridgeConnector):
    """Ordered store tiers (``chain`` backend); option ``tiers``: ``[{"backend": NAME, ...}, ...]``."""

    backend_name = "chain"


CONNECTORS = ("KVBridgeConnector", "UCXConnector", "FSConnector", "CPUConnector", "ChainConnector")


def register_connectors() -> None:
    """Register every connector with vLLM's factory as ``kvbridge.<Class>``; safe to call repeatedly
    (vLLM runs plugins once in each of its processes, and the factory refuses duplicates)."""
    for name in CONNECTORS:
        try:
            KVConnectorFactory.register_connector(f"kvbridge.{name}", __name__, name)
        except ValueError:  # already registered (by an earlier call in this process)
            if f"kvbridge.{name}" not in getattr(KVConnectorFactory, "_registry", {f"kvbridge.{name}"}):
                raise


__all__ = [
    "CONNECTORS",
    "CPUConnector",
    "ChainConnector",
    "FSConnector",
    "KVBridgeConnector",
    "KVBridgeMetadata",
    "KVBridgeStats",
    "SchedulerAdapter",
    "UCXConnector",
    "WorkerAdapter",
    "engine_info",
    "engine_namespace",
    "register_connectors",
    "split_extra_config",
]

